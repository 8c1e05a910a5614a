"""y = x @ weight^T (+ bias) for a few rows of x: the linear layers of a small-batch decode step.

At a decode step's M <= 64 a linear layer is mostly a weight-streaming problem: the weight must
cross HBM once, the flops are minor (64 rows are ~64 flops a weight byte, well below a Hopper GPU's
balance point). cuBLAS picks tensor-core GEMM tiles (and split-K with a separate reduce kernel) that
spend far more than the bytes' time at these shapes. Here each program owns
BLOCK_N output features and loops over all of K, so every weight byte is read by exactly one
program, there is no workspace, no second kernel and no atomics: one launch, deterministic,
capturable in a CUDA graph (the output is the only allocation).

Two inner products, chosen per call:
- broadcast-multiply-and-sum (M <= _FMA_MAX_M): acc[m, n] += sum_k x[m, k] * w[n, k] on the CUDA
  cores. No padding of M, so BLOCK_N can go down to 4: N=1024 still yields 256 programs, two per
  SM of a 132-SM GPU, which is what pulls bandwidth from every SM (tl.dot needs BLOCK_N >= 16, i.e.
  64 programs). Its cost grows with M (M FMAs per weight element, a BLOCK_M x BLOCK_N x BLOCK_K
  accumulator in registers, so BLOCK_K shrinks as M grows), hence the threshold.
- tl.dot (larger M): x's rows padded to 16, 32 or 64 with masked loads (padding costs no memory
  traffic) on the tensor cores, which have flops to spare at any M here. With programmatic
  dependent launch (kernels/pdl.py) this path also keeps 5-64-row steps in one chain of Triton
  kernels, which cuBLAS would break (its GEMMs do not wait on a programmatic edge).

No split over K: reducing the partial sums inside the same launch takes a semaphore, i.e. a
workspace and counters that must persist, zeroed, between launches and graph replays, for no gain
in a whole decode step. The FMA path gets its parallelism from a small BLOCK_N instead; the
tensor-core path has 64 programs at N=1024 (BLOCK_N=16).

The tiles below are tuned on Qwen3-0.6B's layers; tiles tuned for Qwen3-8B's were faster a layer in
isolation but not in a whole 8B decode step, so one set serves both.

No autotune (a first call inside CUDA-graph capture would benchmark there): the launcher picks
tiles from the shape, `_config` documents how, and keyword overrides let benchmarks/gemm.py sweep
alternatives (`python -m benchmarks.kernel_speed --only skinny_sweep`). The loop is software-pipelined
(`tl.range(num_stages=...)` also pipelines loads that feed no tl.dot), so each program keeps
NUM_STAGES - 1 weight tiles in flight.
"""

import functools

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue

# Rows one tensor-core program covers: with programmatic dependent launch a decode step of up to
# 64 rows runs its linear layers here rather than in cuBLAS (NANOPLANE_SKINNY_MAX_ROWS).
_DOT_MAX_BLOCK_M = 64
# Rows up to which the CUDA-core path is the default: beyond a few rows its M FMAs per weight element
# cost more than the tensor cores' padding (`python -m benchmarks.kernel_speed --only skinny_sweep`).
_FMA_MAX_M = 4
# Fewer programs than this per SM leaves bandwidth unused at these sizes (~2-12 MB per launch).
_PROGRAMS_PER_SM = 2
# fp32 elements of the FMA path's accumulator tile BLOCK_M x BLOCK_N x BLOCK_K (64 registers a
# thread at 4 warps).
_FMA_ACC = 8192
# Shared memory one program may spend on its pipeline stages (a Hopper SM has 227 KB).
_SMEM_BUDGET = 128 * 1024


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    # Triton specialises integer arguments equal to 1, so the usual unit strides along K compile to
    # contiguous (vectorised) loads; other strides work, slowly.
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        # Per-thread partial sums, reduced across threads once after the loop: the loop body is
        # loads and FMAs only, no shuffles or barriers (the registers are one product tile).
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + rk
        x_ptrs = x_rows + ks[None, :] * stride_xk
        w_ptrs = w_rows + ks[None, :] * stride_wk
        if EVEN_K:  # the usual case (K a multiple of BLOCK_K): no K mask to compute every iteration
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = ks < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:  # y += x @ w^T: one rounding of the sum, as cuBLAS's beta = 1 (Tensor.addmm_)
        acc += tl.load(y_ptr + y_off, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        # Triton's interpreter runs the programs one after another (each ~ms of numpy), so on a CPU
        # the fewest, largest tiles are fastest.
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@functools.lru_cache(maxsize=1024)
def _config(m: int, n: int, k: int, esize: int, num_sms: int, use_dot: bool | None, block_n: int | None,
            block_k: int | None, num_stages: int | None,
            block_m: int | None = None) -> tuple[bool, int, int, int, int]:
    """(use_dot, BLOCK_M, BLOCK_N, BLOCK_K, num_stages); None arguments take the defaults below."""
    if use_dot is None:
        use_dot = m > _FMA_MAX_M
    if use_dot:
        # tl.dot's minimum tile is 16 on every side; 32/64 rows of the weight when N is large enough
        # to keep one program per SM anyway (fewer, longer programs: less x re-read, longer streams).
        # Up to _DOT_MAX_BLOCK_M rows share one pass over the weight; more rows read it again per tile.
        block_m = block_m or min(_DOT_MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
        min_n, max_n, target = 16, 64, num_sms
    else:
        # The x tile is re-read by every program (from L2): BLOCK_N >= BLOCK_M keeps that traffic
        # no larger than the weight's.
        block_m = triton.next_power_of_2(min(m, 16))
        min_n, max_n, target = max(4, block_m), 32, _PROGRAMS_PER_SM * num_sms
    if block_n is None:
        block_n = max_n
        while block_n > min_n and triton.cdiv(n, block_n) < target:
            block_n //= 2
    if num_stages is None:
        num_stages = 4 if use_dot else 3
    if block_k is None:
        # As long as registers (FMA accumulator) and the shared-memory stages allow, within K.
        block_k = 1024
        if not use_dot:
            block_k = min(block_k, _pow2_floor(_FMA_ACC // (block_m * block_n)))
        stage_bytes = (block_m + block_n) * esize * num_stages
        block_k = min(block_k, _pow2_floor(_SMEM_BUDGET // stage_bytes), triton.next_power_of_2(k))
        block_k = max(block_k, 16)
    return use_dot, block_m, block_n, block_k, num_stages


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    use_dot: bool | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias[N]) -> y [M, N] in x's dtype, accumulated in fp32.

    For small M (a decode step's 1..64 rows): it streams the weight once; larger M works but reads
    the weight once per 64 rows. x and weight share a dtype (fp32/fp16/bf16); any strides work,
    unit stride along K is the fast case (x may be a row-strided view). bias may be any float
    dtype. `out` may be preallocated ([M, N], x's dtype, unit-stride rows); with `accumulate` the
    product is added to what `out` holds (a decoder layer's residual stream). The other keyword
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
    assert out is not None or not accumulate, "accumulate needs the tensor to add to (out)"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.dtype == x.dtype and (y.stride(1) == 1 or n <= 1)
    if m == 0 or n == 0:
        return y
    use_dot, block_m, block_n, block_k, num_stages = _config(
        m, n, k, x.element_size(), _num_sms(x.device), use_dot, block_n, block_k, num_stages, block_m)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else y, y,  # placeholder bias: HAS_BIAS=False drops it
        m, n, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        K=k, HAS_BIAS=bias is not None, ACCUMULATE=accumulate, USE_DOT=use_dot, EVEN_K=k % block_k == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models stay exact (no TF32)
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device),
    )
    return y
