"""A split-K Triton GEMM against cuBLAS addmm_ for the 1024-feature outputs at 128 and 256 rows.

    python benchmarks/splitk_gemm.py

o_proj and down_proj write 1024 features: at 128-256 rows that is 16-64 tensor-core tiles for 132
SMs, and cuBLAS runs them at 6-8 us a call against a 1.5-2.5 us floor (BENCHMARKS.md). Here each
split of K writes an fp32 partial and the last program of a tile to arrive adds the partials in
split order and the residual (deterministic); 40 tilings a layer, 28 layers with their own weights
in one CUDA graph, each checked against fp32 first. The best tiling is timed again with PDL off and
with its first weight tile loaded before the PDL wait.
"""

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gemm_chain import Case, layer_weights  # noqa: E402

from kernels.pdl import pdl_args, pdl_prologue  # noqa: E402


@triton.jit
def add_tile(acc, y_ptr, ws_ptr, lock_ptr, rm, rn, M, stride_ym, pid_m, pid_n, pid_k, SPLIT_K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rm, rn] += acc: at once without a split, else through the workspace, where the last split
    of the tile to arrive adds the fp32 partials in split order and the residual (deterministic)."""
    m_mask = rm < M
    y_off = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        acc += tl.load(y_ptr + y_off, mask=m_mask[:, None], other=0.0).to(tl.float32)
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])
    else:
        tile = pid_m * tl.num_programs(1) + pid_n
        tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        partials = ws_ptr + tile.to(tl.int64) * (SPLIT_K * tile_elems)
        tl.store(partials + pid_k * tile_elems + offs, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(y_ptr + y_off, mask=m_mask[:, None], other=0.0).to(tl.float32)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(0, SPLIT_K):
                part += tl.load(partials + s * tile_elems + offs, cache_modifier=".cg")
            total += part
            tl.store(y_ptr + y_off, total.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])
            tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def splitk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, lock_ptr, M, N, stride_xm, stride_wn, stride_ym,
                  K: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  W_FIRST: tl.constexpr, USE_PDL: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_FIRST:
        w0 = tl.load(w_rows + (k_start + rk)[None, :])
        pdl_prologue(USE_PDL)
        x0 = tl.load(x_rows + (k_start + rk)[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
        lo = k_start + BLOCK_K
    else:
        pdl_prologue(USE_PDL)
        lo = k_start
    for k0 in tl.range(lo, k_start + K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    add_tile(acc, y_ptr, ws_ptr, lock_ptr, rm, rn, M, stride_ym, pid_m, pid_n, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)

WS: dict[str, torch.Tensor] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials, tile counters): allocated once, the counters zero between launches."""
    if "lock" not in WS:
        WS["lock"] = torch.zeros(8192, dtype=torch.int32, device=device)
        WS["ws"] = torch.empty(64 << 20, dtype=torch.float32, device=device)
    return WS["ws"], WS["lock"]


def splitk_addmm_(y, x, w, bm, bn, bk, split, warps, stages, w_first, pdl=True):
    m, k = x.shape
    n = w.shape[0]
    k_split = k // split
    tiles = triton.cdiv(m, bm) * (n // bn)
    ws, lock = workspace(x.device)
    assert tiles * split * bm * bn <= ws.numel()
    args = pdl_args(x.device) if pdl else {"USE_PDL": False}
    splitk_kernel[(split, n // bn, triton.cdiv(m, bm))](
        x, w, y, ws, lock, m, n, x.stride(0), w.stride(0), y.stride(0),
        K=k, K_SPLIT=k_split, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
        W_FIRST=w_first, num_warps=warps, num_stages=stages, **args)
    return y


def main():
    torch.manual_seed(0)
    weights = layer_weights(("o_proj", "down"))
    configs = []
    for bm, bn, split, bk in itertools.product((64, 128), (32, 64, 128), (1, 2, 4, 8), (64, 128)):
        if bm == 128 and bn == 128:
            continue
        warps = 4 if bm == 64 else 8
        configs.append((bm, bn, bk, split, warps, 4, False))
    rows_out = []
    for m in (128, 256):
        for name, ws in weights.items():
            case = Case(m, ws)
            k = case.x.shape[1]
            t_cublas = case.time_cublas()
            results = []
            for cfg in configs:
                if k % (cfg[3] * cfg[2]):
                    continue
                def addmm_(y, x, w, i, cfg=cfg):
                    splitk_addmm_(y, x, w, *cfg)
                if case.checks(addmm_, f"{name} m={m} {cfg}"):
                    results.append((case.time(addmm_), cfg))
            results.sort()
            best = results[:3]
            # The best config again with PDL off: the run's o_proj and down sit between cuBLAS calls.
            cfg = best[0][1]
            t_nopdl = case.time(lambda y, x, w, i, cfg=cfg: splitk_addmm_(y, x, w, *cfg, pdl=False))
            wcfg = cfg[:-1] + (True,)
            t_wfirst = case.time(lambda y, x, w, i, cfg=wcfg: splitk_addmm_(y, x, w, *cfg))
            rows_out.append(f"| {m} | {name} | {t_cublas:.2f} | "
                            + " / ".join(f"{t:.2f} {c[:5]}" for t, c in best)
                            + f" | {t_nopdl:.2f} | {t_wfirst:.2f} |")
            print(rows_out[-1], flush=True)
    print("| rows | layer | cuBLAS addmm_ us | best split-K us (bm, bn, bk, split, warps) | best, PDL off "
          "| best, weight tile before the wait |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows_out))

if __name__ == "__main__":
    main()
