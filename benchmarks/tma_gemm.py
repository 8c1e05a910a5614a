"""A Triton GEMM fed by the Hopper tensor-memory accelerator (TMA) against cuBLAS, for the decode step's
linear layers at 65-256 rows.

    python benchmarks/tma_gemm.py [--rows 128 256]

The Triton GEMMs measured before (benchmarks/splitk_gemm.py, the skinny GEMM's wide tiles) loaded
their tiles through pointer arithmetic and lost to cuBLAS above 64 rows. Here every tile comes
through a tensor descriptor (one TMA copy a tile, no per-element addresses), optionally split over K
(the last program to reach a tile adds the splits' fp32 partials, in order, and the residual), with
programmatic dependent launch and optionally the first weight tile fetched before the wait. Each
tiling is checked against fp32, then timed as the model runs it: 28 dependent `y += x @ w^T` calls
with their own weights in one CUDA graph.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gemm_chain import Case, layer_weights  # noqa: E402
from splitk_gemm import add_tile, workspace  # noqa: E402

from kernels.pdl import pdl_args, pdl_prologue  # noqa: E402


@triton.jit
def tma_gemm_kernel(x_desc, w_desc, y_ptr, ws_ptr, lock_ptr, M, N, stride_ym, K_SPLIT,
                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, W_FIRST: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_start = pid_k * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FIRST:  # the weight does not depend on the kernel before: fetch its first tile while that one drains
        w0 = w_desc.load([off_n, k_start])
        pdl_prologue(USE_PDL)
        x0 = x_desc.load([off_m, k_start])
        acc = tl.dot(x0, w0.T, acc)
        lo = k_start + BLOCK_K
    else:
        pdl_prologue(USE_PDL)
        lo = k_start
    for k0 in tl.range(lo, k_start + K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(x, w.T, acc)
    add_tile(acc, y_ptr, ws_ptr, lock_ptr, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), M, stride_ym,
             pid_m, pid_n, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)


def tma_addmm_(y, x, w, bm, bn, bk, split, warps, stages, w_first, descs=None):
    m, k = x.shape
    n = w.shape[0]
    ws, lock = workspace(x.device)
    x_desc, w_desc = descs or (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]))
    tma_gemm_kernel[(split, n // bn, triton.cdiv(m, bm))](
        x_desc, w_desc, y, ws, lock, m, n, y.stride(0),
        K_SPLIT=k // split, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, W_FIRST=w_first,
        num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = layer_weights()
    configs = []
    for bm, bn, bk, split, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (1, 2, 4), (3, 4)):
        if (bm + bn) * bk * 2 * stages > 200 * 1024 or (bm == 128 and bn == 256):
            continue
        configs.append((bm, bn, bk, split, 4 if bm == 64 else 8, stages, False))

    def timed(case: Case, cfg: tuple) -> float:
        x_desc = TensorDescriptor.from_tensor(case.x, [cfg[0], cfg[2]])
        descs = [(x_desc, TensorDescriptor.from_tensor(w, [cfg[1], cfg[2]])) for w in case.weights]
        return case.time(lambda y, x, w, i: tma_addmm_(y, x, w, *cfg, descs=descs[i]))

    table = []
    for m in args.rows:
        for name, ws in weights.items():
            case = Case(m, ws)
            n, k = ws[0].shape
            t_cublas = case.time_cublas()
            results = []
            for cfg in configs:
                bm, bn, bk, split, warps, stages, wf = cfg
                if k % (split * bk) or n % bn or (k // split) // bk < 2:
                    continue
                try:
                    right = case.checks(lambda y, x, w, i, cfg=cfg: tma_addmm_(y, x, w, *cfg), f"{name} m={m} {cfg}")
                except Exception as e:  # a tile that does not fit must not end the sweep
                    print(f"{name} m={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                if right:
                    results.append((timed(case, cfg), cfg))
            results.sort()
            best = results[0] if results else (float("nan"), None)
            wf_cell = "no tiling ran"
            if best[1] is not None:  # the best tiling with its first weight tile fetched before the wait
                cfg = best[1][:-1] + (True,)
                try:
                    wf_cell = f"{timed(case, cfg):.2f}"
                except Exception as e:  # the early tile can take the shared memory over the limit
                    wf_cell = f"did not fit ({type(e).__name__})"
                    print(f"{name} m={m} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
            table.append(f"| {m} | {name} | {t_cublas:.2f} | " + " / ".join(f"{t:.2f} {c[:6]}" for t, c in results[:3])
                         + f" | {wf_cell} |")
            print(table[-1], flush=True)
    print("| rows | layer | cuBLAS addmm_ us | best TMA tilings us (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) "
          "| best, first weight tile before the wait |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
