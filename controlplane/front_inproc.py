"""The in-process engine front: the engine loop on a thread of the serving process.

The event loop hands requests to the loop's inbox and gets results back as one
`call_soon_threadsafe` per step that fills every affected request's asyncio queue: one wake-up of the
event loop per step, not per request. Simpler than the engine process (front_process.py), but the
engine thread and the event loop take turns on one GIL; `NANOPLANE_ENGINE_PROCESS=0` chooses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.engine_loop import Delivery, EngineLoop
from nanoplane.controlplane.errors import DataPlaneUnavailable
from nanoplane.controlplane.front import (
    EngineFacts,
    EngineStats,
    EngineStatus,
    Output,
    Stream,
    read_stream,
    wait_for_free_id,
)
from nanoplane.controlplane.kv_events import KvEventLog, KvEventsOff
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto.kv_events import KvEvent, KvEventBatch


class InProcessFront:
    """EngineFront over an EngineLoop thread in this process."""

    def __init__(self, engine: Engine | None, recover: Callable[[Engine | None], Engine | None] | None = None,
                 recover_interval_s: float = 1.0, kv_events_buffer: int = 0):
        """`engine`, `recover`, `recover_interval_s`: see EngineLoop. `kv_events_buffer`: KV-event batches
        kept for replay (kv_events.buffer_size); 0: KV events off."""
        self.loop = EngineLoop(engine, self._hand_over, recover, recover_interval_s)
        self._kv: KvEventLog | None = None
        if kv_events_buffer > 0:
            self._kv = KvEventLog(kv_events_buffer, self.loop.record_kv_events)
            self.loop.set_kv_publisher(self._publish_kv)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, Stream] = {}  # event-loop thread only: ids in use

    @property
    def facts(self) -> EngineFacts | None:
        return self.loop.facts

    @property
    def data_plane_ready(self) -> bool:
        return self.loop.data_plane_ready

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        self.loop.start()

    async def generate(self, token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                       timeout_s: float | None = None) -> AsyncIterator[Output]:
        if not self.loop.started:
            raise RuntimeError("InProcessFront.start() was not called")
        if not self.loop.data_plane_ready:
            raise DataPlaneUnavailable(self.loop.unavailable_message())
        request_id = request_id or uuid.uuid4().hex
        await wait_for_free_id(self._streams, request_id)
        facts = self.loop.facts
        if not self.loop.data_plane_ready or facts is None:  # it may have gone down while we waited
            raise DataPlaneUnavailable(self.loop.unavailable_message())
        token_ids = list(token_ids)
        facts.validate(token_ids, params)
        stream = Stream(request_id, token_ids, params)
        if timeout_s is not None:
            stream.deadline = time.monotonic() + timeout_s
        self._streams[request_id] = stream
        self.loop.add_stream(stream)
        finished, left = False, params.n  # the request is over once every sample has finished
        try:
            async for item in read_stream(stream):
                left -= item.finished
                finished = not left
                yield item
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self.loop.abort_stream(stream, False)

    def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        self.loop.abort_stream(stream, True)
        return True

    async def flush_prefix_cache(self) -> bool:
        done = asyncio.get_running_loop().create_future()
        self.loop.flush_prefix_cache(lambda ok: self._event_loop.call_soon_threadsafe(_settle, done, ok))
        return await done

    def stop_sample(self, request_id: str, index: int, stop: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.loop.stop_sample(stream, index, stop)

    def status(self) -> EngineStatus:
        return self.loop.status()

    def add_ready_listener(self, callback: Callable[[bool], None]) -> None:
        self.loop.add_ready_listener(callback)

    def add_stats_listener(self, callback: Callable[[EngineStats], None]) -> None:
        self.loop.add_stats_listener(callback)

    def set_data_plane_ready(self, ready: bool, reason: str = "",
                             on_engine_thread: Callable[[Engine], None] | None = None) -> None:
        """See EngineLoop.set_data_plane_ready."""
        self.loop.set_data_plane_ready(ready, reason, on_engine_thread)

    def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatch]:
        if self._kv is None:
            raise KvEventsOff()
        return self._kv.subscribe(start_sequence_number)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.loop.shutdown(timeout)

    def _publish_kv(self, timestamp: float, events: list[KvEvent], snapshot: bool) -> None:
        """On the engine thread: the batch to the event loop's log."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed
            self._event_loop.call_soon_threadsafe(self._kv.publish, timestamp, events, snapshot)

    def _hand_over(self, batch: list[Delivery]) -> None:
        """On the engine thread: one wake-up of the event loop for the whole batch."""
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._event_loop.call_soon_threadsafe(_fill_queues, batch)


def _settle(future: asyncio.Future, result: object) -> None:
    if not future.done():  # its caller may have given up
        future.set_result(result)


def _fill_queues(batch: list[Delivery]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
