"""What the engine loop tells its stats listeners (the metrics) about every STATS_INTERVAL_S: counter
increments since the previous report, step and queue times, the data plane's epoch and heartbeats."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.front import EngineStats

log = logging.getLogger(__name__)

# Stats listeners hear from an attached engine this often (idle too: the heartbeat ages move on).
STATS_INTERVAL_S = 0.5


class StatsReporter:
    """The engine loop's stats listeners and what it gathers for them; engine thread only, except
    `add_listener` before the loop starts."""

    def __init__(self):
        self.listeners: list[Callable[[EngineStats], None]] = []
        self._next = 0.0
        self._step_times: list[float] | None = None  # None while nobody listens
        self._counted: dict[str, tuple[object, int]] = {}  # counter -> (its owner, its value at the last report)

    def add_listener(self, callback: Callable[[EngineStats], None], engine: Engine | None) -> None:
        self.listeners.append(callback)
        self._step_times = []
        self.collect_queue_times(engine)

    def collect_queue_times(self, engine: Engine | None) -> None:
        """Have the engine's scheduler keep queue times from now on (it keeps none while nobody drains them)."""
        if self.listeners and engine is not None and engine.scheduler.queue_times is None:
            engine.scheduler.queue_times = []

    def wait_s(self) -> float | None:
        """Seconds until the next report is due; None when nobody listens."""
        if not self.listeners:
            return None
        return max(0.0, self._next - time.monotonic())

    def record_step(self, seconds: float) -> None:
        """One engine step that applied a result took `seconds`."""
        if self._step_times is not None:
            self._step_times.append(seconds)

    def _increase(self, name: str, owner: object, value: int) -> int:
        """How much a counter of `owner` grew since the last report; a new owner (a new engine) starts at 0."""
        last_owner, last = self._counted.get(name, (None, 0))
        self._counted[name] = (owner, value)
        return value - last if last_owner is owner else value

    def report(self, engine: Engine | None) -> None:
        self._next = time.monotonic() + STATS_INTERVAL_S
        if engine is None:
            return
        try:  # the metrics must never cost a stream: a failure here is logged, not survived as a lost plane
            s, plane = engine.scheduler, engine.data_plane
            queue_times, s.queue_times = s.queue_times or [], []
            step_times, self._step_times = self._step_times, []
            ages = getattr(plane, "heartbeat_ages", None)
            stats = EngineStats(
                self._increase("queries", s, s.num_prefix_queries), self._increase("hits", s, s.num_prefix_hits),
                self._increase("preemptions", s, s.num_preemptions),
                self._increase("bytes", plane, getattr(plane, "descriptor_bytes", 0)),
                step_times, queue_times, engine.epoch, ages() if ages is not None else [])
        except Exception:
            log.exception("gathering the engine's stats failed")
            return
        for callback in self.listeners:
            try:
                callback(stats)
            except Exception:
                log.exception("engine stats listener failed")
