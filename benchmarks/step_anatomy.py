"""Where a small-batch decode step's host time goes, against the GPU time of its CUDA graph.

At a few rows a decode step is bound by the host (scheduling, index uploads, the launches around the
graph) or by the graph's kernel count; this tells which. For each batch it prints the step's wall
time, the GPU time of the captured decode graph replayed back to back, the host time of one
`replay()` call, and the functions that take the step's host time (cProfile, own time).

    python benchmarks/step_anatomy.py [--batches 1 16 64] [--top 18]
    python benchmarks/step_anatomy.py --batches 64 256 --context 1024 --kernels   # + the graph's kernels
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import make_random_model  # noqa: E402


def admit(engine, batch: int, context: int, steps: int) -> None:
    from controlplane import SamplingParams

    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request([rng.randrange(0, 10000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    engine.step()


def graph_gpu_ms(graphs, batch: int, reps: int = 50) -> tuple[float, float]:
    """(GPU ms per replay back to back, host ms per replay() call) of the bucket serving `batch`."""
    import torch

    graph = graphs.graphs[graphs.bucket(batch)]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = 0.0
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        graph.replay()
        host += time.perf_counter() - t
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, host / reps * 1e3


def graph_kernels(graphs, batch: int, top: int, reps: int = 20) -> None:
    """Print the kernels of the decode graph serving `batch` by GPU time per replay (profiler)."""
    import torch

    graph = graphs.graphs[graphs.bucket(batch)]
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / reps
    print(f"\n## batch {batch}: graph kernels, {total / 1e3:.3f} ms GPU a replay")
    print("| kernel | us a replay | calls a replay | share |")
    for e in kernels[:top]:
        us = e.self_device_time_total / reps
        print(f"| {e.key[:70]} | {us:.1f} | {e.count / reps:.0f} | {us / total:.0%} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="/tmp/nanoplane-qwen3-0.6b-random")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--kernels", action="store_true", help="also list the decode graph's kernels (profiler)")
    args = p.parse_args()
    path = Path(args.model_dir)
    if not (path / "model.safetensors").is_file():
        make_random_model(path)

    from controlplane import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=4096)
    engine = llm.engine
    runner = engine.data_plane.runner
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rows = []
    for batch in args.batches:
        admit(engine, batch, args.context, args.steps)
        for _ in range(10):
            engine.step()
        prof = cProfile.Profile()
        times = []
        prof.enable()
        for _ in range(args.steps - 20):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        prof.disable()
        while engine.has_work():
            engine.step()
        # Same steps unprofiled, for the wall time without cProfile's overhead.
        admit(engine, batch, args.context, args.steps)
        plain = []
        for _ in range(args.steps - 10):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        while engine.has_work():
            engine.step()
        gpu_ms, replay_host_ms = graph_gpu_ms(runner.graphs, batch)
        if args.kernels:
            graph_kernels(runner.graphs, batch, args.top)
        wall = sorted(plain)[len(plain) // 2] * 1e3
        rows.append((batch, wall, gpu_ms, replay_host_ms))
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"\n## batch {batch}: cProfile own time over {len(times)} steps "
              f"(median profiled step {sorted(times)[len(times) // 2] * 1e3:.2f} ms)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-(args.top + 3) * 200:])
    print("\n| batch | step ms (median, wall) | model graph (with LM head) GPU ms | replay() host ms |")
    for batch, wall, gpu_ms, replay_host_ms in rows:
        print(f"| {batch} | {wall:.3f} | {gpu_ms:.3f} | {replay_host_ms:.3f} |")
    llm.close()


if __name__ == "__main__":
    main()
