"""The engine loop: the one thread that drives `Engine.step` and hands each step's outputs on.

The Engine is not thread-safe, so exactly one thread ("engine-loop") touches it. Other threads talk
to it through an inbox of commands (add, abort, readiness changes) that the loop drains before every
step; it hands results to `deliver` once per step, as (stream, Output or exception) pairs. Both
engine fronts run this loop: in the serving process, `deliver` wakes the event loop that fills the
streams' queues (front_inproc.py); in the engine process, it sends the batch over the link
(engine_process.py). With nothing to do the thread sleeps on a condition variable.

A step that raises means the data plane is gone: every open stream ends with DataPlaneUnavailable,
their requests are dropped (blocks freed), and new requests are refused until the plane is back.
Two ways back, for two kinds of transport: a `recover(engine)` callable given at construction,
which the engine thread calls every `recover_interval_s` while the plane is down (pull: wait for a
restarted data plane and return an engine attached to it), or `set_data_plane_ready(True)` from any
thread (push). `set_data_plane_ready(False)` reports a failure noticed while idle (a missed
heartbeat).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.engine_stats import StatsReporter
from nanoplane.controlplane.errors import SHUTTING_DOWN, DataPlaneUnavailable, DeadlineExceeded
from nanoplane.controlplane.front import EngineFacts, EngineStats, EngineStatus, Output, Stream
from nanoplane.controlplane.kv_events import KvEventTap, Publish
from nanoplane.controlplane.scheduler import QueueFull
from nanoplane.controlplane.sequence import FinishReason
from nanoplane.controlplane.sequence import Sequence as EngineSequence

log = logging.getLogger(__name__)

# When a step schedules nothing although requests are queued (they wait for blocks), sleep this
# long before trying again instead of spinning; new commands still wake the loop at once.
IDLE_RETRY_S = 0.005

Delivery = tuple[Stream, Output | BaseException]


def _unfinished(seq: EngineSequence) -> list[EngineSequence]:
    """The samples of seq's request (seq.group) that have not finished."""
    return [s for s in seq.group if not s.is_finished]


class EngineLoop:
    def __init__(self, engine: Engine | None, deliver: Callable[[list[Delivery]], None],
                 recover: Callable[[Engine | None], Engine | None] | None = None, recover_interval_s: float = 1.0,
                 on_status: Callable[[EngineStatus], None] | None = None):
        """`deliver(batch)`, called on the engine thread, takes each batch of (stream, Output or
        exception) for the streams; `on_status(status)`, likewise, every changed status snapshot.

        `recover(engine)` runs on the engine thread while the data plane is down. It returns the
        engine to go on with, attached to a working plane: the same one re-synced, or a new Engine
        over the restarted plane (today's way: a new Engine starts at step 0 of the new epoch with
        an empty prefix cache). None or an exception: still down, try again later. It may block:
        meanwhile new requests are refused without waiting for it. The old engine is dropped, not
        closed, because it shares its data-plane client with the new one.

        `engine` None: no data plane yet; the server answers (health NOT_SERVING) while `recover(None)`
        attaches the first one."""
        self.engine = engine
        self._recover = recover
        self._recover_interval_s = recover_interval_s
        self._next_recover = 0.0
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._ready = engine is not None
        self._attached = engine is not None  # whether an engine has ever been ready: the next is a re-attach
        self._unready_reason = "" if engine is not None else "waiting for a data plane to attach"
        self.facts = EngineFacts.of(engine) if engine is not None else None  # kept while the plane is down
        self._listeners: list[Callable[[bool], None]] = []
        self._seq_of: dict[Stream, EngineSequence] = {}  # engine thread only: its request's sample 0
        self._stream_of: dict[int, Stream] = {}  # engine thread only: sample 0's seq_id -> stream
        self._thread: threading.Thread | None = None
        self._deliver, self._on_status = deliver, on_status
        self._status = self._snapshot()
        self._stats = StatsReporter()
        self._compiling: set[Stream] = set()  # structured requests whose grammar compiles; their add comes after
        self._aborted_compiling: set[Stream] = set()  # engine thread only: of those, aborted before their add
        self._kv: KvEventTap | None = None  # KV-cache events, once a publisher is set

    def set_kv_publisher(self, publish: Publish) -> None:
        """publish(timestamp, events, snapshot) runs on the engine thread for each loop iteration's
        KV-cache events while recording (record_kv_events); set it before `start`."""
        self._kv = KvEventTap(publish)

    def record_kv_events(self, on: bool) -> None:
        """Start recording KV-cache events with a snapshot of the cache (a fresh one if on), or stop."""
        self._post(("kv", on))

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def data_plane_ready(self) -> bool:
        return self._ready

    def status(self) -> EngineStatus:
        """Counters as of the engine thread's latest iteration."""
        return self._status

    def add_stream(self, stream: Stream) -> None:
        """Queue a request already checked by its consumer; its outputs go to `deliver`. A grammar
        compiles on the compiler's pool first, so the engine thread never waits for one."""
        structured, engine = stream.params.structured, self.engine
        if structured is None or engine is None:
            self._post(("add", stream))
            return
        self._compiling.add(stream)
        engine.grammars.submit(structured).add_done_callback(lambda f: self._post(("add", stream, f)))

    def abort_stream(self, stream: Stream, notify: bool) -> None:
        """Drop the stream's request; `notify`: deliver it a final ABORT output."""
        self._post(("abort", stream, notify))

    def flush_prefix_cache(self, done: Callable[[bool], None]) -> None:
        """Drop the prefix cache between steps; done(whether it was dropped) runs on the engine thread."""
        self._post(("flush", done))

    def stop_sample(self, stream: Stream, index: int, stop: str) -> None:
        """A stop string ended sample `index` of the stream's request on its consumer's side: end it
        (STOP, blocks freed at once) while the other samples go on."""
        self._post(("stop", stream, index, stop))

    def fail_stream(self, stream: Stream, error: Exception) -> None:
        """End a stream that never became a request (its consumer's request was refused) with `error`."""
        self._post(("fail", stream, error))

    # ---- any thread ------------------------------------------------------------------------------

    def set_data_plane_ready(self, ready: bool, reason: str = "",
                             on_engine_thread: Callable[[Engine], None] | None = None) -> None:
        """Mark the data plane up or down; thread-safe (the transport calls it from its own threads).

        Going down fails every open stream with `reason`. `on_engine_thread(engine)` runs on the
        engine thread before the change, between steps: the place to re-sync the engine with a
        restarted data plane. If it raises, the plane stays down.
        """
        self._post(("ready", ready, reason, on_engine_thread))

    def add_ready_listener(self, callback: Callable[[bool], None]) -> None:
        """callback(ready) runs on the engine thread whenever readiness changes."""
        self._listeners.append(callback)

    def add_stats_listener(self, callback: Callable[[EngineStats], None]) -> None:
        """callback(stats) runs on the engine thread every engine_stats.STATS_INTERVAL_S while an engine is attached;
        add it before `start`."""
        self._stats.add_listener(callback, self.engine)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (open streams end with DataPlaneUnavailable) and close the engine."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.close()

    # ---- engine thread ---------------------------------------------------------------------------

    def _post(self, command: tuple) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    @property
    def unready_reason(self) -> str:
        return self._unready_reason or "not started"

    def unavailable_message(self) -> str:
        return f"the data plane is not available ({self.unready_reason}); retry later"

    def _wait_s(self) -> float | None:
        waits = [w for w in (self._recover_wait_s(), self._stats.wait_s()) if w is not None]
        return min(waits, default=None)

    def _recover_wait_s(self) -> float | None:
        """Seconds until the next recovery attempt is due; None when none is to be made."""
        if self._ready or self._recover is None:
            return None
        return max(0.0, self._next_recover - time.monotonic())

    def _run(self) -> None:
        idle_retry = False
        # For the streams, kept across iterations: a step's tokens wait there until the next step is sent.
        deliveries: list[tuple[Stream, Output | BaseException]] = []
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or (self._ready and self.engine.has_work())
                           or self._wait_s() == 0.0):
                    self._cond.wait(self._wait_s())
                if idle_retry and not self._inbox and not self._stopping:
                    self._cond.wait(IDLE_RETRY_S)
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            idle_retry = False
            try:
                for command in commands:
                    self._apply(command, deliveries)
                if stopping:
                    self._drop_all(SHUTTING_DOWN, deliveries)
                if not stopping and self._recover_wait_s() == 0.0:
                    self._try_recover()
                if not stopping and self._ready and self.engine.has_work():
                    idle_retry = not self._step(deliveries)
                if self._kv is not None:  # one batch of KV-cache events per iteration
                    self._kv.drain()
                status, self._status = self._status, self._snapshot()
                if self._on_status is not None and status != self._status:
                    self._on_status(self._status)
                if self._stats.wait_s() == 0.0:
                    self._stats.report(self.engine)
                # A step's tokens wait until the next step has been sent (engine.step's on_queued): waking
                # the event loop makes this thread wait for the GIL, which between a result and the next
                # descriptor leaves the GPU idle. Sent now if no next step is coming.
                if deliveries and (stopping or idle_retry or not self._ready or not self.engine.has_work()):
                    self._hand_over(deliveries)
            except Exception as exc:  # a bug: this thread must not die with streams waiting on it
                self._survive(exc, deliveries)
            if stopping:
                return

    def _survive(self, exc: Exception, deliveries: list) -> None:
        """After an unexpected error in the loop: end every open stream with DataPlaneUnavailable and
        treat the data plane as lost, so that the next attach starts from a fresh Engine."""
        log.exception("the engine loop failed; ending its streams and re-attaching the data plane")
        reason = f"the engine failed: {type(exc).__name__}: {exc}"
        try:
            self._set_unready(reason, deliveries)
        except Exception:  # the engine cannot even abort its requests: end the streams regardless
            log.exception("dropping the requests failed too")
            deliveries.extend((stream, DataPlaneUnavailable(reason)) for stream in self._seq_of)
            self._seq_of.clear()
            self._stream_of.clear()
        try:
            self._hand_over(deliveries)
        except Exception:
            log.exception("the streams could not be told")
            deliveries.clear()

    def _step(self, deliveries: list) -> bool:
        """One engine step; returns whether it made progress (ran rows or has steps in flight)."""
        started = time.perf_counter()
        try:
            out = self.engine.step(on_queued=lambda: self._hand_over(deliveries))
        except Exception as exc:
            if isinstance(exc, DataPlaneUnavailable):  # a rank died or went silent: its message says it all
                log.warning("engine step failed, the data plane is unavailable: %s", exc)
                reason = str(exc)
            else:  # a bug: keep the traceback
                log.exception("engine step failed; marking the data plane unavailable")
                reason = f"data plane failed: {type(exc).__name__}: {exc}"
            self._set_unready(reason, deliveries)
            return True
        if out.rows:
            self._stats.record_step(time.perf_counter() - started)
        for seq in self.engine.take_expired():
            stream = self._stream_of.pop(seq.group[0].seq_id, None)
            if stream is not None:
                del self._seq_of[stream]
                waited = time.monotonic() - seq.queued_since
                deliveries.append((stream, DeadlineExceeded(
                    f"the request's deadline passed after {waited:.2f}s in the server's queue, before it "
                    "started; nothing was computed for it")))
        ended: list[EngineSequence] = []  # requests of n > 1 a sample of which finished in this step
        for seq, token in out.produced:
            first = seq.group[0]  # a request's samples all map to its stream through sample 0
            stream = self._stream_of.get(first.seq_id)
            if stream is None:
                continue
            deliveries.append((stream, Output.of(stream.request_id, seq, [token])))
            if seq.is_finished:
                if len(first.group) == 1:
                    del self._stream_of[first.seq_id], self._seq_of[stream]
                else:  # after the loop: samples finishing in this step come later in `produced`
                    ended.append(first)
        for first in ended:
            if not _unfinished(first) and (stream := self._stream_of.pop(first.seq_id, None)) is not None:
                del self._seq_of[stream]
        # With steps in flight the first steps of a burst return no rows yet: that is progress too.
        return bool(out.rows) or bool(self.engine.inflight)

    def _try_recover(self) -> None:
        self._next_recover = time.monotonic() + self._recover_interval_s
        try:
            engine = self._recover(self.engine)
        except Exception as exc:
            log.info("data plane still unavailable: %s", exc)
            return
        if engine is not None:
            self.engine = engine
            self._set_ready()

    def _apply(self, command: tuple, deliveries: list) -> None:
        kind = command[0]
        if kind == "add":
            stream = command[1]
            self._compiling.discard(stream)
            if stream in self._aborted_compiling:
                self._aborted_compiling.remove(stream)
                return
            if not self._ready:
                deliveries.append((stream, DataPlaneUnavailable(self.unavailable_message())))
                return
            try:
                grammar = command[2].result() if len(command) > 2 else None
                seq = self.engine.add_request(stream.token_ids, stream.params, deadline=stream.deadline,
                                              grammar=grammar)
            except (ValueError, QueueFull) as exc:
                deliveries.append((stream, exc))
                return
            self._seq_of[stream] = seq
            self._stream_of[seq.seq_id] = stream
        elif kind == "abort":
            _, stream, notify = command
            seq = self._seq_of.pop(stream, None)
            if seq is None:
                if stream in self._compiling:  # its add is yet to come: drop it then
                    self._aborted_compiling.add(stream)
                    if notify:  # each sample's final output: the stream ends once all n have one
                        deliveries.extend((stream, Output(stream.request_id, [], True, FinishReason.ABORT,
                                                          len(stream.token_ids), index=i))
                                          for i in range(stream.params.n))
                return
            del self._stream_of[seq.seq_id]
            unfinished = _unfinished(seq)
            self.engine.abort(seq.seq_id)  # every sample of it
            if notify:  # a final ABORT output for each sample still running
                deliveries.extend((stream, Output.of(stream.request_id, s, [])) for s in unfinished)
        elif kind == "stop":
            _, stream, index, stop = command
            seq = self._seq_of.get(stream)
            if seq is None or not 0 <= index < len(seq.group) or seq.group[index].is_finished:
                return
            self.engine.stop_on_string(seq.group[index], stop)
            deliveries.append((stream, Output.of(stream.request_id, seq.group[index], [])))  # read_stream counts it
            if not _unfinished(seq):
                del self._stream_of[seq.seq_id], self._seq_of[stream]
        elif kind == "fail":
            deliveries.append((command[1], command[2]))
        elif kind == "kv":
            self._kv.follow(self.engine.scheduler.block_manager if self.engine is not None else None)
            self._kv.record(command[1])
        elif kind == "flush":  # refused while the plane is down: a new engine's cache starts empty anyway
            if self._ready:
                self.engine.scheduler.block_manager.flush()
            command[1](self._ready)
        elif kind == "ready":
            _, ready, reason, hook = command
            if hook is not None:
                try:
                    hook(self.engine)
                except Exception as exc:
                    log.exception("data plane re-sync hook failed")
                    ready, reason = False, f"re-syncing with the data plane failed: {exc}"
            if not ready:
                self._set_unready(reason or "the data plane went away", deliveries)
            elif not self._ready:
                self._set_ready()

    def _drop_all(self, reason: str, deliveries: list) -> None:
        for stream, seq in self._seq_of.items():
            self.engine.abort(seq.seq_id)
            deliveries.append((stream, DataPlaneUnavailable(reason)))
        self._seq_of.clear()
        self._stream_of.clear()

    def _set_unready(self, reason: str, deliveries: list) -> None:
        was_ready = self._ready
        self._ready, self._unready_reason = False, reason
        self._next_recover = time.monotonic() + self._recover_interval_s
        self._drop_all(self.unavailable_message(), deliveries)
        if was_ready:
            self._notify(False)

    def _set_ready(self) -> None:
        engine = self.engine
        log.info("the data plane is ready%s: %d rank(s) on %s, %d step(s) in flight",
                 " again" if self._attached else "", len(engine.infos), engine.infos[0].device, engine.steps_in_flight)
        self.facts = EngineFacts.of(engine)
        self._stats.collect_queue_times(engine)
        if self._kv is not None:
            self._kv.follow(engine.scheduler.block_manager)
        self._ready, self._unready_reason, self._attached = True, "", True
        self._notify(True)

    def _notify(self, ready: bool) -> None:
        for callback in self._listeners:
            try:
                callback(ready)
            except Exception:
                log.exception("data plane readiness listener failed")

    def _snapshot(self) -> EngineStatus:
        if self.engine is None:
            return EngineStatus(0, 0, 0, 0, False)
        running, waiting, used, total = self.engine.stats()
        return EngineStatus(running, waiting, total, used, self._ready)

    def _hand_over(self, deliveries: list) -> None:
        """Pass `deliveries` on and empty the list (the same list object goes on)."""
        if not deliveries:
            return
        batch = deliveries[:]
        deliveries.clear()
        self._deliver(batch)
