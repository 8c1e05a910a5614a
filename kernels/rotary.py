"""Neox-style rotary position embedding (rotate halves), applied in place to q and k."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < NUM_HEADS) & (j[None, :] < HALF)
    ptr1 = base_ptr + heads[:, None] * stride_h + j[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(ptr1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (b * cos + a * sin).to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    # One cos/sin row serves every head of the token: that is why a program owns a whole token.
    cos = tl.load(cos_sin_ptr + pos * stride_c + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF)


def _launch_rotary(q, k, positions, cos_sin_cache):
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    block_half = triton.next_power_of_2(half)
    block_hq = triton.next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half >= 2048 else 1,
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H_q, D] and k [T, H_kv, D] IN PLACE by positions [T]; returns (q, k) themselves.

    cos_sin_cache: [max_pos, rot_dim] fp32 holding cat(cos, sin), each rot_dim / 2 wide; the first
    rot_dim (<= D) dims of each head are rotated, the rest are left alone. q and k may be strided
    views (e.g. of a fused QKV output) with a unit-stride last dim. Math in fp32.
    """
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be unit-stride"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(-1) == 1
    rot_dim = cos_sin_cache.shape[1]
    assert rot_dim % 2 == 0 and rot_dim <= q.shape[2], (rot_dim, q.shape)
    assert positions.shape == (q.shape[0],)
    if q.shape[0] > 0:
        _launch_rotary(q, k, positions, cos_sin_cache)
    return q, k
