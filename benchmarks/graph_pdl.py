"""Do cuBLAS's GEMMs wait on a programmatic edge, and what would starting them early save?

    python benchmarks/graph_pdl.py [--rows 80 128 192 256]

1. `graph_edges.check` on Qwen3-0.6B's four projection shapes, as a new GEMM (`F.linear`) and added
   into a residual (`addmm_`), at each row count: the kernels whose edges it made programmatic, and
   whether their results were right behind a producer that writes their input late. Controls: a
   Triton kernel that waits before touching memory (passes), and `x * 2`, a torch kernel with no
   wait at all (fails). On the H200 every cuBLAS GEMM failed (BENCHMARKS.md, twenty-second session),
   which is why the decode graphs keep full edges into them.
2. The chain the model runs above 64 rows, 28 layers of [silu·mul (Triton, PDL), down `addmm_`],
   in one graph, µs a layer: full edges into the GEMMs against programmatic ones. What a GEMM that
   waited would save; the programmatic figure itself comes from GEMMs that read unfinished input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The repository root first: benchmarks/kernels.py would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gemm_chain import LAYERS, SHAPES, layer_weights  # noqa: E402
from graph_edges import check, doubling, rewire  # noqa: E402
from timing import median_ms  # noqa: E402

from kernels import silu_and_mul  # noqa: E402

DEVICE, DTYPE = torch.device("cuda"), torch.bfloat16


def checks(rows: list[int]) -> list[str]:
    lines = []
    for name, control in (("x * 2 (no wait)", lambda x, y: x * 2), ("Triton, waits first", doubling())):
        entered, good = check(control, rows[0], 1024, 1024, DTYPE, DEVICE)
        lines.append(f"| {rows[0]} | {name} | {', '.join(sorted(entered))[:60]} | {good} |")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02
        for m in rows:
            for kind, gemm in (("F.linear", lambda x, y, w=w: F.linear(x, w)),
                               ("addmm_", lambda x, y, w=w: y.addmm_(x, w.t()))):
                entered, good = check(gemm, m, k, n, DTYPE, DEVICE)
                lines.append(f"| {m} | {name} {kind} | {', '.join(sorted(entered)) or '-'} | {good} |")
                print(lines[-1], flush=True)
    return lines


def chain_timing(rows: list[int]) -> list[str]:
    n, k = SHAPES["down"]
    weights = layer_weights(("down",))["down"]
    lines = []
    for m in rows:
        gate_up = torch.randn(m, 2 * k, device=DEVICE, dtype=DTYPE)
        y = torch.randn(m, n, device=DEVICE, dtype=DTYPE)
        times = []
        for early in (False, True):
            chain = [lambda w=w, y=y, g=gate_up: y.addmm_(silu_and_mul(g), w.t()) for w in weights]
            for call in chain:
                call()
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                for call in chain:
                    call()
            changed = len(rewire(graph.raw_cuda_graph(), lambda name: "silu" not in name)) if early else 0
            graph.instantiate()
            times.append(median_ms(graph.replay, 50) / LAYERS * 1e3)
        lines.append(f"| {m} | {times[0]:.2f} | {times[1]:.2f} | {changed} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[80, 128, 192, 256])
    args = parser.parse_args()
    found = checks(args.rows)
    timed = chain_timing(args.rows)
    print("\n| rows | GEMM | kernels the check made programmatic edges into | result right behind a late producer |")
    print("| --- | --- | --- | --- |")
    print("\n".join(found))
    print("\n| rows | silu·mul + down, full edges µs a layer | programmatic edges µs a layer | edges changed |")
    print("| --- | --- | --- | --- |")
    print("\n".join(timed))


if __name__ == "__main__":
    main()
