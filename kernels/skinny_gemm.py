"""y = x @ weight^T (+ bias) for a few rows of x: the linear layers of a small-batch decode step.

At a decode step's M <= 64 a linear layer is mostly a weight-streaming problem: the ~2-12 MB of a
Qwen3-0.6B weight must cross HBM once, the flops are minor (64 rows are ~64 flops a weight byte,
below the H200's ~160 balance point). cuBLAS picks tensor-core GEMM tiles (and split-K with a
separate reduce kernel) that cost ~3x the bytes' time at these shapes. Here each program owns
BLOCK_N output features and loops over all of K, so every weight byte is read by exactly one
program, there is no workspace, no second kernel and no atomics: one launch, deterministic,
capturable in a CUDA graph (the output is the only allocation).

Two inner products, chosen per call:
- broadcast-multiply-and-sum (M <= _FMA_MAX_M): acc[m, n] += sum_k x[m, k] * w[n, k] on the CUDA
  cores. No padding of M, so BLOCK_N can go down to 4: N=1024 still yields 256 programs, two per
  SM of an H200, which is what pulls bandwidth from all 132 SMs (tl.dot needs BLOCK_N >= 16, i.e.
  64 programs). Its cost grows with M (M FMAs per weight element, a BLOCK_M x BLOCK_N x BLOCK_K
  accumulator in registers, so BLOCK_K shrinks as M grows), hence the threshold.
- tl.dot (larger M): x's rows padded to 16, 32 or 64 with masked loads (padding costs no memory
  traffic) on the tensor cores, which have flops to spare at any M here. With programmatic
  dependent launch (kernels/pdl.py) this path also keeps 5-64-row steps in one chain of Triton
  kernels, which cuBLAS would break (BENCHMARKS.md: 5-7% off the decode graph at 8-64 rows).

Split over K (SPLIT_K > 1) where the output tiles alone would leave SMs idle: a 1024-feature
output (o_proj, down_proj) is only 64 tensor-core tiles of 16 features for 132 SMs, and those ran
at ~18% of the weight-read floor (BENCHMARKS.md), cuBLAS alike. Each split writes its fp32
partial tile to a workspace and bumps a per-tile counter; the program that arrives last sums the
partials in split order (so the result does not depend on arrival order: deterministic) and
writes y. It then puts the counter back to zero, so the counters stay zeroed between launches and
graph replays without a memset. The counters are per device and one launch uses them at a time:
launches on one stream never overlap (with PDL a kernel touches memory only after its
predecessor completed); skinny_gemm is not for concurrent streams of one device.

No autotune (a first call inside CUDA-graph capture would benchmark there): the launcher picks
tiles from the shape, `_config` documents how, and keyword overrides let benchmarks/kernels.py
sweep alternatives. The loop is software-pipelined (`tl.range(num_stages=...)` also pipelines
loads that feed no tl.dot), so each program keeps NUM_STAGES - 1 weight tiles in flight.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_prologue

# Rows one tensor-core program covers: with programmatic dependent launch a decode step of up to
# 64 rows runs its linear layers here rather than in cuBLAS (NANOPLANE_SKINNY_MAX_ROWS).
_DOT_MAX_BLOCK_M = 64
# Rows up to which the CUDA-core path is the default (to be confirmed on a GPU with
# `benchmarks/kernels.py --only skinny_sweep`).
_FMA_MAX_M = 4
# Fewer programs than this per SM leaves bandwidth unused at these sizes (~2-12 MB per launch).
_PROGRAMS_PER_SM = 2
# fp32 elements of the FMA path's accumulator tile BLOCK_M x BLOCK_N x BLOCK_K (64 registers a
# thread at 4 warps).
_FMA_ACC = 8192
# Shared memory one program may spend on its pipeline stages (an H200 SM has 227 KB).
_SMEM_BUDGET = 128 * 1024
# A split reads at least this much of K: shorter splits spend more on partials than they gain.
_MIN_SPLIT_K = 256
_MAX_SPLIT_K = 8
# Output tiles a split launch may have (the counters allocated per device).
_MAX_SPLIT_TILES = 4096
# One weight tile a program (split over K as far as that takes): the whole weight read is issued
# before the PDL wait. Under measurement (BENCHMARKS.md); NANOPLANE_SKINNY_ONE_TILE=1 turns it on.
_ONE_TILE = os.environ.get("NANOPLANE_SKINNY_ONE_TILE", "0") == "1"


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
    K: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    # Triton specialises integer arguments equal to 1, so the usual unit strides along K compile to
    # contiguous (vectorised) loads; other strides work, slowly.
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    # The weight's first tile is loaded before the PDL wait, the one exception to pdl_prologue's
    # rule: no kernel writes a weight, so nothing the wait orders can change it. Its latency (and,
    # with one tile a program, the whole weight read) overlaps the previous kernel instead of
    # following it.
    w = _load_tile(w_rows, rk, n_mask, stride_wk, K, EVEN_K)
    pdl_prologue(USE_PDL)
    x = _load_tile(x_rows, rk, m_mask, stride_xk, K, EVEN_K)
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), input_precision=PREC)
    else:
        # Per-thread partial sums, reduced across threads once after the loop: the loop body is
        # loads and FMAs only, no shuffles or barriers (the registers are one product tile).
        acc3 = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    for k0 in tl.range(BLOCK_K, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        w = _load_tile(w_rows, k0 + rk, n_mask, stride_wk, K, EVEN_K)
        x = _load_tile(x_rows, k0 + rk, m_mask, stride_xk, K, EVEN_K)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    if SPLIT_K == 1:
        _store(acc, bias_ptr, y_ptr, rm, rn, m_mask, n_mask, stride_ym, HAS_BIAS)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        partials = ws_ptr + tile.to(tl.int64) * (SPLIT_K * tile_elems)
        tl.store(partials + pid_k * tile_elems + offs, acc)
        # Every thread's partial is written before one thread announces it (acq_rel at GPU scope
        # publishes them; the last program's acquire makes the others' visible to it).
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(partials + offs, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + s * tile_elems + offs, cache_modifier=".cg")
            _store(total, bias_ptr, y_ptr, rm, rn, m_mask, n_mask, stride_ym, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _load_tile(rows, ks, row_mask, stride_k, K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [rows, BLOCK_K] tile at columns ks; zeros outside the matrix."""
    ptrs = rows + ks[None, :] * stride_k
    if EVEN_K:  # the usual case (K a multiple of K_SPLIT): no K mask to compute every iteration
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    return tl.load(ptrs, mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _store(acc, bias_ptr, y_ptr, rm, rn, m_mask, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        # Triton's interpreter runs the programs one after another (each ~ms of numpy), so on a CPU
        # the fewest, largest tiles are fastest.
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_LOCKS: dict[torch.device, torch.Tensor] = {}


def _locks(device: torch.device) -> torch.Tensor:
    """The device's split-K counters: zeroed once, left zeroed by every launch."""
    locks = _LOCKS.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Zeroing inside a capture would happen only when the graph is replayed.
            raise RuntimeError("the first split-K skinny_gemm on a device must run outside CUDA graph capture")
        locks = _LOCKS[device] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return locks


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@functools.lru_cache(maxsize=1024)
def _config(m: int, n: int, k: int, esize: int, num_sms: int, use_dot: bool | None, block_n: int | None,
            block_k: int | None, num_stages: int | None, split_k: int | None = None, block_m: int | None = None,
            ) -> tuple[bool, int, int, int, int, int, int]:
    """(use_dot, BLOCK_M, BLOCK_N, BLOCK_K, num_stages, SPLIT_K, K_SPLIT); None arguments take the
    defaults below."""
    if use_dot is None:
        use_dot = m > _FMA_MAX_M
    if use_dot:
        # tl.dot's minimum tile is 16 on every side; 32/64 rows of the weight when N is large enough
        # to keep one program per SM anyway (fewer, longer programs: less x re-read, longer streams).
        # Up to _DOT_MAX_BLOCK_M rows share one pass over the weight; more rows read it again per tile.
        if block_m is None:
            block_m = min(_DOT_MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
        min_n, max_n, target = 16, 64, num_sms
    else:
        # The x tile is re-read by every program (from L2): BLOCK_N >= BLOCK_M keeps that traffic
        # no larger than the weight's.
        block_m = triton.next_power_of_2(min(m, 16))
        min_n, max_n, target = max(4, block_m), 32, _PROGRAMS_PER_SM * num_sms
    m_tiles = triton.cdiv(m, block_m)
    if _ONE_TILE and use_dot and block_n is None and split_k is None and block_k is None:
        block_n = min_n  # the smallest weight tile: it is held in registers across the wait
    if block_n is None:
        block_n = max_n
        while block_n > min_n and triton.cdiv(n, block_n) * m_tiles < target:
            block_n //= 2
    tiles = triton.cdiv(n, block_n) * m_tiles
    if _ONE_TILE and split_k is None and block_k is None:
        if use_dot:
            block_k = 512 if block_m <= 32 else 256
        else:
            block_k = min(1024, _pow2_floor(_FMA_ACC // (block_m * block_n)))
        block_k = min(block_k, triton.next_power_of_2(k))
        split_k = min(triton.cdiv(k, block_k), _MAX_SPLIT_K) if tiles <= _MAX_SPLIT_TILES else 1
    if split_k is None:
        # Only the tensor-core path splits: its smallest tiles still leave SMs idle at N=1024.
        split_k = 1
        while (use_dot and tiles * split_k < target and k // (2 * split_k) >= _MIN_SPLIT_K
               and split_k < _MAX_SPLIT_K and tiles <= _MAX_SPLIT_TILES):
            split_k *= 2
    if num_stages is None:
        num_stages = 4 if use_dot else 3
    k_part = triton.cdiv(k, split_k)
    if block_k is None:
        # As long as registers (FMA accumulator) and the shared-memory stages allow, within a split.
        block_k = 1024
        if not use_dot:
            block_k = min(block_k, _pow2_floor(_FMA_ACC // (block_m * block_n)))
        stage_bytes = (block_m + block_n) * esize * num_stages
        block_k = min(block_k, _pow2_floor(_SMEM_BUDGET // stage_bytes), triton.next_power_of_2(k_part))
        block_k = max(block_k, 16)
    k_split = triton.cdiv(k_part, block_k) * block_k  # whole tiles a split; the last may run past K
    split_k = triton.cdiv(k, k_split)
    return use_dot, block_m, block_n, block_k, num_stages, split_k, k_split


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias[N]) -> y [M, N] in x's dtype, accumulated in fp32.

    For small M (a decode step's 1..64 rows): it streams the weight once; larger M works but reads
    the weight once per 64 rows. x and weight share a dtype (fp32/fp16/bf16); any strides work,
    unit stride along K is the fast case (x may be a row-strided view). bias may be any float
    dtype. `out` may be preallocated ([M, N], x's dtype, unit-stride rows). The other keyword
    arguments override the tile choice, for benchmarks; num_warps=4 suits every default tile (one
    warp group for the tensor-core path, at most 64 accumulators a thread on the CUDA-core path).
    """
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K] and weight [N, K]"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight {weight.shape[1]}"
    assert x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert x.device == weight.device
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous() and bias.device == x.device
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.dtype == x.dtype and (y.stride(1) == 1 or n <= 1)
    if m == 0 or n == 0:
        return y
    use_dot, block_m, block_n, block_k, num_stages, split_k, k_split = _config(
        m, n, k, x.element_size(), _num_sms(x.device), use_dot, block_n, block_k, num_stages, split_k, block_m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    if split_k > 1:
        tiles = grid[0] * grid[1]
        assert tiles <= _MAX_SPLIT_TILES, f"{tiles} output tiles: too many to split over K"
        workspace = torch.empty(tiles * split_k * block_m * block_n, dtype=torch.float32, device=x.device)
        locks = _locks(x.device)
    else:
        workspace = locks = y  # placeholders: SPLIT_K=1 compiles their uses away
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else y, y, workspace, locks,  # placeholder bias: HAS_BIAS=False
        m, n, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        K=k, K_SPLIT=k_split, SPLIT_K=split_k, HAS_BIAS=bias is not None, USE_DOT=use_dot,
        EVEN_K=k % k_split == 0, PREC="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays exact
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device),
    )
    return y
