"""GEMMs that wait under programmatic dependent launch (CUTLASS sm90) against cuBLAS, at 65-256 rows.

    make -C benchmarks/cutlass CUTLASS=<a CUTLASS checkout> -j     # libpdl_gemm.so (nvcc, sm_90a)
    python benchmarks/cutlass_gemm.py [--rows 80 128 192 256]

Above 64 rows a decode layer runs its four projections through cuBLAS, whose kernels do not execute
`griddepcontrol.wait`: on a programmatic edge they read their input before it is written (BENCHMARKS.md,
twenty-second session), so the decode graphs keep full edges into them and each GEMM starts only after
the kernel before it has retired. CUTLASS's warp-specialized sm90 kernels, built with
CUTLASS_ENABLE_GDC_FOR_SM90, wait before their first load. This measures what that is worth:

1. Each projection shape of Qwen3-0.6B, each CUTLASS tiling (benchmarks/cutlass/*.cu) with and without
   PDL, checked against fp32 (as a new product and added into a residual), then timed as 28 dependent
   `y += x @ w^T` calls (each layer its own weight) in one CUDA graph: µs a call.
2. 28 layers of the decode step's non-attention chain, [qkv, silu·mul (Triton, PDL; a stand-in for the
   attention), o_proj +=, gate_up, silu·mul, down +=], with cuBLAS everywhere, then with each shape's
   fastest CUTLASS tiling from (1), with and without PDL: µs a layer, and the largest difference of the
   residual from cuBLAS's.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

# The repository root first: benchmarks/kernels.py would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gemm_chain import LAYERS, SHAPES, Case, layer_weights  # noqa: E402
from timing import time_graph  # noqa: E402

from kernels import silu_and_mul  # noqa: E402

CONFIGS = ["coop_128x128", "pingpong_64x128", "pingpong_64x64", "swap_pingpong_64x64", "pingpong_64x128_cluster2"]


class Kernels:
    """The library's GEMMs as torch-level calls: `addmm_(y, x, w)` (y += x @ w^T) and `linear(x, w)`."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    def variant(self, name: str, pdl: bool):
        fn = getattr(self.lib, name)
        fn.restype = ctypes.c_int
        # x, w, c, y; m, n, k; beta, stream; pdl, sms
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_void_p]
                       + [ctypes.c_int] * 2)

        def call(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
            assert x.is_contiguous() and w.is_contiguous() and y.is_contiguous()
            status = fn(x.data_ptr(), w.data_ptr(), c.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], x.shape[1],
                        beta, torch.cuda.current_stream().cuda_stream, int(pdl), self.sms)
            if status:
                raise RuntimeError(f"{name}: status {status}")
            return y

        def addmm_(y, x, w, layer=0):
            return call(x, w, y, y, 1.0)

        def linear(x, w):
            out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
            return call(x, w, out, out, 0.0)
        return addmm_, linear


def cublas():
    return (lambda y, x, w, layer=0: y.addmm_(x, w.t())), F.linear


def per_shape(variants: dict, rows: list[int]) -> tuple[list[str], dict]:
    """Table (1); returns its lines and each (shape, rows)'s fastest CUTLASS tiling under PDL."""
    weights = layer_weights()
    lines, fastest = [], {}
    for shape in SHAPES:
        for m in rows:
            case = Case(m, weights[shape])
            cells, times = [], {}
            for label, (addmm_, linear) in variants.items():
                if not case.checks(addmm_, label):
                    cells.append("wrong")
                    continue
                if case.wrong_product(linear(case.x, case.weights[0])):
                    cells.append("wrong")
                    continue
                times[label] = case.time(addmm_)
                cells.append(f"{times[label]:.2f}")
            waiting = {label: t for label, t in times.items() if label.endswith(" PDL")}
            fastest[(shape, m)] = min(waiting, key=waiting.get)[: -len(" PDL")] if waiting else None
            lines.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines, fastest


def layer_chain(kernels: Kernels, fastest: dict, rows: list[int]) -> list[str]:
    """Table (2)."""
    weights = layer_weights()
    lines = []
    for m in rows:
        h0 = torch.randn(m, SHAPES["o_proj"][0], device="cuda", dtype=torch.bfloat16) * 0.1
        results, times = {}, {}
        for mode in ("cuBLAS", "CUTLASS PDL", "CUTLASS"):
            gemms = {shape: cublas() if mode == "cuBLAS" or fastest[(shape, m)] is None
                     else kernels.variant(fastest[(shape, m)], mode.endswith("PDL")) for shape in SHAPES}
            h = h0.clone()

            def layers(h=h, h0=h0, gemms=gemms):
                h.copy_(h0)
                for i in range(LAYERS):
                    stand_in = silu_and_mul(gemms["qkv"][1](h, weights["qkv"][i]))
                    gemms["o_proj"][0](h, stand_in, weights["o_proj"][i])
                    act = silu_and_mul(gemms["gate_up"][1](h, weights["gate_up"][i]))
                    gemms["down"][0](h, act, weights["down"][i])
            times[mode] = time_graph(layers) / LAYERS * 1e3
            torch.cuda.synchronize()
            results[mode] = h.float()
        diff = max((results[mode] - results["cuBLAS"]).abs().max().item() for mode in ("CUTLASS PDL", "CUTLASS"))
        picks = ", ".join(f"{shape} {fastest[(shape, m)]}" for shape in SHAPES)
        lines.append(f"| {m} | {times['cuBLAS']:.2f} | {times['CUTLASS PDL']:.2f} | {times['CUTLASS']:.2f} | "
                     f"{diff:.3g} of {results['cuBLAS'].abs().max().item():.3g} | {picks} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[80, 128, 192, 256])
    parser.add_argument("--lib", type=Path, default=Path(__file__).with_name("cutlass") / "libpdl_gemm.so")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernels = Kernels(args.lib)
    variants = {"cuBLAS": cublas()}
    for name in CONFIGS:
        variants[f"{name} PDL"] = kernels.variant(name, True)
        variants[name] = kernels.variant(name, False)
    shapes, fastest = per_shape(variants, args.rows)
    chains = layer_chain(kernels, fastest, args.rows)
    print("\nµs a call, 28 dependent calls in one graph (PDL: launched with programmatic serialization):")
    print("| shape | rows | " + " | ".join(variants) + " |")
    print("| --- | --- |" + " --- |" * len(variants))
    print("\n".join(shapes))
    print("\n28 layers of [qkv, silu·mul, o_proj +=, gate_up, silu·mul, down +=], µs a layer:")
    print("| rows | cuBLAS | fastest CUTLASS, PDL | the same, no PDL | largest difference from cuBLAS | tilings |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(chains))


if __name__ == "__main__":
    main()
