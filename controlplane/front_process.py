"""The engine-process front: the engine loop in a process of its own, so that it never waits for the
gRPC event loop's GIL. This module is the serving process's side; engine_process.py is the child's.

In one process the engine thread and the gRPC event loop take turns on one GIL. At 256 streams the
loop's per-message work stretches the engine's path from a step's result to the next descriptor,
and on a slower host that path can outgrow the GPU's step, leaving the GPU idle. So by default
(`NANOPLANE_ENGINE_PROCESS=0` turns it off) the scheduler, the block manager and the data plane's
ZeroMQ socket run in a child process (an `EngineLoop` whose deliveries go to a socket instead of an
event loop: `engine_process.py`); the serving process keeps the gRPC server, tokenizer and detokenizer.
Two ipc sockets join them, carrying proto/engine_link.py's typed messages (ZeroMQ sockets are not
thread-safe: each has one user thread a side, except the serving side's commands, sent under a lock):

- commands, front -> engine: add a request, abort one, readiness pushed from outside, stop;
- events, engine -> front: each step's outputs as one message, status snapshots, readiness with the
  engine's facts (for request checks and GetModelInfo).

KV-cache events (controlplane/kv_events.py) take the same two sockets: RecordKvEvents down, KvEvents
up; their numbering and replay buffer stay here, so that a new engine
process continues the numbers (its first batch starts with AllBlocksCleared).

`ProcessFront` is an `EngineFront`, so the server does not know which one it drives. If the
engine process dies, every open stream ends with UNAVAILABLE, health goes NOT_SERVING, and a new
engine process is started; if the serving process dies, the engine process notices and exits. A
process that is alive but silent (stopped, or stuck in a call that holds its GIL) would hold every
stream forever, so the engine process's main thread also sends a beat every BEAT_INTERVAL_S
(engine_process.py), and after ENGINE_SILENCE_S without any event the serving process kills it and
treats it as dead. (A stuck engine thread under a live main thread is not caught here; the data
plane's own heartbeats end its steps.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import zmq

from nanoplane.controlplane import runtime_dir
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.errors import SHUTTING_DOWN, DataPlaneUnavailable, failure_error
from nanoplane.controlplane.front import (
    EngineFacts,
    EngineStats,
    EngineStatus,
    Output,
    Stream,
    read_stream,
    wait_for_free_id,
)
from nanoplane.controlplane.kv_events import KvEventLog, KvEventsOff, buffer_size
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob
from nanoplane.liveness import Liveness
from nanoplane.process import terminate
from nanoplane.proto import engine_link as link
from nanoplane.proto.kv_events import KvEventBatch
from nanoplane.settings import read_tuning

log = logging.getLogger(__name__)

# A dead engine process is replaced after this long (a crash loop must not spin).
RESTART_INTERVAL_S = 1.0
# The serving process kills an engine process it has heard nothing from for this long (from its start,
# or its last event); a live one beats every engine_process.BEAT_INTERVAL_S.
ENGINE_SILENCE_S = 10.0


def engine_process_enabled() -> bool:
    """On unless NANOPLANE_ENGINE_PROCESS=0: in the serving process the engine thread waits on the event
    loop's GIL, and the service falls well short of the embedded engine."""
    return read_tuning().engine_process


class ProcessFront:
    """EngineFront over an engine process (see the module docstring)."""

    def __init__(self, config: EngineConfig, data_plane_address: str, eos_token_ids: tuple[int, ...],
                 recover_interval_s: float = 1.0, attach_timeout_s: float = 2.0, plane_keys: str = ""):
        self._dir = runtime_dir.make("engine-")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "hf_config"}
        self._launch = link.encode_launch(link.Launch(
            link.VERSION, fields, data_plane_address, f"ipc://{self._dir}/commands.sock",
            f"ipc://{self._dir}/events.sock", list(eos_token_ids), recover_interval_s, attach_timeout_s, plane_keys))
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # a burst of requests must not look like a dead engine
        self._commands.bind(f"ipc://{self._dir}/commands.sock")
        self._events = self._ctx.socket(zmq.PULL)
        self._events.bind(f"ipc://{self._dir}/events.sock")
        self._send_lock = threading.Lock()  # commands go out from the event loop and other threads
        self._keys = itertools.count()
        self._newest_key = -1  # the latest key handed out (read by the event-reading thread)
        self._streams: dict[str, Stream] = {}  # event loop only: request ids in use
        self._by_key: dict[int, Stream] = {}  # event loop only
        self._key_of: dict[Stream, int] = {}  # event loop only
        self._facts: EngineFacts | None = None
        self._ready = False
        self._unready_reason = "waiting for a data plane to attach"
        self._status = EngineStatus(0, 0, 0, 0, False)
        self._listeners: list[Callable[[bool], None]] = []
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: subprocess.Popen | None = None
        self._exited: int | None = None  # a pidfd of the engine process: readable once it has exited
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._liveness = Liveness()  # since the engine process's start or its latest event
        capacity = buffer_size(config)
        self._kv = KvEventLog(capacity, self._record_kv) if capacity else None  # event loop only
        self._kv_told: subprocess.Popen | None = None  # the engine process last told to record
        self._flushes: dict[int, asyncio.Future] = {}  # event loop only: Flush.token -> its caller's future

    # ---- EngineFront -----------------------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts | None:
        return self._facts

    @property
    def data_plane_ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        """Start the engine process and the thread that reads its events; call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._spawn()
        self._reader = threading.Thread(target=self._read_events, name="engine-events", daemon=True)
        self._reader.start()

    async def generate(self, token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                       timeout_s: float | None = None) -> AsyncIterator[Output]:
        if self._reader is None:
            raise RuntimeError("ProcessFront.start() was not called")
        request_id = request_id or uuid.uuid4().hex
        await wait_for_free_id(self._streams, request_id)
        facts = self._facts
        if not self._ready or facts is None:
            raise DataPlaneUnavailable(self.unavailable_message())
        token_ids = list(token_ids)
        facts.validate(token_ids, params)
        stream, key = Stream(request_id, token_ids, params), next(self._keys)
        self._newest_key = key
        self._streams[request_id], self._by_key[key], self._key_of[stream] = stream, stream, key
        finished = False
        try:
            # In the try: if the send fails (the engine process just died), the id and key are released.
            self._send(link.Add(key, token_ids, sampling_to_link(params), timeout_s))
            left = params.n  # the request is over once every sample has finished
            async for item in read_stream(stream):
                left -= item.finished
                finished = not left
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            self._by_key.pop(key, None)
            self._key_of.pop(stream, None)
            if not finished:
                with contextlib.suppress(DataPlaneUnavailable):  # no engine: nothing left to abort
                    self._send(link.Abort(key, False))

    def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatch]:
        if self._kv is None:
            raise KvEventsOff()
        return self._kv.subscribe(start_sequence_number)

    def abort(self, request_id: str) -> bool:
        """End a running request from the server side; its stream gets a final ABORT output."""
        stream = self._streams.get(request_id)
        key = self._key_of.get(stream) if stream is not None else None
        if key is None:
            return False
        self._send(link.Abort(key, True))
        return True

    async def flush_prefix_cache(self) -> bool:
        token = next(self._keys)
        done = self._flushes[token] = asyncio.get_running_loop().create_future()
        try:
            self._send(link.Flush(token))
            return await done
        except DataPlaneUnavailable:
            return False
        finally:
            del self._flushes[token]

    def stop_sample(self, request_id: str, index: int, stop: str) -> None:
        stream = self._streams.get(request_id)
        key = self._key_of.get(stream) if stream is not None else None
        if key is not None:
            with contextlib.suppress(DataPlaneUnavailable):  # no engine: the stream ends with UNAVAILABLE anyway
                self._send(link.StopSample(key, index, stop))

    def status(self) -> EngineStatus:
        """Counters as of the engine process's latest report."""
        return self._status

    def set_data_plane_ready(self, ready: bool, reason: str = "") -> None:
        self._send(link.SetReady(ready, reason))

    def add_ready_listener(self, callback: Callable[[bool], None]) -> None:
        """callback(ready) runs on the event-reading thread whenever readiness changes."""
        self._listeners.append(callback)

    def add_stats_listener(self, callback: Callable[[EngineStats], None]) -> None:
        """callback(stats) runs on the event-reading thread for each of the engine process's reports."""
        self._stats_listeners.append(callback)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its open streams end with UNAVAILABLE) and release the sockets."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(DataPlaneUnavailable):
                self._send(link.Stop())
            _wait(process, timeout)
            if process.poll() is None:
                process.kill()
                _wait(process, timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        # Whatever the engine process did not end (it was killed, or never started) ends here.
        self._call(self._fail_all, (DataPlaneUnavailable(SHUTTING_DOWN), None))
        self._commands.close(linger=0)
        self._events.close(linger=0)
        terminate(self._ctx, "engine-process")
        if self._exited is not None:
            os.close(self._exited)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- internals -------------------------------------------------------------------------------

    def unavailable_message(self) -> str:
        return f"the data plane is not available ({self._unready_reason or 'not started'}); retry later"

    def _spawn(self) -> None:
        site = ["-S"] if sys.flags.no_site else []  # an image's interpreter runs without this host's site-packages
        process = subprocess.Popen([sys.executable, *site, "-m", "nanoplane.controlplane.engine_process", self._launch])
        self._liveness.heard()
        if self._exited is not None:
            os.close(self._exited)
        self._exited = os.pidfd_open(process.pid)
        self._process = process

    def _send(self, command: link.Command) -> None:
        frame = link.encode(command)
        with self._send_lock:
            try:
                self._commands.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no engine process connected (it died, and the next is starting)
                raise DataPlaneUnavailable(self.unavailable_message()) from None
            except zmq.ZMQError:  # closed by shutdown: a stream ending late has nobody to tell
                raise DataPlaneUnavailable(SHUTTING_DOWN) from None

    def _read_events(self) -> None:
        poller = zmq.Poller()
        poller.register(self._events, zmq.POLLIN)
        self._liveness.judge()
        while True:
            process, exited = self._process, self._exited
            poller.register(exited, zmq.POLLIN)
            ready = dict(poller.poll(200))
            poller.unregister(exited)
            if stall := self._liveness.judge():  # the loop wakes at least every 0.2 s
                # This process did not run (SIGSTOP, swap, a frozen container): the engine process's
                # beats of that time may not have reached the socket yet, so that silence is ours.
                log.warning("this process did not run for %.1fs: the engine process's silence of that time "
                            "is not held against it", stall)
            if self._events in ready:
                self._liveness.heard()
                if self._kv is not None and self._kv_told is not process:  # a new engine process is up
                    self._kv_told = process
                    if self._kv.recording:
                        self._record_kv(True)
                try:
                    self._on_event(link.decode_event(self._events.recv()))
                except link.LinkError as exc:  # not our engine process's words: it cannot be trusted with streams
                    log.error("the engine process (pid %s) sent a malformed event (%s); killing it", process.pid, exc)
                    process.kill()
                    self._replace(process, f"the engine process sent a malformed event: {exc}")
            elif exited in ready and not self._stopping.is_set():
                self._replace(process)
            elif not self._stopping.is_set() and (silent := self._liveness.silent()) > ENGINE_SILENCE_S:
                log.error("the engine process (pid %s) sent nothing for %.1fs; killing it", process.pid, silent)
                process.kill()  # works on a stopped process too
                self._replace(process, f"the engine process sent nothing for {silent:.1f}s and was killed")
            elif self._stopping.is_set() and process.poll() is not None and not self._events.poll(0):
                return  # the engine process is gone and everything it sent is read

    def _on_event(self, event: link.Event) -> None:
        if isinstance(event, link.Outputs):
            self._call(self._dispatch, event.items)
        elif isinstance(event, link.Status):
            self._status = EngineStatus(event.running, event.waiting, event.kv_blocks_total, event.kv_blocks_used,
                                        event.data_plane_ready)
        elif isinstance(event, link.Stats):
            stats = EngineStats(event.prefix_cache_queries, event.prefix_cache_hits, event.preemptions,
                                event.descriptor_bytes, event.step_seconds, event.queue_seconds, event.epoch,
                                event.heartbeat_ages)
            for callback in self._stats_listeners:
                try:
                    callback(stats)
                except Exception:
                    log.exception("engine stats listener failed")
        elif isinstance(event, link.KvEvents):
            self._call(self._publish_kv, event)
        elif isinstance(event, link.Readiness):
            if event.ready and event.facts is not None:  # down: GetModelInfo keeps answering, as in-process
                f = event.facts
                self._facts = EngineFacts(f.architecture, f.tensor_parallel_size, f.max_model_len, f.vocab_size,
                                          f.block_size, f.kv_capacity_tokens)
            self._set_ready(event.ready, "" if event.ready else event.reason)
        elif isinstance(event, link.Flushed):
            self._call(self._settle_flush, event)
        # A Beat: its arrival is the point.

    def _replace(self, process: subprocess.Popen, reason: str | None = None) -> None:
        """The engine process died (or was killed): fail what it held, then start another (its data
        plane re-attaches)."""
        _wait(process, 1.0)  # it has exited: reap it, so that its exit code is known
        reason = reason or f"the engine process exited with code {process.returncode}"
        log.error("%s; starting a new one", reason)
        self._status = EngineStatus(0, 0, 0, 0, False)
        self._set_ready(False, reason)
        # Requests from now on are refused; those up to the newest key were the dead process's.
        self._call(self._fail_all, (DataPlaneUnavailable(self.unavailable_message()), self._newest_key + 1))
        if self._kv is not None:  # its cache went with it
            self._call(lambda _: self._kv.publish_cleared(), None)
        if not self._stopping.wait(RESTART_INTERVAL_S):
            self._spawn()

    def _set_ready(self, ready: bool, reason: str) -> None:
        changed = ready != self._ready
        self._ready, self._unready_reason = ready, reason
        if changed:
            for callback in self._listeners:
                try:
                    callback(ready)
                except Exception:
                    log.exception("data plane readiness listener failed")

    def _call(self, fn: Callable, arg) -> None:
        if self._loop is None:  # never started: no streams
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(fn, arg)

    def _dispatch(self, items: list[link.Delta | link.Failure]) -> None:
        for item in items:
            stream = self._by_key.get(item.key)
            if stream is None:
                continue  # the consumer is gone already
            if isinstance(item, link.Failure):
                stream.queue.put_nowait(failure_error(item.kind, item.message))
                continue
            reason = FinishReason(item.finish_reason) if item.finish_reason is not None else None
            out = Output(stream.request_id, item.token_ids, item.finished, reason, item.num_prompt_tokens,
                         item.num_completion_tokens, item.num_cached_tokens, item.index, None, None, item.stop_reason,
                         item.queue_seconds)
            if item.logprobs is not None:  # only requests that asked pay for the conversion
                out.logprobs = [Logprob(x.token_id, x.logprob, x.rank, x.top) for x in item.logprobs]
            if item.prompt_logprobs is not None:
                out.prompt_logprobs = [None if x is None else Logprob(x.token_id, x.logprob, x.rank, x.top)
                                       for x in item.prompt_logprobs]
            stream.queue.put_nowait(out)

    def _settle_flush(self, event: link.Flushed) -> None:
        done = self._flushes.get(event.token)
        if done is not None and not done.done():
            done.set_result(event.success)

    def _fail_all(self, error_and_limit: tuple[BaseException, int | None]) -> None:
        """End the streams with keys below the limit (None: all of them) with the error."""
        error, limit = error_and_limit
        for key in [k for k in self._by_key if limit is None or k < limit]:
            self._by_key.pop(key).queue.put_nowait(error)
        for done in self._flushes.values():  # a dead engine process answers no Flush
            if not done.done():
                done.set_result(False)

    def _record_kv(self, on: bool) -> None:
        """KvEventLog's wish to the engine process; one that is not up yet hears it at its first event."""
        with contextlib.suppress(DataPlaneUnavailable):
            self._send(link.RecordKvEvents(on))

    def _publish_kv(self, event: link.KvEvents) -> None:
        self._kv.publish(event.timestamp, event.events, event.snapshot)



def sampling_to_link(params: SamplingParams) -> link.Sampling:
    """The link's parameters from the engine's: the same fields by name (tests/unit/test_engine_link.py)."""
    return link.Sampling(**{name: getattr(params, name) for name in link.Sampling.__struct_fields__})


def _wait(process: subprocess.Popen, timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout)
