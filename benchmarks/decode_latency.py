"""Decode step time against its floor, and one stream's time to first token and inter-token latency.

A decode step must read the weights once and every running request's KV cache: at batch B and
context C that is (weight bytes + B * C * KV bytes per token) / 4.24 TB/s on one H200.

    python -m benchmarks.decode_latency [--shape 8b] [--tensor-parallel-size 2] [--host-profile]

With tensor parallelism the floor counts one rank's share of the weights and KV cache. `--host-profile`
lists rank 0's host time by operator over the one-stream decode steps (torch profiler, CPU only).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from pathlib import Path

from benchmarks.throughput import SHAPES, make_random_model

BANDWIDTH = 4.24e12  # bytes/s, H200 device copy (read + write), docs/design.md


def step_times(llm, batch: int, context: int, steps: int) -> list[float]:
    """Admit `batch` requests with `context`-token prompts, prefill them, then time decode steps."""
    from nanoplane.controlplane import SamplingParams

    rng = random.Random(batch)
    engine = llm.engine
    for _ in range(batch):
        engine.add_request([rng.randrange(0, 10000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    engine.step()  # with a step in flight, the next result is the last prefill's; start after it
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = engine.step()
        times.append(time.perf_counter() - t)
        assert not out.is_prefill and len(out.rows) == batch, "not a full decode step"
    while engine.has_work():
        engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="", help="default: /tmp/nanoplane-qwen3-<shape>-random")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--host-profile", action="store_true")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    path = Path(args.model_dir or f"/tmp/nanoplane-qwen3-{args.shape}-random")
    if not (path / "model.safetensors").is_file():
        make_random_model(path, args.shape)

    from nanoplane.controlplane import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=4096, tensor_parallel_size=args.tensor_parallel_size)
    runner = llm.engine.data_plane.runner  # rank 0: its shard of the weights and of the KV heads
    # parameters() yields a tied embedding once; it is read once per step too
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    cache = runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    kv_per_token = cache[:, :, 0, 0].numel() * cache.element_size()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    print(f"weights {weight_bytes / 2**30:.2f} GiB, KV {kv_per_token} bytes per token")
    print("| batch | context | decode step ms (median) | floor ms | of floor |")
    for batch in (1, 16, 64, 256):
        times = sorted(step_times(llm, batch, args.context, args.steps))
        median = times[len(times) // 2] * 1e3
        floor = (weight_bytes + batch * args.context * kv_per_token) / BANDWIDTH * 1e3
        print(f"| {batch} | {args.context} | {median:.2f} | {floor:.2f} | {floor / median:.0%} |")

    # One stream: time to first token (prefill of 512 tokens + first sample) and inter-token latency.
    engine = llm.engine
    rng = random.Random(0)
    engine.add_request([rng.randrange(0, 10000) for _ in range(512)],
                       SamplingParams(temperature=0, max_tokens=129, ignore_eos=True))
    t = time.perf_counter()
    while not engine.step().produced:  # with a step in flight the first token comes a call later
        pass
    ttft = time.perf_counter() - t
    stamps = []
    profiler = host_profiler() if args.host_profile else contextlib.nullcontext()
    with profiler:
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            stamps.append(time.perf_counter() - t)
    itl = sorted(stamps)[len(stamps) // 2] * 1e3
    if args.host_profile:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"| one stream, 512-token prompt, TP={args.tensor_parallel_size} | TTFT {ttft * 1e3:.1f} ms | "
          f"inter-token {itl:.2f} ms (median) | floor {weight_bytes / BANDWIDTH * 1e3:.2f} ms |")
    llm.close()


def host_profiler():
    """This process's host time by operator (rank 0 runs here; other ranks are not profiled)."""
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


if __name__ == "__main__":
    main()
