"""Sampling in one pass over the logits: greedy rows take the argmax, the others a Gumbel-max draw.

For a row at temperature T > 0 the token is argmax(logits + T * g) with g = -log(-log(u)) Gumbel
noise, u uniform in (0, 1): the same argmax as logits / T + g, so an exact draw from
softmax(logits / T), without a softmax, a division or an fp32 copy of the logits (and no overflow
when T is tiny). Rows at T == 0 take argmax(logits). Ties go to the lowest index, as torch.argmax.

The noise is Philox4x32-10 (tl.rand4x), keyed by the row's seed; with Q = ceil(V / 4) its counter
is `offset * Q + i`, and the four words of counter i are the uniforms of columns i, Q + i, 2Q + i
and 3Q + i (the row cut in four quarters, each read contiguously). One Philox call thus serves four
columns, which matters: at 10 rounds per call the integer work, not the read of the logits, would
bound the kernel. For the same reason the GPU takes its two logs from the multi-function unit's log2
rather than libdevice's polynomial (`_gumbel`: the noise within ~1e-6 of the exact formula). A
row's draw depends only on (seed, offset, logits, T), never on the other rows of the batch. NaN
logits never win (torch.argmax would pick them); a row with nothing above -inf gives 0, as
torch.argmax does.

With the vocabulary split over tensor-parallel ranks, `sample_partial` scans one rank's slice of
the columns with the same noise per column and returns each row's best (score, column); the ranks
exchange those pairs and `combine_partials` picks the same token `sample` would pick from the whole
row: the logits are never gathered.
"""

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_prologue

# Index no column reaches: marks "nothing seen yet" in the running argmax.
_NONE = tl.constexpr(2**31 - 1)
# Smallest uniform let through: tl.rand can return 0, whose Gumbel noise would be -inf (and whose
# -log would be +inf); 1e-30 gives finite noise (about -4.2). Its upper end is below 1 already.
_U_MIN = tl.constexpr(1e-30)


@triton.jit
def _uniforms4(seed, counters):
    """The uniforms in (0, 1) of the four quarters' columns at `counters`."""
    u0, u1, u2, u3 = tl.rand4x(seed, counters)
    return (tl.maximum(u0, _U_MIN), tl.maximum(u1, _U_MIN), tl.maximum(u2, _U_MIN), tl.maximum(u3, _U_MIN))


@triton.jit
def _lg2_approx(x):
    # The multi-function unit's log2: one instruction where libdevice's logf takes ~20. Its error is
    # ~2^-22 relative, but ~2^-22.6 absolute near x = 1, where log2(x) itself goes to 0.
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _gumbel(u, FAST_LOG: tl.constexpr):
    """-log(-log(u)). With FAST_LOG (a GPU: the interpreter runs no inline assembly) within ~1e-6 of
    it: what decides a draw is the noise of the u closest to 1, so the inner log must stay accurate
    relative to its tiny result there, which a plain approximate log2 is not (a row of 512 drew a
    token 1.5 below the best score that way)."""
    if FAST_LOG:
        # -ln(u) = -2 atanh(s), s = (u - 1) / (u + 1): for u > 0.9, |s| < 0.053, and three terms of
        # the series are off by under 1e-8 relative (with fp32's roundings 2e-7 over every u there).
        # Below 0.9, |log2(u)| > 0.15 keeps the approximate log2's absolute error a relative ~1e-6.
        s = (u - 1.0) / (u + 1.0)
        s2 = s * s
        near = -2.0 * s * (1.0 + s2 * (1.0 / 3.0 + s2 * 0.2))
        e = tl.where(u > 0.9, near, -0.6931471805599453 * _lg2_approx(u))
        # The outer log's absolute error (~1e-7 near e = 1, ~4e-6 at the largest noise) is what the
        # score gets: far below any gap between two scores that is not a tie.
        return -0.6931471805599453 * _lg2_approx(e)
    else:
        return -tl.log(-tl.log(u))


@triton.jit
def _update(row_ptr, i, live, q: tl.constexpr, VQ, LO, HI, t, u, best, best_idx, NOISE: tl.constexpr,
            FAST_LOG: tl.constexpr):
    # Within one lane and quarter the columns only grow, so a strict > keeps the lowest index of a tie.
    # row_ptr holds columns [LO, HI) of the row (the whole row: LO = 0, HI = V).
    col = q * VQ + i
    mask = live & (col >= LO) & (col < HI)
    x = tl.load(row_ptr + (col - LO), mask=mask, other=float("-inf")).to(tl.float32)
    if NOISE:
        x = x + t * _gumbel(u, FAST_LOG)
    take = x > best
    return tl.where(take, x, best), tl.where(take, col, best_idx)


@triton.jit
def _scan(row_ptr, seed, base, start, stop, VQ, LO, HI, t, BLOCK: tl.constexpr, NOISE: tl.constexpr,
          FAST_LOG: tl.constexpr):
    """(max score, lowest column reaching it) over quarter indices [start, stop) of one row."""
    lanes = tl.arange(0, BLOCK)
    b0 = tl.full((BLOCK,), float("-inf"), tl.float32)
    b1, b2, b3 = b0, b0, b0
    i0 = tl.full((BLOCK,), _NONE, tl.int32)
    i1, i2, i3 = i0, i0, i0
    for s in range(start, stop, BLOCK):
        i = s + lanes
        live = i < stop
        if NOISE:
            u0, u1, u2, u3 = _uniforms4(seed, base + i)
        else:
            u0, u1, u2, u3 = t, t, t, t  # unused
        b0, i0 = _update(row_ptr, i, live, 0, VQ, LO, HI, t, u0, b0, i0, NOISE, FAST_LOG)
        b1, i1 = _update(row_ptr, i, live, 1, VQ, LO, HI, t, u1, b1, i1, NOISE, FAST_LOG)
        b2, i2 = _update(row_ptr, i, live, 2, VQ, LO, HI, t, u2, b2, i2, NOISE, FAST_LOG)
        b3, i3 = _update(row_ptr, i, live, 3, VQ, LO, HI, t, u3, b3, i3, NOISE, FAST_LOG)
    best = tl.maximum(tl.maximum(tl.max(b0, 0), tl.max(b1, 0)), tl.maximum(tl.max(b2, 0), tl.max(b3, 0)))
    idx = tl.minimum(
        tl.minimum(tl.min(tl.where(b0 == best, i0, _NONE), 0), tl.min(tl.where(b1 == best, i1, _NONE), 0)),
        tl.minimum(tl.min(tl.where(b2 == best, i2, _NONE), 0), tl.min(tl.where(b3 == best, i3, _NONE), 0)),
    )
    return best, idx


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, seeds_ptr, offsets_ptr, out_ptr, part_val_ptr, part_idx_ptr,
    stride_row, VQ, SPAN, LO, HI,
    BLOCK: tl.constexpr, SPLIT: tl.constexpr, FAST_LOG: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (row, split): split s covers quarter indices [s * SPAN, (s + 1) * SPAN), of
    which it reads the columns in [LO, HI)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    start = split * SPAN
    stop = tl.minimum(start + SPAN, VQ)
    if t > 0:
        seed = tl.load(seeds_ptr + row)
        base = tl.load(offsets_ptr + row) * VQ
        best, idx = _scan(row_ptr, seed, base, start, stop, VQ, LO, HI, t, BLOCK, True, FAST_LOG)
    else:
        best, idx = _scan(row_ptr, 0, 0, start, stop, VQ, LO, HI, t, BLOCK, False, FAST_LOG)
    if SPLIT:
        tl.store(part_val_ptr + row * tl.num_programs(1) + split, best)
        tl.store(part_idx_ptr + row * tl.num_programs(1) + split, idx)
    else:
        # Only a row whose every score is -inf (or NaN) sees no column; torch.argmax gives 0 there.
        tl.store(out_ptr + row, tl.where(idx == _NONE, 0, idx).to(tl.int64))


@triton.jit
def _reduce_splits_kernel(part_val_ptr, part_idx_ptr, out_ptr, best_ptr, NUM_SPLITS, BLOCK: tl.constexpr,
                          PARTIAL: tl.constexpr, USE_PDL: tl.constexpr):
    """The row's (best score, lowest column reaching it) over its splits: the token id into out, or
    with PARTIAL the score into best_ptr and the column (_NONE if none) into out as int32."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK)
    mask = s < NUM_SPLITS
    val = tl.load(part_val_ptr + row * NUM_SPLITS + s, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * NUM_SPLITS + s, mask=mask, other=_NONE)
    best = tl.max(val, 0)
    first = tl.min(tl.where(val == best, idx, _NONE), 0)
    if PARTIAL:
        tl.store(best_ptr + row, best)
        tl.store(out_ptr + row, first)
    else:
        tl.store(out_ptr + row, tl.where(first == _NONE, 0, first).to(tl.int64))


@triton.jit
def _uniforms_kernel(seeds_ptr, offsets_ptr, out_ptr, stride_row, V, VQ, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    base = tl.load(offsets_ptr + row) * VQ
    u0, u1, u2, u3 = _uniforms4(seed, base + i)
    row_ptr = out_ptr + row.to(tl.int64) * stride_row
    live = i < VQ
    tl.store(row_ptr + i, u0, mask=live & (i < V))
    tl.store(row_ptr + VQ + i, u1, mask=live & (VQ + i < V))
    tl.store(row_ptr + 2 * VQ + i, u2, mask=live & (2 * VQ + i < V))
    tl.store(row_ptr + 3 * VQ + i, u3, mask=live & (3 * VQ + i < V))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time: more splits only cost time
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _check(temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, rows: int, device) -> None:
    assert temperature.shape == (rows,) and temperature.dtype == torch.float32 and temperature.is_contiguous()
    for name, x in (("seeds", seeds), ("offsets", offsets)):
        assert x.shape == (rows,) and x.dtype == torch.int64 and x.is_contiguous(), f"{name} must be int64 [R]"
        assert x.device == device, f"{name} must be on the logits' device"
    assert temperature.device == device


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One token id per row (int64 [R]) of logits [R, V] (bf16/fp16/fp32, unit-stride rows).

    temperature [R] fp32 (0: greedy); seeds, offsets [R] int64 on the logits' device pick each row's
    noise (module docstring). `block` (columns per quarter per step) and `num_splits` (programs per
    row) tune the launch; by default a batch of few rows spreads each row over several programs so
    that a single row still fills the GPU. Nothing here reads the device from the host.
    """
    out, _ = _launch(logits, 0, logits.shape[-1] if logits.dim() else 0, temperature, seeds, offsets, block,
                     num_splits, partial=False)
    return out


def sample_partial(
    logits: torch.Tensor, start: int, vocab_size: int, temperature: torch.Tensor, seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s scan over one slice of the vocabulary: logits [R, n] are columns [start, start + n)
    of rows of `vocab_size` columns (columns at or past vocab_size, a rank's padding, are skipped).

    Returns each row's best score (fp32 [R]; logit plus T times its Gumbel noise) and the lowest
    column reaching it (int32 [R], 2**31 - 1 where no column scored above -inf): combine_partials
    turns the slices' pairs into the ids `sample` gives for the whole rows.
    """
    # A slice may lie wholly in the padding, even past the vocabulary (10 columns over 8 ranks: rank 7
    # holds 14-15): it has no column to offer.
    lo = min(start, vocab_size)
    hi = max(lo, min(start + logits.shape[-1], vocab_size)) if logits.dim() == 2 else lo
    idx, best = _launch(logits, lo, hi, temperature, seeds, offsets, None, None, partial=True,
                        vocab_size=vocab_size)
    return best, idx


def combine_partials(best: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Token ids (int64 [R]) from the slices' sample_partial results stacked as [S, R]: the highest
    score, the lowest column among equal scores, 0 for a row where no slice saw a column."""
    top = best.max(dim=0, keepdim=True).values
    none = torch.iinfo(torch.int32).max
    first = torch.where(best == top, idx, none).min(dim=0).values
    return torch.where(first == none, 0, first).to(torch.int64)


def _launch(logits, lo, hi, temperature, seeds, offsets, block, num_splits, partial, vocab_size=None):
    """(ids int64 [R], None), or with `partial` (columns int32 [R], scores fp32 [R]); the logits hold
    columns [lo, hi) of rows of vocab_size (default hi) columns."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V] with unit-stride rows"
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
    rows = logits.shape[0]
    vocab = hi if vocab_size is None else vocab_size
    assert 0 <= lo <= hi <= vocab and hi - lo <= logits.shape[1]
    _check(temperature, seeds, offsets, rows, logits.device)
    if rows == 0 or hi == lo:  # no column: no score, no column (partial), or id 0 as torch.argmax gives
        if partial:
            return (torch.full((rows,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=logits.device),
                    torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device))
        return torch.zeros(rows, dtype=torch.int64, device=logits.device), None
    # Every row's outputs are written below (by the kernel, or by the reduce after a split).
    out = torch.empty(rows, dtype=torch.int32 if partial else torch.int64, device=logits.device)
    best = torch.empty(rows, dtype=torch.float32, device=logits.device) if partial else None
    quarter = triton.cdiv(vocab, 4)
    sms = _sm_count(logits.device)
    if block is None:
        block = min(1024, triton.next_power_of_2(quarter))
        while block > 256 and rows * triton.cdiv(quarter, block) < 2 * sms:
            block //= 2  # few rows: smaller tiles, so that the splits below can reach every SM
    tiles = triton.cdiv(quarter, block)
    if num_splits is None:
        # About four programs per SM: enough to hide latency and to even out the last wave.
        num_splits = min(tiles, triton.cdiv(4 * sms, rows))
    num_splits = max(1, min(num_splits, tiles))
    span = triton.cdiv(tiles, num_splits) * block
    num_splits = triton.cdiv(quarter, span)  # no split left without columns
    split = num_splits > 1 or partial
    if split:
        part_val = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
        part_idx = torch.empty(rows, num_splits, dtype=torch.int32, device=logits.device)
    else:
        part_val, part_idx = out, out  # placeholders: SPLIT=False compiles them away
    _sample_kernel[(rows, num_splits)](
        logits, temperature, seeds, offsets, out, part_val, part_idx,
        logits.stride(0), quarter, span, lo, hi,
        BLOCK=block, SPLIT=split, FAST_LOG=logits.device.type == "cuda", num_warps=min(8, max(1, block // 128)),
        **pdl_args(logits.device),
    )
    if split:
        _reduce_splits_kernel[(rows,)](part_val, part_idx, out, part_val if best is None else best, num_splits,
                                        BLOCK=triton.next_power_of_2(num_splits), PARTIAL=partial,
                                        **pdl_args(logits.device))
    return out, best


def sampling_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms u [R, V] (fp32, in (0, 1)) that `sample` draws for these seeds and offsets.

    For tests: kernels.reference.sample_reference(logits, temperature, u) must pick the same ids.
    """
    rows = seeds.shape[0]
    assert seeds.dtype == offsets.dtype == torch.int64 and offsets.shape == (rows,)
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=seeds.device)
    quarter = triton.cdiv(vocab_size, 4)
    block = min(1024, triton.next_power_of_2(quarter))
    if rows and vocab_size:
        _uniforms_kernel[(rows, triton.cdiv(quarter, block))](
            seeds.contiguous(), offsets.contiguous(), out, out.stride(0), vocab_size, quarter, BLOCK=block)
    return out
