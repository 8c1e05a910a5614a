"""Every algorithm cuBLASLt's heuristic offers for the decode step's linear layers, against torch.

    python benchmarks/cublaslt_algos.py [--rows 96 160 256] [--algos 32] [--workspace-mb 32]

torch's `addmm_` runs the first algorithm cuBLAS's heuristic ranks, with torch's workspace. At
65-256 rows the 0.6B's projections are 1-3 GFLOP each and run at 6-8 us a call (BENCHMARKS.md),
against 1.4-4 us of tensor-core time: this asks whether another algorithm of the heuristic's list
(split-K ones need the workspace) is faster. Each algorithm is checked against fp32 first and timed
as the model runs it: 28 dependent calls (y += x @ w^T, each layer its own weight) in one CUDA graph.
cuBLASLt is reached through ctypes (torch does not expose the algorithm choice).
"""

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_chain import Case, layer_weights  # noqa: E402

# cuBLAS / CUDA enum values (cublasLt.h, library_types.h).
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
ALGO_CONFIG_NAMES = {0: "id", 1: "tile", 2: "splitk", 3: "reduction", 4: "swizzle", 5: "custom", 6: "stages",
                     7: "inner", 8: "cluster"}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt() -> ctypes.CDLL:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import glob
    import os

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcublasLt.so*")):
        return ctypes.CDLL(path)
    raise OSError("libcublasLt not found")


class Lt:
    def __init__(self, workspace_bytes: int):
        self.lib = load_lt()
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device="cuda")
        self.workspace_bytes = workspace_bytes
        self.one = ctypes.c_float(1.0)

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def plan(self, m: int, n: int, k: int, count: int):
        """Descriptors for y[m, n] (row-major) += x[m, k] @ w[n, k]^T, i.e. column-major
        y^T[n, m] = op_T(w as [k, n]) @ x^T as [k, m]; and up to `count` heuristic results."""
        lib, vp = self.lib, ctypes.c_void_p
        desc = vp()
        self.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            self.check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.c_size_t(4)),
                       "trans")
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
            lay = vp()
            self.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                      ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            layouts.append(lay)
        pref = vp()
        self.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(self.workspace_bytes)
        self.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                             ctypes.c_size_t(8)),
                   "pref ws")
        results = (Heuristic * count)()
        found = ctypes.c_int()
        a, b, c = layouts
        self.check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                       ctypes.byref(found)), "heuristic")
        return (desc, a, b, c), [results[i] for i in range(found.value) if results[i].state == 0]

    def config(self, algo: Algo) -> str:
        out = []
        for attr, name in ALGO_CONFIG_NAMES.items():
            for ctype in (ctypes.c_uint32, ctypes.c_uint16):  # the shape ids are 16-bit
                v, written = ctype(), ctypes.c_size_t()
                if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                                  ctypes.c_size_t(ctypes.sizeof(v)),
                                                                  ctypes.byref(written)) == 0:
                    out.append(f"{name}={v.value}")
                    break
        return " ".join(out)

    def addmm_(self, plan, algo: Algo, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        desc, a, b, c = plan
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self.one), ctypes.c_void_p(w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.one), ctypes.c_void_p(y.data_ptr()), c,
            ctypes.c_void_p(y.data_ptr()), c, ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(self.workspace_bytes), stream), "matmul")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[96, 160, 256])
    parser.add_argument("--algos", type=int, default=32)
    parser.add_argument("--workspace-mb", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = layer_weights()
    lt = Lt(args.workspace_mb << 20)
    table = []
    for m in args.rows:
        for name, ws in weights.items():
            case = Case(m, ws)
            n, k = ws[0].shape
            t_torch = case.time_cublas()
            plan, results = lt.plan(m, n, k, args.algos)
            timed = []
            for i, res in enumerate(results):
                def addmm_(y, x, w, layer, algo=res.algo, plan=plan):
                    lt.addmm_(plan, algo, y, x, w)
                if not case.checks(addmm_, f"{name} m={m} #{i}"):
                    continue
                t = case.time(addmm_)
                timed.append((t, i, lt.config(res.algo), res.workspace_size))
                print(f"m={m} {name} #{i}: {t:.2f} us  ws {res.workspace_size >> 10} KiB  {timed[-1][2]}", flush=True)
            timed.sort()
            best = timed[0] if timed else (float("nan"), -1, "", 0)
            first = next((t for t in timed if t[1] == 0), best)
            table.append(f"| {m} | {name} | {t_torch:.2f} | {first[0]:.2f} | **{best[0]:.2f}** (#{best[1]} of "
                         f"{len(results)}: {best[2]}) |")
            print(table[-1], flush=True)
    print("| rows | layer | torch addmm_ us | heuristic's first us | best of the list us |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
