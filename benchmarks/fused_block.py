"""Would one persistent kernel for everything between two attentions make a decode step faster?

    python benchmarks/fused_block.py [--batches 1 16 64 128 256] [--programs 1 2]

Between the attention of layer i and that of layer i + 1 a decode step runs seven kernels: o_proj,
residual add + RMSNorm, gate_up, silu·mul, down, residual add + RMSNorm, and the next layer's QKV
projection (the QKV prologue aside). Each is a few microseconds of fixed cost around little work
(BENCHMARKS.md: the non-attention part of a step costs 0.6-1.1 ms against a ~0.3 ms floor, and
neither retiling, L2 prefetch nor two streams moved it). This prototype does the seven in one
launch of one or two programs an SM: four GEMM phases separated by grid-wide barriers (a counter every
program adds to and waits on), the norms and the activation folded into the phases that read or
write their operands. It times 28 such blocks (no attention) against the same math as the model
runs it, checks they agree, and prints ms a step against the weight-read floor.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l2_prefetch import linear  # noqa: E402  (the model's choice of GEMM by rows)
from timing import time_graph  # noqa: E402

from kernels import rms_norm, silu_and_mul  # noqa: E402

LAYERS, HIDDEN, QDIM, QKV, INTER, EPS = 28, 1024, 2048, 4096, 3072, 1e-6
# On a CPU (TRITON_INTERPRET=1) it only checks the fused math, with one program a launch (the
# interpreter runs programs one after another: with more, the first would wait at the barrier
# forever) and in fp32 (the interpreter's dot of bf16 operands is not bf16 arithmetic).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


@triton.jit
def _grid_sync(counter_ptr, target):
    # Every program's writes so far are made visible, then it waits for all programs to arrive.
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _inv_rms(ss_ptr, rows, row_mask, K: tl.constexpr, PARTS: tl.constexpr, eps):
    # The producing phase left each row's sum of squares in PARTS pieces (one per output tile).
    p = tl.arange(0, PARTS)
    ss = tl.load(ss_ptr + rows[:, None] * PARTS + p[None, :], mask=row_mask[:, None], other=0.0,
                 cache_modifier=".cg")
    return tl.rsqrt(tl.sum(ss, 1) / K + eps)


@triton.jit
def _gemm_phase(a_ptr, w_ptr, w2_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, ss_ptr, M, eps,
                N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, PARTS: tl.constexpr):
    """out[M, N] = f(a) @ w.T over tiles handed out round robin. NORM: a is RMSNorm'd on load (rows'
    inverse RMS from the PARTS sums of squares at ss_ptr, weight `norm_ptr`, HF's rounding). GATED:
    out = silu(a @ w.T) * (a @ w2.T). RESIDUAL: out = bf16(a @ w.T) + res, written to res_out, and each
    row's sum of squares over this tile to ss_ptr (N // BN pieces a row)."""
    DT = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_n = N // BN
    tiles = tl.cdiv(M, BM) * tiles_n
    for tile in range(pid, tiles, nprog):
        tm = tile // tiles_n
        tn = tile % tiles_n
        rows = tm * BM + tl.arange(0, BM)
        row_mask = rows < M
        cols = tn * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        if NORM:
            r = _inv_rms(ss_ptr, rows, row_mask, K, PARTS, eps)
        acc = tl.zeros([BM, BN], tl.float32)
        acc2 = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rows[:, None] * K + (k0 + ks)[None, :], mask=row_mask[:, None], other=0.0,
                        cache_modifier=".cg")
            if NORM:
                g = tl.load(norm_ptr + k0 + ks).to(tl.float32)
                a = ((a.to(tl.float32) * r[:, None]).to(DT).to(tl.float32) * g[None, :]).to(DT)
            w = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
            if GATED:
                w2 = tl.load(w2_ptr + cols[:, None] * K + (k0 + ks)[None, :])
                acc2 = tl.dot(a, tl.trans(w2), acc2)
        out = acc.to(DT)
        if GATED:
            gate = out.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
            out = (silu * acc2.to(DT).to(tl.float32)).to(DT)
        offs = rows[:, None] * N + cols[None, :]
        if RESIDUAL:
            res = tl.load(res_ptr + offs, mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
            out = (out.to(tl.float32) + res.to(tl.float32)).to(DT)
            tl.store(res_out_ptr + offs, out, mask=row_mask[:, None])
            h = out.to(tl.float32)
            tl.store(ss_ptr + rows * tiles_n + tn, tl.sum(h * h, 1), mask=row_mask)
        else:
            tl.store(out_ptr + offs, out, mask=row_mask[:, None])


@triton.jit
def _block_kernel(attn_ptr, res_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr, wqkv_ptr, g2_ptr, g1_ptr,
                  r1_ptr, act_ptr, r2_ptr, qkv_ptr, counter_ptr, ss1_ptr, ss2_ptr, M, eps,
                  BM: tl.constexpr, BN_O: tl.constexpr, BN_G: tl.constexpr, BN_D: tl.constexpr,
                  BN_Q: tl.constexpr, BK: tl.constexpr,
                  HIDDEN: tl.constexpr, QDIM: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr):
    n = tl.num_programs(0)
    # r1 = attn @ wo.T + res
    _gemm_phase(attn_ptr, wo_ptr, wo_ptr, r1_ptr, res_ptr, r1_ptr, g2_ptr, ss1_ptr, M, eps,
                HIDDEN, QDIM, BM, BN_O, BK, False, False, True, HIDDEN // BN_O)
    _grid_sync(counter_ptr, n)
    # act = silu(norm(r1) @ wg.T) * (norm(r1) @ wu.T)
    _gemm_phase(r1_ptr, wg_ptr, wu_ptr, act_ptr, res_ptr, res_ptr, g2_ptr, ss1_ptr, M, eps,
                INTER, HIDDEN, BM, BN_G, BK, True, True, False, HIDDEN // BN_O)
    _grid_sync(counter_ptr, 2 * n)
    # r2 = act @ wd.T + r1
    _gemm_phase(act_ptr, wd_ptr, wd_ptr, r2_ptr, r1_ptr, r2_ptr, g2_ptr, ss2_ptr, M, eps,
                HIDDEN, INTER, BM, BN_D, BK, False, False, True, HIDDEN // BN_D)
    _grid_sync(counter_ptr, 3 * n)
    # qkv = norm(r2) @ wqkv.T (the next layer's projection)
    _gemm_phase(r2_ptr, wqkv_ptr, wqkv_ptr, qkv_ptr, res_ptr, res_ptr, g1_ptr, ss2_ptr, M, eps,
                QKV, HIDDEN, BM, BN_Q, BK, True, False, False, HIDDEN // BN_D)


def make_layers() -> list[dict[str, torch.Tensor]]:
    def w(n, k):
        return torch.randn(n, k, device=DEV, dtype=DTYPE) * k**-0.5

    def g():
        return 1 + 0.1 * torch.randn(HIDDEN, device=DEV, dtype=DTYPE)

    layers = []
    for _ in range(LAYERS):
        gate_up = w(2 * INTER, HIDDEN)
        layers.append({"o": w(HIDDEN, QDIM), "gate_up": gate_up, "gate": gate_up[:INTER], "up": gate_up[INTER:],
                       "down": w(HIDDEN, INTER), "qkv": w(QKV, HIDDEN), "g2": g(), "g1": g()})
    return layers


def unfused(attn, res, layers):
    """The seven kernels a layer, as the model runs them."""
    outs = []
    for w in layers:
        x, r1 = rms_norm(linear(attn, w["o"]), w["g2"], EPS, residual=res)
        x, res = rms_norm(linear(silu_and_mul(linear(x, w["gate_up"])), w["down"]), w["g1"], EPS, residual=r1)
        outs.append(linear(x, w["qkv"]))
    return outs, res


def fused(attn, res, layers, bufs, tiles, programs):
    """One launch a layer; `res` is updated in place (phase 1 has read all of it before phase 3
    writes it). bufs: r1, act, per-layer qkv outputs, counters (zeroed here)."""
    r1, act, qkvs, counters, ss1, ss2 = bufs
    counters.zero_()
    for i, w in enumerate(layers):
        _block_kernel[(programs,)](
            attn, res, w["o"], w["gate"], w["up"], w["down"], w["qkv"], w["g2"], w["g1"],
            r1, act, res, qkvs[i], counters[i], ss1, ss2, attn.shape[0], EPS, **tiles)
    return qkvs


# Output-tile widths of the four phases (o_proj, gate_up, down, qkv) and the K step.
TILINGS = {"narrow": dict(BN_O=16, BN_G=32, BN_D=16, BN_Q=32, BK=128),
           "wide": dict(BN_O=32, BN_G=64, BN_D=32, BN_Q=64, BK=64),
           "short-k": dict(BN_O=16, BN_G=32, BN_D=16, BN_Q=32, BK=64)}


def tiles_for(m: int, tiling: str, warps: int) -> dict:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return dict(BM=bm, **TILINGS[tiling], HIDDEN=HIDDEN, QDIM=QDIM, QKV=QKV, INTER=INTER, num_warps=warps,
                num_stages=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--programs", type=float, nargs="+", default=[1, 2],
                    help="programs a launch, per SM (on a CPU: 1 program in all). All of a launch's "
                         "programs must be resident at once for the barriers: more than 2 an SM may hang")
    ap.add_argument("--tilings", nargs="+", default=list(TILINGS), choices=list(TILINGS))
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = make_layers()[: args.layers]
    timed = DEV == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if timed else 1
    weight_bytes = sum(w[k].numel() * 2 for w in layers for k in ("o", "gate_up", "down", "qkv"))
    print(f"weight-read floor {weight_bytes / 4.24e12 * 1e3:.3f} ms a step")
    print("| rows | seven kernels a layer ms | one launch a layer ms | programs | tiling | warps | max rel. diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in args.batches:
        base = None
        for per_sm in args.programs:
            for tiling in args.tilings:
                for warps in args.warps:
                    programs = max(1, int(per_sm * sms)) if timed else 1
                    a, b, diff = measure(m, layers, programs, timed, tiles_for(m, tiling, warps), base)
                    base = a
                    print(f"| {m} | {a:.3f} | {b:.3f} | {programs} | {tiling} | {warps} | {diff:.1e} |", flush=True)


def measure(m: int, layers, programs: int, timed: bool, tiles: dict, base: float | None) -> tuple[float, ...]:
    """ms a step unfused (`base` if already timed) and fused (0 untimed), and the largest relative
    difference of a layer's qkv."""
    attn = torch.randn(m, QDIM, device=DEV, dtype=DTYPE)
    res = torch.randn(m, HIDDEN, device=DEV, dtype=DTYPE)
    bufs = (torch.empty(m, HIDDEN, device=DEV, dtype=DTYPE),
            torch.empty(m, INTER, device=DEV, dtype=DTYPE),
            [torch.empty(m, QKV, device=DEV, dtype=DTYPE) for _ in layers],
            torch.zeros(len(layers), device=DEV, dtype=torch.int32),
            torch.empty(m, HIDDEN // tiles["BN_O"], device=DEV, dtype=torch.float32),
            torch.empty(m, HIDDEN // tiles["BN_D"], device=DEV, dtype=torch.float32))
    want, _ = unfused(attn, res.clone(), layers)
    got = fused(attn, res.clone(), layers, bufs, tiles, programs)
    diff = max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want, strict=True))
    if not timed:
        return 0.0, 0.0, diff
    if base is None:
        base = time_graph(lambda: unfused(attn, res, layers))
    return base, time_graph(lambda: fused(attn, res, layers, bufs, tiles, programs)), diff


if __name__ == "__main__":
    main()
