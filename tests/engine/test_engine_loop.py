"""When a step's tokens reach the streams: after the next step has been sent to the data plane.

The engine thread waking the event loop competes with it for the GIL; done between a step's result
and the next descriptor, that wait leaves the GPU idle (BENCHMARKS.md, the control plane's
turnaround). So `Engine.step` offers an `on_queued` hook between its send and its wait, and the
engine loop hands a step's tokens over there, one call later."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from nanoplane.controlplane import engine_stats
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.engine_loop import EngineLoop
from nanoplane.controlplane.front import EngineStats
from nanoplane.controlplane.front_inproc import InProcessFront
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult

EOS = 0


class CountingDataPlane:
    """Keeps one step in flight like a rank; every row of step s samples s + 1 (never EOS)."""

    def __init__(self):
        self.events: list[tuple] = []
        self.submitted = 0  # read by the event-loop thread; only ever grows
        self.lock = threading.Lock()
        self.queue: list[StepResult] = []

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, 256, 16, 8, 512, 1000, "Fake", "cpu", "float32")]

    def submit(self, desc: StepDescriptor) -> None:
        with self.lock:
            self.events.append(("submit", desc.step_id))
            self.submitted += 1
        self.queue.append(StepResult(desc.step_id, np.full(desc.num_rows, desc.step_id + 1, dtype=np.int32)))

    def collect(self, step_id: int) -> StepResult:
        self.events.append(("collect", step_id))
        result = self.queue.pop(0)
        assert result.step_id == step_id
        return result

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.submit(desc)
        return self.collect(desc.step_id)

    def close(self) -> None:
        pass


@pytest.fixture
def engine_and_plane(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    plane = CountingDataPlane()
    cfg = EngineConfig(str(tmp_path), device="cpu", kvcache_block_size=16, max_num_seqs=8)
    return Engine(cfg, plane, (EOS,)), plane


def test_on_queued_runs_between_the_send_and_the_wait(engine_and_plane):
    engine, plane = engine_and_plane
    for i in range(3):
        engine.add_request([5 + i] * (10 + i), SamplingParams(max_tokens=6 + i, ignore_eos=True))
    calls = 0
    while engine.has_work():
        start = len(plane.events)
        engine.step(on_queued=lambda: plane.events.append(("queued",)))
        call = [e[0] for e in plane.events[start:]]
        assert call.count("queued") == 1, call
        queued = call.index("queued")
        assert "collect" not in call[:queued] and "submit" not in call[queued:], call
        calls += 1
        assert calls < 100
    assert calls > 8  # prefill, the decode steps, and the last result's collection


def test_a_steps_tokens_reach_the_stream_after_the_next_step_is_sent(engine_and_plane):
    engine, plane = engine_and_plane
    handed: list[tuple[int, int]] = []  # (token, steps submitted when the engine thread handed it over)

    class Loop:
        """The event loop, seen by the engine thread: records what each hand-over carries, and when."""

        def __init__(self, loop):
            self.loop = loop

        def call_soon_threadsafe(self, fn, deliveries):
            with plane.lock:
                handed.extend((t, plane.submitted) for _, out in deliveries for t in out.token_ids)
            return self.loop.call_soon_threadsafe(fn, deliveries)

    async def main() -> list[int]:
        front = InProcessFront(engine)
        front.start()
        front._event_loop = Loop(front._event_loop)
        tokens = []
        try:
            async for out in front.generate([7] * 20, SamplingParams(max_tokens=12, ignore_eos=True)):
                tokens += out.token_ids
        finally:
            front.shutdown()
        return tokens

    tokens = asyncio.run(main())
    steps = plane.submitted
    assert len(tokens) == 12 and steps == 12  # one prefill step, eleven decode steps
    assert [t for t, _ in handed] == tokens == list(range(1, 13))
    # Token t came from step t - 1, collected while step t ran; it was handed over only once step
    # t + 1 had been sent too (steps 0..t + 1: t + 2 of them), where there is such a step.
    for token, submitted in handed:
        assert submitted >= min(token + 2, steps), (token, submitted)


def test_ready_again_is_logged_on_a_reattach_only(engine_and_plane, caplog):
    engine, _ = engine_and_plane
    attached = threading.Event()
    loop = EngineLoop(None, lambda batch: None, recover=lambda old: engine, recover_interval_s=0.01)
    loop.add_ready_listener(lambda ready: attached.set() if ready else None)
    caplog.set_level("INFO", logger="nanoplane.controlplane.engine_loop")
    loop.start()
    try:
        assert attached.wait(10)
        attached.clear()
        loop.set_data_plane_ready(False, "a rank missed its heartbeats")
        assert attached.wait(10)  # recovered by the same recover hook
    finally:
        loop.shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the data plane is ready")]
    assert [m.split(":")[0] for m in ready] == ["the data plane is ready", "the data plane is ready again"]


def test_stats_add_up_and_keep_coming_while_idle(engine_and_plane, monkeypatch):
    monkeypatch.setattr(engine_stats, "STATS_INTERVAL_S", 0.05)
    engine, _ = engine_and_plane
    reports: list[EngineStats] = []

    async def main() -> None:
        front = InProcessFront(engine)
        front.add_stats_listener(reports.append)
        front.start()
        try:
            for _ in range(2):  # the second finds the first's two full blocks cached
                async for _ in front.generate([7] * 40, SamplingParams(max_tokens=3, ignore_eos=True)):
                    pass
            await asyncio.sleep(0.1)
            busy = len(reports)
            await asyncio.sleep(0.5)
            assert len(reports) >= busy + 3  # idle, the reports go on
        finally:
            front.shutdown()

    asyncio.run(main())
    assert sum(r.prefix_cache_queries for r in reports) == 80
    assert sum(r.prefix_cache_hits for r in reports) == 32
    assert len([t for r in reports for t in r.queue_seconds]) == 2
    assert len([t for r in reports for t in r.step_seconds]) >= 4  # two prefills, two decode steps at least
    assert all(r.epoch == 0 and r.preemptions == 0 and r.heartbeat_ages == [] for r in reports)


def test_a_new_engine_counts_from_zero_not_from_the_old_ones_total(engine_and_plane):
    engine, plane = engine_and_plane
    loop = EngineLoop(engine, lambda batch: None)
    reports: list[EngineStats] = []
    loop.add_stats_listener(reports.append)
    engine.scheduler.num_prefix_queries = 100
    loop._stats.report(loop.engine)
    loop.engine = Engine(engine.config, plane, (EOS,))  # a re-attach: its scheduler starts at 0
    loop.engine.scheduler.num_prefix_queries = 30
    loop._stats.report(loop.engine)
    assert [r.prefix_cache_queries for r in reports] == [100, 30]
