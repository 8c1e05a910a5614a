"""Everything between the QKV projection and attention, in one kernel: per-head RMSNorm of q and k
(Qwen3; optional), rotary embedding of both, and the store of this step's K/V into the paged cache.

Unfused, a decoder layer spends six launches here (two copies of the strided q/k views, two norms,
rotary, the store); at small batches each launch costs more than the bytes it moves, so a decode
step's graph is shorter by 140 nodes on a 28-layer model. The rounding follows the unfused ops
(`rms_norm` then `apply_rotary`): normalise in fp32, round to the model dtype, scale by the weight
and round, rotate in fp32 and round.
"""

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue
from nanoplane.kernels.rmsnorm import row_inv_rms, row_norm_args


@triton.jit
def _norm_rotate(x1, x2, w_ptr, cos, sin, eps, scale, like_ptr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, ROW_NORM: tl.constexpr):
    """x1, x2: [heads, BLOCK_HALF] fp32 halves of each head -> the rotated halves, rounded to the
    element type of `like_ptr` (the model dtype). With ROW_NORM they are first scaled by `scale`
    and rounded: the projection of the un-normalised row made to the projection of the normed one."""
    OUT_DTYPE = like_ptr.dtype.element_ty
    if ROW_NORM:
        x1 = (x1 * scale).to(OUT_DTYPE).to(tl.float32)
        x2 = (x2 * scale).to(OUT_DTYPE).to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        r = tl.rsqrt(variance + eps)[:, None]
        j = tl.arange(0, BLOCK_HALF)
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * r).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(OUT_DTYPE)
    y2 = (x2 * cos + x1 * sin).to(OUT_DTYPE)
    return y1, y2


@triton.jit
def _qkv_prologue_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    rows_ptr, stride_t, stride_c, stride_rows, eps, row_eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
    ROW_NORM: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    # One program per token: its cos/sin row serves every head, and q, k and v sit in one row.
    token = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + token * stride_t
    scale = 1.0
    if ROW_NORM:
        scale = row_inv_rms(rows_ptr, token, stride_rows, row_eps, HIDDEN, BLOCK_HIDDEN)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    half_mask = j < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_c + j, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + j, mask=half_mask, other=0.0).to(tl.float32)[None, :]

    # q: rewritten in place, so attention reads it from the projection's output without a copy.
    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < NUM_Q_HEADS) & half_mask[None, :]
    q1_ptr = row + hq[:, None] * HEAD_DIM + j[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
    y1, y2 = _norm_rotate(q1, q2, q_weight_ptr, cos, sin, eps, scale, qkv_ptr, HEAD_DIM, HALF, BLOCK_HALF, HAS_NORM,
                          ROW_NORM)
    tl.store(q1_ptr, y1, mask=q_mask)
    tl.store(q1_ptr + HALF, y2, mask=q_mask)

    # A slot of -1 marks a CUDA-graph padding row: it must leave the cache untouched.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        hk = tl.arange(0, BLOCK_HKV)
        kv_mask = (hk[:, None] < NUM_KV_HEADS) & half_mask[None, :]
        k1_ptr = row + NUM_Q_HEADS * HEAD_DIM + hk[:, None] * HEAD_DIM + j[None, :]
        k1 = tl.load(k1_ptr, mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k1_ptr + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        ky1, ky2 = _norm_rotate(k1, k2, k_weight_ptr, cos, sin, eps, scale, qkv_ptr, HEAD_DIM, HALF, BLOCK_HALF,
                                HAS_NORM, ROW_NORM)
        # (New names: Triton refuses a branch that rebinds q's y1/y2 with another shape.)
        # The cache is contiguous [num_blocks, block_size, H_kv, D]: a slot is a row index.
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + hk[:, None] * HEAD_DIM + j[None, :]
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, ky1.to(cache_dtype), mask=kv_mask)
        tl.store(k_cache_ptr + dst + HALF, ky2.to(cache_dtype), mask=kv_mask)
        v1_ptr = k1_ptr + NUM_KV_HEADS * HEAD_DIM
        v1 = tl.load(v1_ptr, mask=kv_mask, other=0.0)
        v2 = tl.load(v1_ptr + HALF, mask=kv_mask, other=0.0)
        if ROW_NORM:
            v1 = (v1.to(tl.float32) * scale).to(v1.dtype)
            v2 = (v2.to(tl.float32) * scale).to(v2.dtype)
        tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=kv_mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=kv_mask)


def qkv_prologue(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    row_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Normalise (if weights are given) and rotate q and k of a packed QKV projection output, store
    k and v at their cache slots, and return q as a [T, H_q, D] view of `qkv` (rewritten in place).

    `row_norm` = (rows [T, hidden], eps): qkv is the projection of the un-normalised rows through a
    weight that holds the RMSNorm's scale (models/norm_fold.py); q, k and v are first multiplied by
    each row's 1 / rms and rounded, which makes them the projection of the normed rows.

    qkv: [T, (H_q + 2 H_kv) * D], unit-stride rows of q heads, then k heads, then v heads;
    positions [T]; cos_sin_cache [max_pos, D] fp32 of cat(cos, sin) (full-width rotary only);
    q_weight / k_weight: [D] per-head RMSNorm weights, both or neither; slot_mapping [T] int (-1
    skips the cache write); caches [num_blocks, block_size, H_kv, D] contiguous.
    """
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.dim() == 2 and qkv.stride(-1) == 1 and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.stride(-1) == 1 and cos_sin_cache.shape[1] == head_dim, \
        "the fused prologue needs full-width rotary"
    assert head_dim % 2 == 0 and positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.shape[2] == num_kv_heads and (q_weight is None) == (k_weight is None)
    if num_tokens:
        half = head_dim // 2
        block_half = triton.next_power_of_2(half)
        block_hq = triton.next_power_of_2(num_q_heads)
        has_norm = q_weight is not None
        rows, row_eps, hidden = row_norm_args(row_norm, qkv, num_tokens)
        _qkv_prologue_kernel[(num_tokens,)](
            qkv, positions, cos_sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
            slot_mapping, k_cache, v_cache, rows, qkv.stride(0), cos_sin_cache.stride(0), rows.stride(0), eps,
            row_eps, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
            BLOCK_HQ=block_hq, BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
            HAS_NORM=has_norm, ROW_NORM=row_norm is not None, HIDDEN=hidden,
            BLOCK_HIDDEN=triton.next_power_of_2(hidden),
            num_warps=4 if block_hq * block_half >= 1024 else 1, **pdl_args(qkv.device),
        )
    return qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
