"""Paged decode attention, split-KV (flash-decoding).

One query token per sequence. A program owns one (sequence, KV head, context split) and all the
query heads of that KV head's GQA group, so each K/V tile is read once per group rather than once
per query head. Splitting the context keeps the GPU busy when batch x KV heads alone is too few
programs (small batches, long contexts); a second kernel merges the partial softmax states.
"""

import functools

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue

# Launch parameters (`python -m benchmarks.kernel_speed --only decode_sweep` times the alternatives).
# block_n: tokens per inner-loop tile, independent of the cache's block size (each token's page is
# looked up on its own, so a tile may straddle pages). heads_fastest: the grid's fastest axis is the KV
# head, so programs running side by side read neighbouring pieces of the same tokens' cache rows.
TUNING = dict(block_n=64, num_warps=4, num_stages=3, heads_fastest=True)
# `seq_order` (longest context first) is followed only from this many waves of programs over the SMs:
# with many it keeps a long row from running alone at the end of the launch, with few it crowds the
# long rows together. `configure` moves it (0: always; NANOPLANE_DECODE_ORDER_WAVES).
ORDER_MIN_WAVES = 4.0
# Between two and this many waves of one-split programs, two splits: halving every row's work halves
# the uneven end of the launch, which with few waves outweighs the second kernel. `configure` moves
# it (0: off; NANOPLANE_DECODE_TWO_SPLIT_WAVES).
TWO_SPLIT_WAVES = 5.5
# With programmatic dependent launch, a program loads its row's context length, first page-table entry
# and place in `seq_order` before it waits for the QKV prologue: none is written during the step, so
# their dependent loads overlap the prologue. `configure(early_setup=False)` waits first.
EARLY_SETUP = True


def configure(order_min_waves: float, two_split_waves: float, early_setup: bool) -> None:
    """The launch choices above, as the data plane's tuning (nanoplane.settings.Tuning) gives them."""
    global ORDER_MIN_WAVES, TWO_SPLIT_WAVES, EARLY_SETUP
    ORDER_MIN_WAVES, TWO_SPLIT_WAVES, EARLY_SETUP = order_min_waves, two_split_waves, early_setup


# Below this many tokens per split, the partial-state traffic outweighs the extra parallelism.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


@triton.jit
def _attend(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, scale_log2e, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, seq, kv_head, split,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    WAIT_HERE: tl.constexpr = False,
):
    """One (sequence, KV head, split): its GQA group's queries over the split's keys. WAIT_HERE: the
    programmatic-dependent-launch wait comes after the loads of the row's context length and first
    page-table entry, which no kernel of the step writes after its start, so that their latency overlaps
    the previous kernel (the QKV prologue, which writes the queries and the step's own K/V)."""
    ctx = tl.load(context_lens_ptr + seq)
    # Per-sequence split length, tile-aligned: short sequences leave trailing splits empty (cheap
    # exits) instead of spreading a few keys over many programs.
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles start on multiples of BLOCK_N (so does every split), so where BLOCK_N divides the page
    # size a tile lies within one page: one table entry a tile instead of one a token, read a tile
    # ahead, so that a tile's K/V addresses wait on no load of their own.
    ONE_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    if ONE_PAGE:
        next_page = tl.load(table + start // PAGE_SIZE, mask=start < end, other=0).to(tl.int64)
    if WAIT_HERE:
        pdl_prologue(True)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_off = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        if ONE_PAGE:
            # n0 < end: the tile's page is one of the sequence's; its masked tail stays in that page.
            page = next_page
            following = n0 + BLOCK_N
            next_page = tl.load(table + following // PAGE_SIZE, mask=following < end, other=0).to(tl.int64)
            row = page * PAGE_SIZE + (n0 % PAGE_SIZE) + tl.arange(0, BLOCK_N)
        else:
            # Entries past the sequence's last page may be garbage: the mask keeps them unread.
            page = tl.load(table + t // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
            row = page * PAGE_SIZE + t % PAGE_SIZE
        kv_off = row[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2e
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        # Single split: finish here and skip the reduce launch. ctx == 0 leaves l_sum == 0 and acc == 0,
        # which must come out as zeros (CUDA-graph padding rows), not NaN.
        o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        o_off = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Empty splits store m = -inf, l_sum = 0 too: the reduce reads every split unconditionally.
        row_ml = (seq * NUM_Q_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(part_m_ptr + row_ml, m, mask=g_mask)
        tl.store(part_l_ptr + row_ml, l_sum, mask=g_mask)
        tl.store(part_acc_ptr + row_ml[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, seq_order_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2e, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, HAS_ORDER: tl.constexpr, USE_PDL: tl.constexpr, EARLY_SETUP: tl.constexpr,
):
    if not EARLY_SETUP:
        pdl_prologue(USE_PDL)
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    if HAS_ORDER:
        # Programs start in grid order: handing out the longest contexts first keeps one long
        # sequence from running alone at the end of the launch.
        seq = tl.load(seq_order_ptr + seq)
    _attend(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
            out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, scale_log2e, num_splits,
            stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, seq, kv_head, tl.program_id(2),
            NUM_Q_HEADS, NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, DIRECT, BLOCK_G, BLOCK_D, BLOCK_N, PREC,
            EARLY_SETUP and USE_PDL)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    d_mask = d < HEAD_DIM
    row = (seq * NUM_Q_HEADS + head).to(tl.int64) * num_splits + sp
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    # All splits empty (ctx == 0): exp2(-inf - -inf) would be NaN, so anchor at 0 instead.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l_sum, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    o_off = seq.to(tl.int64) * stride_ob + head * stride_oh + d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    # Decided from shapes only, never from context_lens: reading those back would sync the host
    # and break CUDA-graph capture. Aim for about two waves of programs over the SMs.
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    programs = max(batch * num_kv_heads, 1)
    want = triton.cdiv(2 * sms, programs)
    if want == 1 and programs < TWO_SPLIT_WAVES * sms:
        want = 2
    cap = max(1, min(_MAX_SPLITS, triton.cdiv(max_context, _MIN_SPLIT_TOKENS)))
    return max(1, min(want, cap))


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Separate function so tests can hand in poisoned buffers and prove every split is written.
    return torch.empty(shape, dtype=torch.float32, device=device)


def _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits, tuning, seq_order):
    tune = TUNING if not tuning else {**TUNING, **tuning}
    batch, num_q_heads, head_dim = q.shape
    if batch > 65535:  # a CUDA grid's second axis stops there; the first goes to 2**31 - 1
        tune = {**tune, "heads_fastest": False}
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = _choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * page_size, q.device)
    direct = num_splits == 1
    if seq_order is not None and q.device.type == "cuda":
        waves = batch * num_kv_heads * num_splits / _num_sms(q.device.index or 0)
        seq_order = seq_order if waves >= ORDER_MIN_WAVES else None
    if direct:
        part_acc = part_m = part_l = out  # unused placeholders: DIRECT compiles their stores away
    else:
        part_acc = _workspace((batch, num_q_heads, num_splits, head_dim), q.device)
        part_m = _workspace((batch, num_q_heads, num_splits), q.device)
        part_l = _workspace((batch, num_q_heads, num_splits), q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (num_kv_heads, batch, num_splits) if tune["heads_fastest"] else (batch, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, context_lens if seq_order is None else seq_order,
        out, part_acc, part_m, part_l, scale * 1.4426950408889634, num_splits,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, DIRECT=direct,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=tune["block_n"],
        PREC="ieee" if q.dtype == torch.float32 else "tf32", HEADS_FASTEST=tune["heads_fastest"],
        HAS_ORDER=seq_order is not None, num_warps=tune["num_warps"], num_stages=tune["num_stages"],
        EARLY_SETUP=EARLY_SETUP, **pdl_args(q.device),
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_m, part_l, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4, **pdl_args(q.device),
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its first context_lens[b] cached keys.

    q: [B, H_q, D] (strided views allowed, unit-stride last dim); caches: [num_blocks, block_size,
    H_kv, D] contiguous, same dtype as q; block_tables: [B, max_blocks] int32; context_lens: [B]
    int32. Rows with context_len 0 produce zeros. `out` ([B, H_q, D], q's dtype) may be given for
    static CUDA-graph buffers; `num_splits` overrides the split-KV heuristic and `tuning` entries of
    TUNING (tests, benchmarks). `seq_order` ([B] int32, a permutation of the rows) is the order in
    which rows are handed to programs: longest context first evens out the end of the launch.
    """
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [B, H_q, D] with unit-stride last dim"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
    assert block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
    assert context_lens.shape == (q.shape[0],)
    assert seq_order is None or (seq_order.shape == (q.shape[0],) and seq_order.dtype == torch.int32)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(-1) == 1 and out.dtype == q.dtype
    if q.shape[0] == 0:
        return out
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, num_splits, tuning,
                          seq_order)
