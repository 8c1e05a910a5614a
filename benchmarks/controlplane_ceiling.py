"""How many tokens per second the control plane alone can stream: the gRPC server, engine thread,
scheduler and detokenizer of `nanoplane serve`, over a data plane that answers every step at once.

The throughput benchmark's service mode through a GPU data plane is bounded by this ceiling too, so
it says what the control-plane process costs without a GPU (runs on any machine). Same workload as
benchmarks/throughput.py (256 streams from one client process, nano-vllm's prompt and output
lengths, the same tokenizer and vocabulary); the "data plane" samples uniform random ids and may be
told to take `--step-ms` per step, as a GPU would.

    python -m benchmarks.controlplane_ceiling [--step-ms 0] [--profile] [--remote [--engine-process]]

`--remote` puts the real ZeroMQ path in between: the control plane binds as `nanoplane serve` does and
a rank process (dataplane/worker.py's loop) answers, its model runner only emulating the step time.
`--engine-process` runs the engine in its own process as `nanoplane serve` does by default (the control
plane's critical path is then timed by the rank: NANOPLANE_RANK_PACE=N).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.throughput import QWEN3_06B, drive_streams, one_stream, warmup_workload, workload
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult


class InstantDataPlane:
    """Answers each step after `step_s` with random ids from the whole vocabulary; never EOS (the
    workload ignores it anyway). Holds no state: the control plane cannot tell it from a real one."""

    def __init__(self, vocab_size: int, step_s: float, num_blocks: int = 8192, block_size: int = 256):
        self.vocab_size, self.step_s = vocab_size, step_s
        self.num_blocks, self.block_size = num_blocks, block_size
        self.rng = np.random.default_rng(0)
        self.pending: dict[int, tuple[float, int]] = {}
        self.busy_until = 0.0  # steps run one after the other, as on a GPU
        self.steps = self.prefill_steps = 0

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, self.num_blocks, self.block_size, 256, 4096, self.vocab_size,
                          "InstantDataPlane", "cpu", "bfloat16")]

    def submit(self, desc: StepDescriptor) -> None:
        self.steps += 1
        self.prefill_steps += bool((desc.num_scheduled > 1).any() or len(desc.new_requests))
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        self.pending[desc.step_id] = (self.busy_until, len(desc.slots))

    def collect(self, step_id: int) -> StepResult:
        due, rows = self.pending.pop(step_id)
        if (wait := due - time.perf_counter()) > 0:
            time.sleep(wait)
        return StepResult(step_id, self.rng.integers(1, self.vocab_size, rows, dtype=np.int32))

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.submit(desc)
        return self.collect(desc.step_id)

    def close(self) -> None:
        print(f"data plane: {self.steps} steps, {self.prefill_steps} with prefill rows", flush=True)


class _Due:
    """Stands in for the CUDA event a real step records: done once the emulated GPU is past it."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at


class TimedRunner:
    """A ModelRunner for a real rank process (`--remote`): the worker's loop, sockets and codec are
    the real ones; the "GPU" runs each step `step_s` after the previous one ends, as a queue does."""

    def __init__(self, cfg, step_s: float = 0.0, vocab_size: int = QWEN3_06B["vocab_size"]):
        self.cfg, self.step_s, self.vocab_size = cfg, step_s, vocab_size
        self.num_kv_blocks, self.block_size, self.device = 8192, 256, "cpu"
        self.rng = np.random.default_rng(0)
        self.busy_until = 0.0

    def info(self) -> PlaneInfo:
        # It stands in for a GPU rank (its launch queues the step and returns), so it says so: the control
        # plane then keeps as many steps in flight as it would for one (RemoteDataPlane.steps_in_flight).
        return PlaneInfo(0, 1, self.cfg.epoch, self.num_kv_blocks, self.block_size, 256, 4096, self.vocab_size,
                         "TimedRunner", "cuda:emulated", "bfloat16")

    def launch(self, desc: StepDescriptor):
        from nanoplane.dataplane.model_runner import Launched

        self.busy_until = max(time.perf_counter(), self.busy_until) + self.step_s
        ids = self.rng.integers(1, self.vocab_size, len(desc.slots), dtype=np.int32)
        return Launched(desc.step_id, time.perf_counter(), ids, _Due(self.busy_until))

    def wait(self, launched) -> StepResult:
        while not launched.done.query():
            pass  # spin, as Event.synchronize does
        return StepResult(launched.step_id, launched.host)

    def close(self) -> None:
        pass


def timed_rank(control: str, step_s: float) -> None:
    """A rank process (`nanoplane dataplane`'s worker) around a TimedRunner."""
    from nanoplane.dataplane import model_runner
    from nanoplane.dataplane.config import DataPlaneConfig
    from nanoplane.dataplane.worker import WorkerOptions, run_rank

    model_runner.ModelRunner = lambda cfg: TimedRunner(cfg, step_s)
    run_rank(DataPlaneConfig(model=""), WorkerOptions(control=control, launch_id=1))


def steps_in_flight(plane) -> int:
    """The engine's steps in flight over this plane, as Engine picks them when the config leaves them
    open (a remote plane knows only once its rank has attached)."""
    return getattr(plane, "steps_in_flight", 1)


def time_critical_path(plane) -> list[float]:
    """Wrap the plane's submit and collect: for each step s + d + 1 (d: the engine's steps in flight),
    the seconds from holding step s's result to having sent step s + d + 1's descriptor. That is the
    control plane's share of what the GPU waits on (the rank's launch and the two socket hops are the
    rest)."""
    got: dict[int, float] = {}
    spans: list[float] = []
    submit, collect = plane.submit, plane.collect

    def timed_submit(desc: StepDescriptor) -> None:
        submit(desc)
        at = got.pop(desc.step_id - 1 - steps_in_flight(plane), None)
        if at is not None and time.perf_counter() - at < 1.0:  # longer: the service was idle
            spans.append(time.perf_counter() - at)

    def timed_collect(step_id: int) -> StepResult:
        out = collect(step_id)
        got[step_id] = time.perf_counter()
        return out

    plane.submit, plane.collect = timed_submit, timed_collect
    return spans


def serve(model_dir: str, step_s: float, profile: bool, port_queue, stop_event, remote: str = "",
          engine_process: bool = False) -> None:
    """The control plane as `nanoplane serve` runs it (its GIL switch interval too), in this process;
    over ZeroMQ to a rank at `remote` (an ipc:// address) if given, else over an in-process stand-in."""
    from nanoplane.controlplane.config import EngineConfig
    from nanoplane.controlplane.dataplane_client import RemoteDataPlane
    from nanoplane.controlplane.engine_loop import EngineLoop as AsyncEngine
    from nanoplane.controlplane.service import build_server, set_gil_switch_interval

    set_gil_switch_interval()
    engine_profile, loop_profile = cProfile.Profile(), cProfile.Profile()
    if profile:  # the engine thread has its own profiler: cProfile sees one thread at a time
        run = AsyncEngine._run
        AsyncEngine._run = lambda self: engine_profile.runcall(run, self)

    async def main() -> None:
        config = EngineConfig(model_dir, max_model_len=4096, kvcache_block_size=256)
        if engine_process:
            from nanoplane.controlplane.service import build_process_server

            server, spans = build_process_server(config, remote), []
        else:
            plane = RemoteDataPlane(remote, world_size=1) if remote else InstantDataPlane(QWEN3_06B["vocab_size"],
                                                                                          step_s)
            spans = time_critical_path(plane)
            server = build_server(config, plane)
        port = await server.start()
        while engine_process and not server.front.data_plane_ready:  # the engine process attaches the rank
            await asyncio.sleep(0.05)
        port_queue.put(port)
        while not stop_event.is_set():
            await asyncio.sleep(0.05)
        depth = 1 if engine_process else steps_in_flight(plane)  # before the stop detaches the rank
        await server.stop(grace=1.0)
        if spans:
            ms = np.array(spans) * 1e3
            print(f"| control plane: result s in hand to descriptor s + {depth + 1} sent | "
                  f"median {np.median(ms):.3f} ms | p90 {np.percentile(ms, 90):.3f} ms | max {ms.max():.3f} ms | "
                  f"{len(ms)} steps |", flush=True)

    if profile:
        loop_profile.enable()
    asyncio.run(main())
    if profile:
        loop_profile.disable()
        for name, prof in (("gRPC event loop", loop_profile), ("engine thread", engine_profile)):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            print(f"== {name}: top functions by own time ==\n" + out.getvalue().split("\n\n", 2)[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-ms", type=float, default=0.0, help="time the fake data plane takes per step")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="cProfile the server's two threads")
    p.add_argument("--remote", action="store_true",
                   help="the data plane is a real rank process over ZeroMQ, its model runner emulating the step time")
    p.add_argument("--engine-process", action="store_true", help="the engine in its own process (needs --remote)")
    args = p.parse_args()
    if args.engine_process and not args.remote:
        p.error("--engine-process needs --remote")
    from tests.support.tiny_models import make_tokenizer

    with tempfile.TemporaryDirectory() as model_dir:
        make_tokenizer(Path(model_dir))  # what the GPU benchmark's random checkpoint uses
        (Path(model_dir) / "config.json").write_text(json.dumps(QWEN3_06B))
        ctx = mp.get_context("spawn")
        port_queue, stop_event = ctx.Queue(), ctx.Event()
        remote = f"ipc://{model_dir}/plane.sock" if args.remote else ""
        procs = [ctx.Process(target=serve, args=(model_dir, args.step_ms / 1000, args.profile, port_queue, stop_event,
                                                 remote, args.engine_process))]
        if remote:
            procs.append(ctx.Process(target=timed_rank, args=(remote, args.step_ms / 1000), daemon=True))
        for proc in procs:
            proc.start()
        try:
            address = f"127.0.0.1:{port_queue.get(timeout=60)}"
            asyncio.run(drive_streams(address, *warmup_workload(args.num_seqs), "Warm-up"))
            tokens, messages, elapsed = asyncio.run(drive_streams(address, *workload(args.num_seqs), "Streams"))
            ttft, itl = asyncio.run(one_stream(address))
        finally:
            stop_event.set()
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    plane = "a rank process over ZeroMQ" if remote else "in-process stand-in"
    print(f"| data plane step ({plane}) | output tokens | time (s) | tok/s | messages/s | tokens per message |")
    print(f"| {args.step_ms:g} ms | {tokens} | {elapsed:.2f} | {tokens / elapsed:,.0f} | {messages / elapsed:,.0f} | "
          f"{tokens / messages:.2f} |")
    print(f"| one stream alone (512-token prompt) | TTFT {ttft * 1e3:.1f} ms | inter-token {itl * 1e3:.2f} ms "
          f"(median, at the client) |")


if __name__ == "__main__":
    main()
