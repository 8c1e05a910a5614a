"""The linear layers of a decode step: kernels.skinny_gemm against cuBLAS at decode batch sizes.

    python -m benchmarks.kernel_speed --only skinny,skinny_sweep,mid_sweep   # (this file holds them)

`skinny` times kernels.skinny_gemm beside F.linear (cuBLAS) at decode batch sizes, Qwen3-0.6B's
four linear layers, floor = one read of the weight (+ x and y). Each call reads another copy of the
weight, enough copies to overflow the L2, so the graph column is what a 28-layer decode step sees
(L2-warm weights would beat the HBM floor). `skinny_sweep` times the kernel's tile alternatives
(graph column only) for tuning kernels/skinny_gemm.py's defaults; `mid_sweep` its tensor-core path
with larger tiles against cuBLAS at 96-256 rows.
"""

import torch
import triton
import triton.testing

from benchmarks.timing import BANDWIDTH, MATMUL_FLOPS, report
from nanoplane.kernels import reference as ref
from nanoplane.kernels import skinny_gemm

# (K, N) of the linear layers as one tensor-parallel rank holds them: Qwen3-0.6B at TP=1 (the
# default), Qwen3-8B at TP=2 (`benchmarks/kernel_speed.py --gemm-shapes 8b-tp2`).
GEMM_SHAPES = {
    "0.6b": {"qkv_proj": (1024, 4096), "o_proj": (2048, 1024), "gate_up_proj": (1024, 6144), "down_proj": (3072, 1024)},
    "8b-tp2": {"qkv_proj": (4096, 3072), "o_proj": (2048, 4096), "gate_up_proj": (4096, 12288),
               "down_proj": (6144, 4096)},
}
SKINNY_SHAPES = GEMM_SHAPES["0.6b"]
# Decode rows: the skinny kernel serves up to 64 by default; 128 and 256 say whether it should take
# the larger steps from cuBLAS too (NANOPLANE_SKINNY_MAX_ROWS).
SKINNY_ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
SKINNY_SWEEP_ROWS = (1, 4, 8, 16, 32, 64)
L2_OVERFLOW = 256 << 20  # bytes of weight copies to rotate through: 5x the H200's 50 MB L2


def rotating_weights(k: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    one = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    copies = max(1, L2_OVERFLOW // (one.numel() * one.element_size()))
    return [one] + [one.clone() for _ in range(copies - 1)]


def rotating(op, x: torch.Tensor, weights: list[torch.Tensor], **kwargs):
    """A call of op(x, w) on the next weight copy each time; do_bench_cudagraph unrolls its calls
    into the graph, so the graph reads the copies in turn as a decode step reads its layers."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        return op(x, weights[state["i"]], **kwargs)

    return call


def bench_skinny(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    totals = {m: {"skinny_gemm": 0.0, "F.linear": 0.0, "floor": 0.0} for m in SKINNY_ROWS}
    for name, (k, n) in SKINNY_SHAPES.items():
        weights = rotating_weights(k, n, dtype)
        for m in SKINNY_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            nbytes = (n * k + m * k + m * n) * esize
            check = lambda: (skinny_gemm(x, weights[0]), ref.skinny_gemm_ref(x, weights[0]))  # noqa: B023
            label = f"{name} M={m} K={k} N={n}"
            total = totals[m]
            total["skinny_gemm"] += report(f"skinny_gemm {label}", rotating(skinny_gemm, x, weights), nbytes,
                                           check=check)
            total["F.linear"] += report(f"F.linear    {label}", rotating(torch.nn.functional.linear, x, weights),
                                        nbytes)
            total["floor"] += nbytes / BANDWIDTH * 1e6
    for m, total in totals.items():
        print(f"== M={m}: the four layers (graph) skinny_gemm {total['skinny_gemm']:.1f} us, "
              f"F.linear {total['F.linear']:.1f} us, floor {total['floor']:.1f} us", flush=True)


def timed_tiles(x: torch.Tensor, weights: list[torch.Tensor], expected: torch.Tensor, tiles: dict) -> float:
    """skinny_gemm with these tile overrides: checked against `expected`, then timed (graph replay, us)."""
    got = skinny_gemm(x, weights[0], **tiles)
    err = ((got.float() - expected).norm() / expected.norm()).item()
    assert err < 2e-2, f"relative error {err:.2e}"
    return triton.testing.do_bench_cudagraph(rotating(skinny_gemm, x, weights, **tiles), rep=30) * 1e3


# Alternatives to the launcher's choice: (use_dot, block_n, block_k, num_stages, num_warps); None = default.
SKINNY_SWEEP = [(None, None, None, None, 4),
                (False, 4, None, None, 4), (False, 8, None, None, 4), (False, 16, None, None, 4),
                (False, 32, None, None, 4), (False, None, None, 2, 4), (False, None, None, 4, 4),
                (False, None, None, None, 8),
                (True, 16, None, None, 4), (True, 32, None, None, 4), (True, 16, 256, None, 4),
                (True, 16, None, 3, 4), (True, 16, None, 5, 4),
                # wider outputs (8B shapes): BLOCK_N's program count against the SMs' waves
                (True, 64, None, None, 4), (True, 64, 64, 4, 4), (True, 128, 64, 3, 4), (True, 32, 64, 4, 4),
                (True, 32, 128, 4, 4)]


def bench_skinny_sweep(dtype: torch.dtype) -> None:
    from nanoplane.kernels.skinny_gemm import _config, _num_sms

    esize = torch.finfo(dtype).bits // 8
    for name, (k, n) in SKINNY_SHAPES.items():
        weights = rotating_weights(k, n, dtype)
        floor = n * k * esize / BANDWIDTH * 1e6
        for m in SKINNY_SWEEP_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            expected = ref.skinny_gemm_ref(x, weights[0])
            for use_dot, block_n, block_k, stages, warps in SKINNY_SWEEP:
                if use_dot is False and block_n is not None and block_n < triton.next_power_of_2(m):
                    continue  # x would be re-read more than the weight: not a candidate
                tiles = dict(use_dot=use_dot, block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps)
                picked = _config(m, n, k, esize, _num_sms(x.device), use_dot, block_n, block_k, stages)
                label = (f"{name} M={m:<2} {'dot' if picked[0] else 'fma'} BM={picked[1]:<2} BN={picked[2]:<2} "
                         f"BK={picked[3]:<4} stages={picked[4]} warps={warps}{' (default)' if use_dot is None else ''}")
                try:
                    t = timed_tiles(x, weights, expected, tiles)
                except Exception as e:  # a tile that does not compile (shared memory) must not end the sweep
                    print(f"{label:<84} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
                    continue
                print(f"{label:<84} {t:7.2f} us  {floor / t:6.1%} of floor", flush=True)


# Tiles for the tensor-core path at 65-256 rows, where cuBLAS runs now: (block_m, block_n, block_k, stages, warps).
MID_ROWS = (96, 128, 192, 256)
MID_SWEEP = [(64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 3, 4), (64, 32, 128, 4, 4),
             (128, 32, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 4, 8), (128, 128, 64, 3, 8),
             (128, 128, 64, 4, 8), (128, 64, 128, 3, 8), (128, 32, 128, 3, 4)]


def bench_mid_sweep(dtype: torch.dtype) -> None:
    """kernels.skinny_gemm's tensor-core path with larger tiles against cuBLAS at 96-256 rows: does any
    tiling beat cuBLAS there (graph replay, weights rotated past the L2)?"""
    esize = torch.finfo(dtype).bits // 8
    best_sum = {m: 0.0 for m in MID_ROWS}
    cublas_sum = {m: 0.0 for m in MID_ROWS}
    for name, (k, n) in SKINNY_SHAPES.items():
        weights = rotating_weights(k, n, dtype)
        for m in MID_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            expected = ref.skinny_gemm_ref(x, weights[0])
            floor = max(n * k * esize / BANDWIDTH, 2 * m * n * k / MATMUL_FLOPS) * 1e6
            cublas = triton.testing.do_bench_cudagraph(rotating(torch.nn.functional.linear, x, weights), rep=30) * 1e3
            best = (float("inf"), None)
            for bm, bn, bk, stages, warps in MID_SWEEP:
                tiles = dict(use_dot=True, block_m=bm, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps)
                try:
                    t = timed_tiles(x, weights, expected, tiles)
                except Exception as e:  # a tile that does not compile (shared memory) must not end the sweep
                    print(f"{name} M={m} {bm}x{bn}x{bk} s{stages} w{warps} failed: {type(e).__name__}", flush=True)
                    continue
                best = min(best, (t, (bm, bn, bk, stages, warps)))
            print(f"{name:<13} M={m:<3} cuBLAS {cublas:6.2f} us  best tile {best[1]} {best[0]:6.2f} us  "
                  f"floor {floor:5.2f} us", flush=True)
            best_sum[m] += best[0]
            cublas_sum[m] += cublas
    for m in MID_ROWS:
        print(f"== M={m}: the four layers, cuBLAS {cublas_sum[m]:.1f} us, best tiles {best_sum[m]:.1f} us", flush=True)
