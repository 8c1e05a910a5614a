"""Sampling in two short passes over the logits: greedy rows take the argmax, the others an exact
draw from softmax(logits / T), by Gumbel-max taken a group of columns at a time.

Gumbel-max draws argmax(logits + T * g) with g = -log(-log(u)) standard Gumbel noise, u uniform:
an exact draw from softmax(logits / T) with no softmax, division or fp32 copy of the logits. Noise
for every one of 151,936 columns is Philox and two logs a column, which makes that integer work,
not the read of the logits, bound the kernel, several times the read's time. Gumbel
noise is max-stable, which allows the same draw with a noise per group of columns instead: over a
group G, max_{i in G}(x_i + T g_i) is distributed as T * logsumexp(x_G / T) + T g_G, and which
column reaches that maximum is independent of its value, distributed as softmax(x_G / T). So:

1. `_group_kernel` (one read of the logits, no noise) writes each group's score, its log-sum-exp
   T * logsumexp(x_G / T) (for a greedy row its max);
2. `_draw_kernel` adds one Gumbel noise per group, takes the best group, then draws its column by
   Gumbel-max over that group's 64 columns with a noise per column.

The groups are the columns' runs of GROUP aligned to multiples of GROUP, cut where a vocabulary
slice starts or ends (tensor parallelism); any partition is an exact draw, and with slices that
are multiples of GROUP wide (Qwen3's 151,936 over two ranks) a slice cuts no group, so the ranks'
partial draws combine into exactly the whole row's. A group's noise is keyed by its first column.

Noise: Philox4x32-10 (tl.rand) keyed by the row's seed, counter `offset * 2V + j`: j = c for
column c's noise, j = V + c for the noise of the group starting at column c (V the vocabulary
size). A row's draw thus depends only on (seed, offset, logits, T), never on the batch or on how
the launch was tiled. Ties go to the lowest index, as torch.argmax; NaN logits never win; a row
with nothing above -inf gives 0.

With the vocabulary split over tensor-parallel ranks, `sample_partial` draws over one rank's
slice and returns each row's best (score, column); `combine_partials` picks the token from those
pairs: the logits are never gathered.
"""

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue

# Columns per group: the draw's partition (changing it changes every seeded draw). 64 divides the
# slices of Qwen3's vocabulary over two ranks (75,968 = 64 x 1,187).
GROUP = 64
_GROUP = tl.constexpr(GROUP)
# Index no column reaches: marks "nothing seen yet" in the running argmax.
_NONE = tl.constexpr(2**31 - 1)
# Smallest uniform let through: tl.rand can return 0, whose Gumbel noise would be -inf.
_U_MIN = tl.constexpr(1e-30)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _load(row_ptr, cols, LO, HI):
    """Columns `cols` of a row holding columns [LO, HI), in fp32; -inf outside it and for NaN."""
    x = tl.load(row_ptr + (cols - LO), mask=(cols >= LO) & (cols < HI), other=float("-inf")).to(tl.float32)
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def _gumbel(seed, counters):
    u = tl.maximum(tl.rand(seed, counters), _U_MIN)
    return -tl.log(-tl.log(u))


@triton.jit
def _group_kernel(logits_ptr, temperature_ptr, scores_ptr, stride_row, NUM_GROUPS, SPAN, FIRST, LO, HI,
                  TILE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, split) scores the row's groups [split * SPAN, (split + 1) * SPAN) of NUM_GROUPS,
    TILE groups at a time. Group k holds columns [(FIRST + k) * GROUP, +GROUP) within [LO, HI)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_ptr = scores_ptr + row.to(tl.int64) * NUM_GROUPS
    t = tl.load(temperature_ptr + row)
    # exp2((x - m) * scale) = exp((x - m) / T); a greedy row only takes maxima.
    scale = _LOG2E / tl.where(t > 0, t, 1.0)
    groups = tl.arange(0, TILE)
    lanes = tl.arange(0, _GROUP)
    start = tl.program_id(1) * SPAN
    stop = tl.minimum(start + SPAN, NUM_GROUPS)
    for g0 in range(start, stop, TILE):
        k = g0 + groups
        cols = (FIRST + k)[:, None] * _GROUP + lanes[None, :]
        x = _load(row_ptr, cols, LO, HI)
        m = tl.max(x, 1)
        if t > 0:
            # x == m covers x = m = +-inf, where x - m is NaN: such a column counts 1 (all -inf: the
            # score stays -inf; several +inf: +inf).
            e = tl.where(x == m[:, None], 1.0, tl.exp2((x - m[:, None]) * scale))
            score = m + t * (_LN2 * tl.log2(tl.sum(e, 1)))
        else:
            score = m
        tl.store(out_ptr + k, score, mask=k < stop)


@triton.jit
def _draw_kernel(logits_ptr, scores_ptr, temperature_ptr, seeds_ptr, offsets_ptr, out_ptr, best_ptr,
                 stride_row, NUM_GROUPS, FIRST, LO, HI, V, BLOCK: tl.constexpr, PARTIAL: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """Program `row`: the best group (its score plus T times its noise), then the column within it.
    Writes the token id (int64), or with PARTIAL the column (int32, _NONE if none) and its score."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    seed = tl.load(seeds_ptr + row)
    base = tl.load(offsets_ptr + row) * (2 * V)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_k = tl.full((BLOCK,), _NONE, tl.int32)
    for g0 in range(0, NUM_GROUPS, BLOCK):
        k = g0 + lanes
        live = k < NUM_GROUPS
        s = tl.load(scores_ptr + row.to(tl.int64) * NUM_GROUPS + k, mask=live, other=float("-inf"))
        if t > 0:
            first_col = tl.maximum((FIRST + k) * _GROUP, LO)  # a group cut by the slice: its first column
            s = s + t * _gumbel(seed, base + V + first_col)
        take = s > best  # strict: within a lane groups only grow, so a tie keeps the lowest
        best = tl.where(take, s, best)
        best_k = tl.where(take, k, best_k)
    top = tl.max(best, 0)
    k = tl.min(tl.where(best == top, best_k, _NONE), 0)
    # The column within group k (group 0's read, then dropped, where no group scored above -inf).
    cols = (FIRST + tl.where(k == _NONE, 0, k)) * _GROUP + tl.arange(0, _GROUP)
    x = _load(logits_ptr + row.to(tl.int64) * stride_row, cols, LO, HI)
    if t > 0:
        x = x + t * _gumbel(seed, base + cols)
    col = tl.min(tl.where(x == tl.max(x, 0), cols, _NONE), 0)
    col = tl.where(k == _NONE, _NONE, col)
    if PARTIAL:
        tl.store(best_ptr + row, top)
        tl.store(out_ptr + row, col)
    else:
        tl.store(out_ptr + row, tl.where(col == _NONE, 0, col).to(tl.int64))


@triton.jit
def _uniforms_kernel(seeds_ptr, offsets_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = tl.load(offsets_ptr + row) * (2 * V)
    u = tl.maximum(tl.rand(tl.load(seeds_ptr + row), base + j), _U_MIN)
    tl.store(out_ptr + row.to(tl.int64) * (2 * V) + j, u, mask=j < 2 * V)


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
    noise (module docstring). `block` (columns a program reads per step, a multiple of GROUP) and
    `num_splits` (programs per row) tune the first pass; the draw does not depend on them. Nothing
    here reads the device from the host.
    """
    out, _ = _launch(logits, 0, logits.shape[-1] if logits.dim() else 0, temperature, seeds, offsets, block,
                     num_splits, partial=False)
    return out


def sample_partial(
    logits: torch.Tensor, start: int, vocab_size: int, temperature: torch.Tensor, seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`'s draw over one slice of the vocabulary: logits [R, n] are columns [start, start + n)
    of rows of `vocab_size` columns (columns at or past vocab_size, a rank's padding, are skipped).

    Returns each row's best score (fp32 [R]: its best group's score plus T times that group's
    noise) and the column drawn in that group (int32 [R], 2**31 - 1 where no column scored above
    -inf): combine_partials turns the slices' pairs into token ids.
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
    assert block is None or (block % GROUP == 0 and block & (block - 1) == 0), "block: a power of 2, >= GROUP"
    _check(temperature, seeds, offsets, rows, logits.device)
    if rows == 0 or hi == lo:  # no column: no score, no column (partial), or id 0 as torch.argmax gives
        if partial:
            return (torch.full((rows,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=logits.device),
                    torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device))
        return torch.zeros(rows, dtype=torch.int64, device=logits.device), None
    first = lo // GROUP
    num_groups = triton.cdiv(hi, GROUP) - first
    sms = _sm_count(logits.device)
    # Sixteen programs an SM, 4,096 columns a tile at most: enough bytes in flight for the read to
    # approach the bandwidth (`python -m benchmarks.kernel_speed --only sample` times it).
    programs = 16 * sms if logits.is_cuda else 1  # the interpreter runs one program at a time
    tile = (block or 4096) // GROUP
    tile = min(tile, triton.next_power_of_2(num_groups))
    if block is None:
        while tile > 4 and rows * triton.cdiv(num_groups, tile) < programs:
            tile //= 2  # few rows: smaller tiles, so that the splits below can reach every SM
    tiles = triton.cdiv(num_groups, tile)
    if num_splits is None:
        num_splits = triton.cdiv(programs, rows)
    span = triton.cdiv(tiles, max(1, min(num_splits, tiles))) * tile
    scores = torch.empty(rows, num_groups, dtype=torch.float32, device=logits.device)
    pdl = pdl_args(logits.device)
    _group_kernel[(rows, triton.cdiv(num_groups, span))](
        logits, temperature, scores, logits.stride(0), num_groups, span, first, lo, hi,
        TILE=tile, num_warps=4, **pdl)
    out = torch.empty(rows, dtype=torch.int32 if partial else torch.int64, device=logits.device)
    best = torch.empty(rows, dtype=torch.float32, device=logits.device) if partial else out
    _draw_kernel[(rows,)](
        logits, scores, temperature, seeds, offsets, out, best, logits.stride(0), num_groups, first, lo, hi,
        vocab, BLOCK=min(1024, triton.next_power_of_2(num_groups)), PARTIAL=partial, num_warps=8, **pdl)
    return out, best if partial else None


def sampling_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms u [R, 2V] (fp32, in (0, 1)) behind `sample`'s noise for these seeds and offsets:
    u[:, c] for column c, u[:, V + c] for the group starting at column c.

    For tests: kernels.reference.sample_reference(logits, temperature, u) must pick the same ids.
    """
    rows = seeds.shape[0]
    assert seeds.dtype == offsets.dtype == torch.int64 and offsets.shape == (rows,)
    out = torch.empty(rows, 2 * vocab_size, dtype=torch.float32, device=seeds.device)
    block = min(1024, triton.next_power_of_2(2 * vocab_size))
    if rows and vocab_size:
        _uniforms_kernel[(rows, triton.cdiv(2 * vocab_size, block))](
            seeds.contiguous(), offsets.contiguous(), out, vocab_size, BLOCK=block)
    return out
