"""Decode step time against its floor, and one stream's time to first token and inter-token latency.

A decode step must read the weights once and every running request's KV cache: at batch B and
context C that is (weight bytes + B * C * KV bytes per token) / 4.24 TB/s on one H200.

    python benchmarks/decode_latency.py [--model-dir /tmp/nanoplane-qwen3-0.6b-random]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import make_random_model  # noqa: E402

BANDWIDTH = 4.24e12  # bytes/s, H200 device copy (read + write), design.md


def step_times(llm, batch: int, context: int, steps: int) -> list[float]:
    """Admit `batch` requests with `context`-token prompts, prefill them, then time decode steps."""
    from controlplane import SamplingParams

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
    p.add_argument("--model-dir", default="/tmp/nanoplane-qwen3-0.6b-random")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    path = Path(args.model_dir)
    if not (path / "model.safetensors").is_file():
        make_random_model(path)

    from controlplane import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=4096)
    runner = llm.engine.data_plane.runner
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
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        stamps.append(time.perf_counter() - t)
    itl = sorted(stamps)[len(stamps) // 2] * 1e3
    print(f"| one stream, 512-token prompt | TTFT {ttft * 1e3:.1f} ms | inter-token {itl:.2f} ms (median) | "
          f"floor {weight_bytes / BANDWIDTH * 1e3:.2f} ms |")
    llm.close()


if __name__ == "__main__":
    main()
