"""Would torch.compile make the decoder faster than nanoplane's hand-fused Triton kernels?

    python benchmarks/compile.py [--rows 1 16 64 128 256] [--autotune-rows 64 256] [--prefill 16384]

Times 28 layers of the Qwen3-0.6B decoder (the bench's shapes) without the attention kernel: the
input RMSNorm with its residual add, the QKV projection, q/k RMSNorm, rotary and the KV-cache store,
o_proj, the post-attention norm, gate_up, silu·mul and down. The paged attention is left out on
purpose: it runs at its KV-read floor (BENCHMARKS.md) and is not something inductor would generate.
Three ways:

- `ours`: the data plane's path (Triton RMSNorm, qkv_prologue, silu_and_mul; the skinny GEMM up to
  64 rows, cuBLAS above);
- `inductor`: the models' plain-torch reference math through `torch.compile` (default mode: cuBLAS for
  the matmuls, generated Triton kernels for everything between them);
- `max-autotune`: the same with mode="max-autotune-no-cudagraphs", where inductor's own Triton GEMM
  templates compete with cuBLAS and can take the neighbouring pointwise work into them.

Decode sizes run as one CUDA graph of all 28 layers, as the data plane replays a step; the prefill size
runs eagerly, as the data plane runs prefill. Every variant's output is checked against `ours` first,
so all three do the same work. Floors: the weights read once at 4.24 TB/s, or the matmul FLOPs at 787
TFLOP/s if longer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import BANDWIDTH, MATMUL_FLOPS, median_ms, time_graph  # noqa: E402

import kernels  # noqa: E402
from models.layers.fused import enable_fused_kernels  # noqa: E402
from models.layers.linear import linear  # noqa: E402  (the data plane's GEMM for this many rows)
from models.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402

LAYERS, HIDDEN, HQ, HKV, D, INTER, PAGE, EPS = 28, 1024, 16, 8, 128, 3072, 256, 1e-6


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """models.layers.layernorm.RMSNorm._norm, as a function of tensors (a module argument would make
    dynamo compile once per layer)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x.to(dtype)


def layer_torch(x, residual, w, positions, cos_sin, slots, k_cache, v_cache):
    """One layer minus attention in the models' reference math (fused kernels off)."""
    residual = x + residual
    qkv = F.linear(rms(residual, w["in"]), w["qkv"])
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k = rms(q.view(-1, HQ, D), w["qn"]), rms(k.view(-1, HKV, D), w["kn"])
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_cache.view(-1, HKV, D).index_copy_(0, slots, k)
    v_cache.view(-1, HKV, D).index_copy_(0, slots, v.view(-1, HKV, D))
    residual = F.linear(q.flatten(1), w["o"]) + residual
    gate, up = F.linear(rms(residual, w["post"]), w["gate_up"]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w["down"]), residual


def layer_ours(x, residual, w, positions, cos_sin, slots, k_cache, v_cache):
    """The same layer as the data plane runs it (models/llama.py with fused kernels on)."""
    h, residual = kernels.rms_norm(x, w["in"], EPS, residual)
    qkv = linear(h, w["qkv"])
    q = kernels.qkv_prologue(qkv, positions, cos_sin, w["qn"], w["kn"], EPS, slots, k_cache, v_cache, HQ, HKV)
    h, residual = kernels.rms_norm(linear(q.flatten(1), w["o"]), w["post"], EPS, residual)
    return linear(kernels.silu_and_mul(linear(h, w["gate_up"])), w["down"]), residual


def make_layers() -> list[dict[str, torch.Tensor]]:
    def mat(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5

    def vec(n):
        return 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)

    return [{"in": vec(HIDDEN), "qkv": mat((HQ + 2 * HKV) * D, HIDDEN), "qn": vec(D), "kn": vec(D),
             "o": mat(HIDDEN, HQ * D), "post": vec(HIDDEN), "gate_up": mat(2 * INTER, HIDDEN),
             "down": mat(HIDDEN, INTER)} for _ in range(LAYERS)]


class Inputs:
    """A step of `rows` tokens: hidden states, positions, cache slots and a KV cache for each layer."""

    def __init__(self, rows: int):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        self.x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.residual = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        decode = rows <= 256
        # Decode: each row at its own position near the bench's contexts; prefill: one long prompt.
        self.positions = (torch.arange(rows, device="cuda") * 3 + 700 if decode else torch.arange(rows, device="cuda"))
        blocks = -(-rows // PAGE) + 1
        self.slots = torch.randperm(blocks * PAGE, device="cuda", generator=gen)[:rows]
        self.caches = [(torch.zeros(blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16),
                        torch.zeros(blocks, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16))
                       for _ in range(LAYERS)]

    def run(self, layer_fn, layers, count: int = LAYERS):
        x, residual = self.x, self.residual
        for i in range(count):
            x, residual = layer_fn(x, residual, layers[i], self.positions, COS_SIN, self.slots, *self.caches[i])
        return x, residual


def check(name: str, inputs: Inputs, layer_fn, layers) -> list[float]:
    """One layer against `ours`. The two round differently in places (bf16 intermediates), so they
    differ by ~1%; an op left out or done twice differs by far more."""
    got = inputs.run(layer_fn, layers, 1)
    want = inputs.run(layer_ours, layers, 1)
    errors = [((g.float() - e.float()).norm() / e.float().norm()).item() for g, e in zip(got, want, strict=True)]
    assert max(errors) < 5e-2, f"{name}: relative error {max(errors):.2e} against ours"
    return errors


def time_eager(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    return median_ms(fn, reps)


def floor_ms(rows: int) -> float:
    params = LAYERS * HIDDEN * ((HQ + 2 * HKV) * D + 2 * INTER) + LAYERS * (HQ * D + INTER) * HIDDEN
    return max(2 * params / BANDWIDTH, 2 * params * rows / MATMUL_FLOPS) * 1e3


def measure(name: str, layer_fn, layers, sizes: list[int], results: dict) -> None:
    for rows in sizes:
        began = time.perf_counter()
        inputs = Inputs(rows)
        try:
            errors = [] if layer_fn is layer_ours else check(name, inputs, layer_fn, layers)  # compiles this size
            step = lambda inputs=inputs: inputs.run(layer_fn, layers)  # noqa: E731
            results[name, rows] = time_graph(step) if rows <= 256 else time_eager(step)
        except Exception as e:  # one variant failing at one size leaves the rest of the table
            print(f"{name:>12} {rows:>6} rows: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"{name:>12} {rows:>6} rows: {results[name, rows]:.3f} ms "
              f"(set up and compile {time.perf_counter() - began:.0f} s; error against ours "
              f"{', '.join(f'{e:.1e}' for e in errors) or '-'})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    ap.add_argument("--autotune-rows", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--prefill", type=int, default=16384, help="tokens of the eager prefill size (0: none)")
    args = ap.parse_args()
    torch.manual_seed(0)
    enable_fused_kernels(True)  # `ours` as the data plane on a GPU: `linear` takes the skinny GEMM at few rows
    torch._dynamo.config.cache_size_limit = 64  # one graph per size, for every size
    global COS_SIN
    COS_SIN = RotaryEmbedding(D, 40960, 1e6).cos_sin_cache.cuda()
    layers = make_layers()
    sizes = args.rows + ([args.prefill] if args.prefill else [])
    results: dict = {}
    measure("ours", layer_ours, layers, sizes, results)
    measure("inductor", torch.compile(layer_torch, dynamic=False), layers, sizes, results)
    torch._dynamo.reset()  # the next compile must not reuse the default mode's code for the same function
    if args.autotune_rows:
        tuned = torch.compile(layer_torch, dynamic=False, mode="max-autotune-no-cudagraphs")
        measure("max-autotune", tuned, layers, args.autotune_rows, results)
    print("\n| rows | ours ms | inductor ms | inductor max-autotune ms | floor ms |")
    print("| --- | --- | --- | --- | --- |")
    for rows in sizes:
        cells = [results.get((name, rows)) for name in ("ours", "inductor", "max-autotune")]
        print(f"| {rows}{' (prefill, eager)' if rows > 256 else ''} | "
              + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + f" | {floor_ms(rows):.3f} |")


COS_SIN = torch.empty(0)

if __name__ == "__main__":
    main()
