"""KV-cache events from the engine to their subscribers (SubscribeKvEvents of vllm.grpc.engine.VllmEngine).

The API a servicer calls, on both engine fronts (controlplane/front.py:EngineFront):

    front.kv_events(start_sequence_number: int = 0) -> AsyncIterator[proto.kv_events.KvEventBatch]
        Batches numbered 1, 2, 3, ... (one per engine step that changed the prefix cache). With 0, or
        with a number the replay buffer no longer holds (older than its oldest batch, or newer than
        the next), the first batch yielded is a snapshot: it starts with AllBlocksCleared and then
        stores every cached block, parents first; batches follow it without a gap. A number the buffer
        holds replays from that batch on. A subscriber that falls more than the buffer behind gets a
        fresh snapshot the same way. Raises KvEventsOff (before the first batch) when the service runs
        with --kv-events off. Closing the iterator ends the subscription.
    await front.flush_prefix_cache() -> bool
        Drops every cached-but-free block (blocks running requests hold stay cached); subscribers get
        AllBlocksCleared, then BlockStored for each block that stayed. False while the plane is down.

Cost: the block manager records nothing while nobody subscribes (BlockManager.kv_events is None).
The first subscriber turns recording on in the engine, which answers with a snapshot; the last one
leaving turns it off. Numbering and the replay buffer (--kv-events-buffer batches) live in the
serving process (KvEventLog), so that a new engine process or data plane continues the numbers: its
first batch starts with AllBlocksCleared.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from nanoplane.controlplane.block_manager import CLEARED, NO_HASH, STORED, BlockManager
from nanoplane.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, signed64


class KvEventsOff(RuntimeError):
    """The service runs with --kv-events off."""

    def __init__(self) -> None:
        super().__init__("KV cache events are off on this server; start it with --kv-events on "
                         "(NANOPLANE_KV_EVENTS=on)")


def buffer_size(config) -> int:
    """Batches an EngineConfig's replay buffer holds; 0 when KV events are off."""
    return config.kv_events_buffer if config.kv_events == "on" else 0


def to_events(records: list[tuple], block_size: int) -> list[KvEvent]:
    """BlockManager.kv_events records as the protocol's events; consecutive removals in one event."""
    events: list[KvEvent] = []
    for record in records:
        kind = record[0]
        if kind is STORED:
            _, parent, hashes, token_lists = record
            events.append(BlockStored([signed64(h) for h in hashes], None if parent == NO_HASH else signed64(parent),
                                      [t for tokens in token_lists for t in tokens], block_size))
        elif kind is CLEARED:
            events.append(AllBlocksCleared())
        elif events and type(events[-1]) is BlockRemoved:
            events[-1].block_hashes.append(signed64(record[1]))
        else:
            events.append(BlockRemoved([signed64(record[1])]))
    return events


Publish = Callable[[float, list[KvEvent], bool], None]  # (timestamp, events, whether a snapshot)


class KvEventTap:
    """Engine thread only: the attached engine's block-manager records, published once per loop iteration."""

    def __init__(self, publish: Publish):
        self._publish = publish
        self._manager: BlockManager | None = None
        self.recording = False

    def follow(self, manager: BlockManager | None) -> None:
        """The engine's block manager after an attach; a new one starts empty: subscribers hear all cleared."""
        if manager is self._manager:
            return
        if self._manager is not None:
            self._manager.kv_events = None
        self._manager = manager
        if self.recording and manager is not None:
            manager.kv_events = [(CLEARED,)]

    def record(self, on: bool) -> None:
        """Start recording with a snapshot of the cache (a fresh one if on already), or stop."""
        self.recording = on
        manager = self._manager
        if manager is None:  # no engine yet: nothing is cached
            if on:
                self._publish(time.time(), [AllBlocksCleared()], True)
            return
        self.drain()
        if on:
            manager.kv_events = manager.cached_records()
            self.drain(snapshot=True)
        else:
            manager.kv_events = None

    def drain(self, snapshot: bool = False) -> None:
        """Publish what the block manager recorded since the last drain, if anything."""
        manager = self._manager
        if manager is None or not manager.kv_events:
            return
        records, manager.kv_events = manager.kv_events, []
        self._publish(time.time(), to_events(records, manager.block_size), snapshot)


class KvEventLog:
    """Event-loop side: numbers the engine's batches, keeps the newest `capacity` for replay, and feeds
    the subscribers; `record(on)` asks the engine to (re)start recording with a snapshot, or to stop."""

    def __init__(self, capacity: int, record: Callable[[bool], None]):
        self._batches: deque[KvEventBatch] = deque(maxlen=capacity)
        self._next = 1  # the next batch's number
        self._record = record
        self._subscribers: list[asyncio.Event] = []
        self._snapshots: list[int] = []  # numbers of the snapshot batches the buffer holds

    @property
    def recording(self) -> bool:
        """Whether the engine should be recording: someone subscribes."""
        return bool(self._subscribers)

    @property
    def next_sequence_number(self) -> int:
        return self._next

    def publish(self, timestamp: float, events: list[KvEvent], snapshot: bool = False) -> None:
        """A batch from the engine (event-loop thread)."""
        if self._batches and len(self._batches) == self._batches.maxlen:
            dropped = self._batches[0].sequence_number
            if self._snapshots and self._snapshots[0] == dropped:
                self._snapshots.pop(0)
        self._batches.append(KvEventBatch(self._next, timestamp, events))
        if snapshot:
            self._snapshots.append(self._next)
        self._next += 1
        for wake in self._subscribers:
            wake.set()

    def publish_cleared(self) -> None:
        """The engine process is gone and its cache with it."""
        if self._subscribers:
            self.publish(time.time(), [AllBlocksCleared()])

    def _oldest(self) -> int:
        return self._batches[0].sequence_number if self._batches else self._next

    async def subscribe(self, start: int = 0) -> AsyncIterator[KvEventBatch]:
        """See the module docstring."""
        wake = asyncio.Event()
        self._subscribers.append(wake)
        try:
            first = len(self._subscribers) == 1
            if first:
                self._record(True)  # its snapshot follows whatever the buffer replays
            cursor, after = start, None  # after: skip to the first snapshot numbered at least this
            if not self._oldest() <= start <= self._next or start < 1:
                cursor, after = self._next, self._next
                if not first:
                    self._record(True)
            while True:
                if cursor >= self._next:
                    wake.clear()
                    await wake.wait()
                    continue
                if cursor < self._oldest():  # fell behind by more than the buffer: resynchronise
                    cursor, after = self._next, self._next
                    self._record(True)
                    continue
                batch = self._batches[cursor - self._oldest()]
                cursor += 1
                if after is not None:  # waiting for a snapshot
                    if batch.sequence_number < after or batch.sequence_number not in self._snapshots:
                        continue
                    after = None
                yield batch
        finally:
            self._subscribers.remove(wake)
            if not self._subscribers:
                self._record(False)
