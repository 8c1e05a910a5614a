"""Scatter this step's keys and values into the paged KV cache of one layer."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: num_slots * row width overflows int32 for caches of a few tens of GB.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A slot of -1 marks a CUDA-graph padding row: it must leave the cache untouched.
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src_k = token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    # The cache is contiguous [num_blocks, block_size, H, D], so a slot is simply a row index.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _launch_store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    n, num_kv_heads, head_dim = key.shape
    if n == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kvcache_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i] / value[i] ([N, H_kv, D]) to cache slot slot_mapping[i]; slot -1 skips the row.

    The caches are [num_blocks, block_size, H_kv, D] and must be contiguous; key and value may be
    strided views (e.g. slices of a fused QKV output) as long as the last dimension is unit-stride.
    """
    assert key.shape == value.shape and key.dim() == 3, (key.shape, value.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be unit-stride"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == key.shape[1:] and v_cache.shape == k_cache.shape
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    _launch_store_kvcache(key, value, k_cache, v_cache, slot_mapping)
