"""How much of a decode step's linear layers is reading their weights from HBM: an upper bound.

    python benchmarks/gemm_l2_bound.py [--rows 8 16 32 64 96 128 192 256]

Qwen3-0.6B's four projections, 28 layers in one CUDA graph as the model chains them (each call adds
into its own output), each layer with its own weights (30 MB a layer: every weight byte crosses HBM,
as in the model) against every layer sharing one set of weights (after the first layer they come
from the 50 MB L2). The kernel is the one the model picks for that many rows: kernels.skinny_gemm
up to 64 rows (NANOPLANE_SKINNY_MAX_ROWS), cuBLAS `addmm_` above. The difference is what any way of
having the weights in L2 beforehand (a prefetch during the attention, persisting-L2 windows) could
win at most; what remains in the shared-weights column is the kernels' cost with no HBM read at all.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gemm_chain import LAYERS, SHAPES, layer_weights  # noqa: E402
from timing import time_graph  # noqa: E402

import kernels  # noqa: E402
from models.layers.linear import SKINNY_MAX_ROWS  # noqa: E402


def measure(m: int, weights: dict[str, list[torch.Tensor]]) -> str:
    """One table row: m rows through the kernel the model picks for them."""
    x = {n: torch.randn(m, SHAPES[n][1], device="cuda", dtype=torch.bfloat16) for n in SHAPES}
    y = {n: torch.zeros(m, SHAPES[n][0], device="cuda", dtype=torch.bfloat16) for n in SHAPES}
    skinny = m <= SKINNY_MAX_ROWS

    def us_a_layer(names: tuple[str, ...], shared: bool) -> float:
        def chain() -> None:
            for i in range(LAYERS):
                for name in names:
                    w = weights[name][0 if shared else i]
                    if skinny:
                        kernels.skinny_gemm(x[name], w, out=y[name], accumulate=True)
                    else:
                        y[name].addmm_(x[name], w.t())
        return time_graph(chain) / LAYERS * 1e3

    per_gemm = "; ".join(f"{n} {us_a_layer((n,), False):.2f} / {us_a_layer((n,), True):.2f}" for n in SHAPES)
    return (f"| {m} | {'skinny' if skinny else 'cuBLAS'} | {us_a_layer(tuple(SHAPES), False):.1f} | "
            f"{us_a_layer(tuple(SHAPES), True):.1f} | {per_gemm} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128, 192, 256])
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = layer_weights()
    print("| rows | kernel | four GEMMs a layer, own weights (µs) | shared weights, from L2 (µs) "
          "| per GEMM, own / shared (µs) |")
    print("| --- | --- | --- | --- | --- |")
    for m in args.rows:
        print(measure(m, weights), flush=True)


if __name__ == "__main__":
    main()
