"""What benchmarks/throughput.py records of a run beside its tokens/s: each step's time against its
own floor (the bytes it must read, or its matmul FLOPs), grouped by kind of step; the host's and
the GPU's share of each step; profiler windows with --profile; garbage-collector pauses and CUDA
allocator calls during the timed run."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def instrument(llm) -> dict[str, list[float]]:
    """Wrap the engine step and the data plane so that each step's time splits into host and device.

    With a step in flight, `launch` is the data plane's host work for a step (apply the descriptor,
    prepare and queue the GPU work) and `wait` the time the host then blocks on the previous step's
    GPU work: a wait near zero means the host, not the GPU, sets the pace."""
    engine, runner = llm.engine, llm.engine.data_plane.runner
    timings: dict[str, list[float]] = {"step": [], "launch": [], "wait": [], "rows": []}
    step, launch, wait = engine.step, runner.launch, runner.wait

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timings[name].append(time.perf_counter() - t)
            return out
        return wrapper

    import torch

    activity = torch.profiler.ProfilerActivity
    # Three windows: prefill (steps 2-3), decode at a full batch (300-309), and the small-batch tail
    # (the first ten steps with at most 8 rows).
    windows = {"prefill": (2, 4), "decode, full batch": (300, 310)}
    state: dict = {"prof": None, "name": "", "end": -1}

    def step_with_rows():
        n = len(timings["step"])
        rows = timings["rows"][-1] if timings["rows"] else 0
        if state["prof"] is None and "tail" not in windows and 0 < rows <= 8:
            windows["tail"] = (n, n + 10)
        for name, (lo, hi) in windows.items():
            if n == lo and state["prof"] is None:
                state.update(prof=torch.profiler.profile(activities=[activity.CPU, activity.CUDA]), name=name, end=hi)
                state["prof"].start()
        out = timed("step", step)()
        timings["rows"].append(len(out.rows))
        if state["prof"] is not None and n + 1 == state["end"]:
            prof, state["prof"] = state["prof"], None
            torch.cuda.synchronize()
            prof.stop()
            lo, hi = windows[state["name"]]
            events = prof.key_averages()
            # Kernels only: an aten op's row repeats the time of the kernels it launched.
            gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"\n== {state['name']}: steps {lo}-{hi - 1}, GPU busy {gpu_us / (hi - lo) / 1e3:.2f} ms/step ==")
            print(events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            if state["name"] == "tail":  # small batches: the host may set the pace; where its time goes
                print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        return out

    engine.step = step_with_rows
    runner.launch = timed("launch", launch)
    runner.wait = timed("wait", wait)
    return timings


BANDWIDTH, MATMUL = 4.24e12, 787e12  # bytes/s and bf16 FLOP/s of one H200 (docs/design.md)
BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 256))


def pace(llm) -> Callable[[], list[tuple]]:
    """Start recording, for every step of the timed run, (rows, prefill tokens, KV tokens read,
    seconds, host seconds to launch it, GPU seconds on it, GPU seconds idle before it); the function
    returned gives the steps so far (the last three NaN where the data plane is not in-process).

    The seconds are the time between consecutive step results: with a step in flight the GPU runs
    step i right after i - 1, so that interval is step i's cost to the run, whoever set the pace (GPU
    or host). Wraps the engine's data-plane client; a perf_counter and a list append a step."""
    client = llm.engine.data_plane
    submit, collect = client.submit, client.collect
    sent: list[tuple[int, int, int]] = []
    done: list[float] = []

    def recording_submit(desc):
        scheduled = desc.num_scheduled.astype("int64")
        prefill = int(scheduled[scheduled > 1].sum())  # decode rows compute one token each
        sent.append((desc.num_rows, prefill, int(desc.num_computed.sum() + scheduled.sum())))
        return submit(desc)

    def recording_collect(step_id):
        out = collect(step_id)
        done.append(time.perf_counter())
        return out

    client.submit, client.collect = recording_submit, recording_collect
    # The in-process rank's host time to queue each step (apply the descriptor, launch the kernels),
    # and CUDA events around that work on the GPU's stream: the GPU's time on the step, and how long
    # it sat idle before it because the step was not queued yet (the host set the pace there).
    launches: list[float] = []
    events: list[tuple] = []
    runner = getattr(client, "runner", None)
    if runner is not None:
        import torch

        launch, cuda = runner.launch, runner.device.type == "cuda"

        def timed_launch(desc):
            t = time.perf_counter()
            if cuda:
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
            out = launch(desc)
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((begin, end))
            launches.append(time.perf_counter() - t)
            return out

        runner.launch = timed_launch
    start = [time.perf_counter()]

    def steps() -> list[tuple]:
        times = [b - a for a, b in zip(start + done, done, strict=False)]
        nan = [float("nan")] * len(times)
        host = launches if len(launches) >= len(times) else nan
        gpu, idle = nan, nan
        if len(events) >= len(times):
            events[-1][1].synchronize()
            gpu = [b.elapsed_time(e) / 1e3 for b, e in events]
            idle = [0.0] + [events[i - 1][1].elapsed_time(events[i][0]) / 1e3 for i in range(1, len(events))]
        return [(*s, t, h, g, i) for s, t, h, g, i in zip(sent, times, host, gpu, idle, strict=False)]

    return steps


def report_pace(steps: list[tuple], runner) -> None:
    """Where the run's time goes, by kind of step, against each step's own floor: the bytes it must
    read (weights once, each row's KV cache) at 4.24 TB/s, or its matmul FLOPs at 787 TFLOP/s if that
    is longer (every computed token through the decoder layers' weights, each row through the LM
    head; attention FLOPs left out, which flatters prefill slightly)."""
    named = list(runner.model.named_parameters())
    weights = sum(t.numel() * t.element_size() for _, t in named)
    # The embedding is a lookup, not a matmul; the LM head (or the tied embedding) runs on one row
    # per sequence, not on every prompt token.
    vocab = [t.numel() for name, t in named if "embed" in name or "lm_head" in name]
    head = max(vocab)
    body = sum(t.numel() for _, t in named) - sum(vocab)
    cache = runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    kv_per_token = cache[:, :, 0, 0].numel() * cache.element_size()
    groups: dict[str, list[float]] = {}
    for rows, prefill, kv_tokens, seconds, _, gpu, idle in steps:
        flops = 2 * body * (prefill or rows) + 2 * head * rows
        floor = max((weights + kv_tokens * kv_per_token) / BANDWIDTH, flops / MATMUL)
        if prefill:
            name = "prefill (or mixed)"
        else:
            lo, hi = next((b for b in BUCKETS if rows <= b[1]), (BUCKETS[-1][1] + 1, rows))
            name = f"decode {lo}-{hi} rows"
        g = groups.setdefault(name, [0, 0.0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[1] += seconds
        g[2] += floor
        g[3] += gpu
        g[4] += idle
    total_gap = sum(g[1] - g[2] for g in groups.values())
    print("| steps | count | seconds | floor s | of floor | gap s | share of the gap | GPU busy s | GPU idle s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in sorted(groups, key=lambda k: (not k.startswith("prefill"), int(k.split()[1].split("-")[0])
                                              if k.startswith("decode") else 0)):
        n, seconds, floor, gpu, idle = groups[name]
        print(f"| {name} | {n} | {seconds:.3f} | {floor:.3f} | {floor / seconds:.0%} | {seconds - floor:.3f} | "
              f"{(seconds - floor) / total_gap:.0%} | {gpu:.3f} | {idle:.3f} |")
    n, seconds, floor, gpu, idle = (sum(g[i] for g in groups.values()) for i in range(5))
    print(f"| all | {n} | {seconds:.3f} | {floor:.3f} | {floor / seconds:.0%} | {seconds - floor:.3f} | 100% | "
          f"{gpu:.3f} | {idle:.3f} |")
    # A few slow steps (a kernel compiled mid-run, a stall) hide in a bucket's sum; name them.
    slowest = sorted(range(len(steps)), key=lambda i: steps[i][3], reverse=True)[:6]
    print("slowest steps (index: rows, prefill tokens, ms; host launch, GPU busy, GPU idle before it, ms): "
          + ", ".join(f"{i}: {steps[i][0]}, {steps[i][1]}, {steps[i][3] * 1e3:.1f}; "
                      + ", ".join(f"{x * 1e3:.1f}" for x in steps[i][4:]) for i in sorted(slowest)))


def watch_gc() -> list[tuple[int, float]]:
    """(generation, seconds) of every collection of Python's cyclic garbage collector from now on: a
    collection stops the engine's thread, and with it the next step's launch."""
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(callback)
    return pauses


def report_gc(pauses: list[tuple[int, float]]) -> None:
    by_gen = [sum(1 for g, _ in pauses if g == gen) for gen in range(3)]
    total = sum(s for _, s in pauses)
    longest = max((s for _, s in pauses), default=0.0)
    print(f"garbage collections during the run: {len(pauses)} (by generation {by_gen[0]}/{by_gen[1]}/{by_gen[2]}), "
          f"{total * 1e3:.1f} ms in all, longest {longest * 1e3:.1f} ms", flush=True)


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's counters that stall a run: device allocations and frees (each a
    cudaMalloc or cudaFree, which synchronise) and retries after an out-of-memory."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def report_allocator(before: dict[str, int]) -> None:
    if before:
        after = allocator_counts()
        print("CUDA allocator during the run (rank 0): " + ", ".join(
            f"{k.removeprefix('num_')} {after[k] - before[k]}" for k in before))


def report(t: dict[str, list[float]], elapsed: float) -> None:
    step, launch, wait = sum(t["step"]), sum(t["launch"]), sum(t["wait"])
    n = len(t["step"])
    print(f"steps {n}: total {elapsed:.2f} s; engine.step {step:.2f} s ({step / n * 1e3:.2f} ms/step); data plane "
          f"launch (host prep + queue) {launch / n * 1e3:.2f} ms/step; host blocked on the GPU {wait / n * 1e3:.2f} "
          f"ms/step; control plane {(step - launch - wait) / n * 1e3:.2f} ms/step")
    for lo, hi in BUCKETS:
        rows = [i for i, r in enumerate(t["rows"]) if lo <= r <= hi]
        if rows:
            step_ms, launch_ms, wait_ms = (_mean_ms(t[key], rows) for key in ("step", "launch", "wait"))
            print(f"  batch {lo:>3}-{hi:<3}: {len(rows):>5} steps, step {step_ms:.2f} ms, launch {launch_ms:.2f} ms, "
                  f"blocked on GPU {wait_ms:.2f} ms")


def _mean_ms(values: list[float], indices: list[int]) -> float:
    picked = [values[i] for i in indices if i < len(values)]
    return sum(picked) / max(1, len(picked)) * 1e3
