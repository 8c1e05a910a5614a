"""Does pulling the next weights into L2 while the decode attention runs speed up a decode step?

    python benchmarks/l2_prefetch.py [--batches 16 64 128 256] [--context 1024]

A decode step of the 0.6B model at 16-256 rows spends ~25 µs a layer in four GEMMs that read 30 MB
of weights, against ~7.5 µs for the bytes (BENCHMARKS.md): each GEMM is too short to reach the
HBM rate. The attention between the QKV and output projections reads only the KV cache. This
times 28 layers of [QKV GEMM, decode attention, o_proj, gate_up, silu·mul, down] as one CUDA graph,
three ways: `base`; `prefetch`, where a kernel just before each attention issues bulk L2 prefetches
(cp.async.bulk.prefetch.L2, Hopper) of that layer's o_proj, gate_up, down and the next layer's QKV
weights, so that the GEMMs after it read L2; `hot`, every layer on the same weights (already in L2:
the bound for what prefetching could give).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import time_graph  # noqa: E402

from kernels import paged_decode_attention, silu_and_mul  # noqa: E402
from kernels.pdl import pdl_args, pdl_prologue  # noqa: E402
from models.layers.fused import enable_fused_kernels  # noqa: E402
from models.layers.linear import linear  # noqa: E402  (the data plane's GEMM for this many rows)

enable_fused_kernels(True)  # as the data plane on a GPU: `linear` takes the skinny GEMM at few rows

LAYERS, HIDDEN, HQ, HKV, D, INTER, PAGE = 28, 1024, 16, 8, 128, 3072, 256
SPAN = 256 * 1024  # bytes a program prefetches
SUB = SPAN // 128  # bytes a lane's bulk prefetch covers


@triton.jit
def _prefetch_kernel(table_ptr, SPAN: tl.constexpr, SUB: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (i, j): bytes [j * SPAN, (j + 1) * SPAN) of region i, one bulk prefetch a lane. Issued
    # before the PDL wait: weights never depend on the kernels before.
    i = tl.program_id(0)
    j = tl.program_id(1)
    base = tl.load(table_ptr + 2 * i)
    nbytes = tl.load(table_ptr + 2 * i + 1)
    off = j * SPAN + tl.arange(0, SPAN // SUB) * SUB
    addr = base + off
    size = tl.where(off < nbytes, tl.minimum(nbytes - off, SUB), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    pdl_prologue(USE_PDL)


def prefetch(table: torch.Tensor, most: int) -> None:
    """Bulk L2 prefetch of the regions in `table` ([k, 2] int64: address, bytes); `most`: largest bytes."""
    _prefetch_kernel[(table.shape[0], triton.cdiv(most, SPAN))](table, SPAN=SPAN, SUB=SUB, num_warps=4,
                                                                  **pdl_args(table.device))


def make_weights(copies: int) -> list[dict[str, torch.Tensor]]:
    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5

    return [{"qkv": w((HQ + 2 * HKV) * D, HIDDEN), "o": w(HIDDEN, HQ * D), "gate_up": w(2 * INTER, HIDDEN),
             "down": w(HIDDEN, INTER)} for _ in range(copies)]


def step(x, weights, caches, tables, lens, tables_of_prefetch):
    for layer in range(LAYERS):
        w = weights[layer % len(weights)]
        q = linear(x, w["qkv"])[:, : HQ * D].view(-1, HQ, D)
        if tables_of_prefetch is not None:
            prefetch(*tables_of_prefetch[layer])
        k_cache, v_cache = caches[layer]
        a = paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5)
        h = linear(a.view(-1, HQ * D), w["o"])
        x = linear(silu_and_mul(linear(h, w["gate_up"])), w["down"])
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    cold, hot = make_weights(LAYERS), make_weights(1)
    tables_of_prefetch = []
    for layer in range(LAYERS):
        regions = [cold[layer][n] for n in ("o", "gate_up", "down")] + [cold[(layer + 1) % LAYERS]["qkv"]]
        table = torch.tensor([[r.data_ptr(), r.numel() * r.element_size()] for r in regions], dtype=torch.int64,
                             device="cuda")
        tables_of_prefetch.append((table, max(r.numel() * r.element_size() for r in regions)))
    weight_bytes = sum(t.numel() * t.element_size() for w in cold for t in w.values())
    print("| rows | base ms | prefetch ms | hot weights ms | floor ms |")
    print("| --- | --- | --- | --- | --- |")
    for b in args.batches:
        base, pre, warm, floor = measure(b, args.context, cold, hot, tables_of_prefetch, weight_bytes)
        print(f"| {b} | {base:.3f} | {pre:.3f} | {warm:.3f} | {floor:.3f} |")


def measure(b: int, context: int, cold, hot, tables_of_prefetch, weight_bytes: int) -> tuple[float, ...]:
    """ms a step for base, prefetch and hot weights at b rows of `context` tokens, and the step's floor."""
    pages = -(-context // PAGE)
    caches = [(torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    tables = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    x = torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
    base = time_graph(lambda: step(x, cold, caches, tables, lens, None))
    pre = time_graph(lambda: step(x, cold, caches, tables, lens, tables_of_prefetch))
    warm = time_graph(lambda: step(x, hot, caches, tables, lens, None))
    kv_bytes = LAYERS * b * context * 2 * HKV * D * 2  # K and V, bf16
    return base, pre, warm, (weight_bytes + kv_bytes) / 4.24e12 * 1e3

if __name__ == "__main__":
    main()
