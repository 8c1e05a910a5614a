"""What the QKV prologue costs a decode step: 28 layers of [prologue, decode attention] against each alone.

    python benchmarks/prologue_chain.py

bf16, Qwen3-0.6B's heads (16 q, 8 KV, head dim 128), contexts drawn from [128, 1024], rows handed to
the attention longest first, each chain one CUDA graph; µs a layer (BENCHMARKS.md, "The QKV
prologue and the decode attention").
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import time_graph  # noqa: E402

import kernels  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 16, 8, 128, 256, 28


def main() -> None:
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(2048, device="cuda").float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    norm = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    print("| rows | prologue | prologue + attention | attention |")
    print("| --- | --- | --- | --- |")
    for b in (1, 16, 64, 256):
        us = measure(b, cos_sin, norm)
        print(f"| {b} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} |", flush=True)


def measure(b: int, cos_sin: torch.Tensor, norm: torch.Tensor) -> list[float]:
    """µs a layer of the prologue, the prologue then the attention, and the attention, at b rows."""
    ctx = torch.randint(128, 1025, (b,), device="cuda", dtype=torch.int32)
    k_cache = torch.randn(b * 4, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(b * 4, device="cuda", dtype=torch.int32).view(b, 4)
    slots = tables[torch.arange(b), (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
    positions = (ctx - 1).long()
    qkv = torch.randn(b, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    order = torch.argsort(ctx, descending=True, stable=True).int()

    def prologue():
        return kernels.qkv_prologue(qkv, positions, cos_sin, norm, norm, 1e-6, slots, k_cache, v_cache, HQ, HKV)

    def attention(q):
        return kernels.paged_decode_attention(q, k_cache, v_cache, tables, ctx, D**-0.5, seq_order=order)

    chains = (prologue, lambda: attention(prologue()), lambda: attention(qkv[:, : HQ * D].view(b, HQ, D)))
    return [time_graph(lambda f=f: [f() for _ in range(LAYERS)]) * 1e3 / LAYERS for f in chains]

if __name__ == "__main__":
    main()
