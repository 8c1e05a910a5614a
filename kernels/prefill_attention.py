"""Paged varlen causal attention for prefill: plain, with a cached prefix, and chunked.

Every key is read from the paged cache (this step's K/V were stored before the call), so one
kernel covers all three cases: query i of sequence b sits at absolute position
context_lens[b] - q_len_b + i and sees keys 0..that position.

A program owns BLOCK_Q consecutive query tokens of one sequence times all GROUP query heads of one
KV head, flattened into BLOCK_M = BLOCK_Q * GROUP rows (padded to a power of two). Folding the GQA
group into the rows reads each K/V tile once per group and keeps the dot's M dimension large.
"""

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue

# block_m: query rows (tokens x heads of a group) per program; block_n: keys per inner-loop tile,
# independent of the cache's block size (`python -m benchmarks.kernel_speed --only prefill_sweep` times
# the alternatives). Short prompts waste least on diagonal tiles with small tiles; from LONG_MIN_QUERY
# query tokens a sequence, 128 x 128 tiles pay. The long tiles need 224 KB of shared memory at head
# dim 128 in 16-bit types, so wider heads or fp32 keep the short ones.
TUNING = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)
LONG_TUNING = dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
LONG_MIN_QUERY = 2048


@triton.jit
def _attend_keys(
    acc, m, l_sum, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, lo, hi, scale_log2e, d, d_mask,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_mask = t < hi
        page = tl.load(table + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = page * PAGE_SIZE + t % PAGE_SIZE
        kv_off = row[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2e
        if CAUSAL:
            # Only tiles on the diagonal pay for this; a row may see none of this tile's keys, but
            # key 0 is visible to every row, so m is already finite and no NaN can arise.
            s = tl.where((t[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    return acc, m, l_sum


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
    scale_log2e, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    # Last query tiles of a sequence see the most keys: launch them first so they do not trail.
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    q_start = q_tile * BLOCK_Q
    if q_start >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    token = q_start + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (token < q_len)
    d_mask = d < HEAD_DIM
    q_off = (q_begin + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + token

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys before the tile's first query position are visible to every row: no causal mask.
    full_end = (prefix + q_start) // BLOCK_N * BLOCK_N
    acc, m, l_sum = _attend_keys(
        acc, m, l_sum, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, 0, full_end, scale_log2e,
        d, d_mask, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, PREC,
    )
    kv_end = tl.minimum(prefix + q_start + BLOCK_Q, ctx)
    acc, m, l_sum = _attend_keys(
        acc, m, l_sum, q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, full_end, kv_end, scale_log2e,
        d, d_mask, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, PREC,
    )
    o = acc / l_sum[:, None]
    o_off = (q_begin + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _launch_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, out,
                    tuning):
    long = max_seqlen_q >= LONG_MIN_QUERY and q.element_size() == 2 and q.shape[2] <= 128
    base = LONG_TUNING if long else TUNING
    tune = base if not tuning else {**base, **tuning}
    num_seqs = cu_seqlens_q.shape[0] - 1
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_m = max(tune["block_m"], triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (triton.cdiv(max_seqlen_q, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=tune["block_n"], PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tune["num_warps"], num_stages=tune["num_stages"], **pdl_args(q.device),
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """Causal attention for B packed query chunks over keys read from the paged cache.

    q: [total_q, H_q, D] (strided views allowed, unit-stride last dim); caches: [num_blocks,
    block_size, H_kv, D] contiguous, same dtype as q; cu_seqlens_q: [B+1] int32; context_lens: [B]
    int32, keys per sequence including this chunk (>= its query count); block_tables: [B,
    max_blocks] int32; max_seqlen_q: an upper bound on any sequence's query count. `out` ([total_q,
    H_q, D], q's dtype) may be preallocated; `tuning` overrides entries of TUNING (tests, benchmarks).
    """
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [total_q, H_q, D] with unit-stride last dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert context_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(-1) == 1 and out.dtype == q.dtype
    if q.shape[0] == 0 or num_seqs == 0 or max_seqlen_q <= 0:
        return out
    return _launch_prefill(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q, scale, out, tuning
    )
