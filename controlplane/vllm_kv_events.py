"""KV-cache events (proto/kv_events.py, from EngineFront.kv_events) as vllm.grpc.engine's SubscribeKvEvents
sends them: smg.grpc.common.KvEventBatch (block hashes are already the signed 64-bit integers it holds),
each batch stamped with the engine's load record and load-only heartbeats between (`relay`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2

from nanoplane.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL
DEVICE = common_pb2.KV_CACHE_TIER_DEVICE
HEARTBEAT_S = 1.0  # a load-only batch after this long without a batch, as SMG's relay sends them


def event_to_proto(event: KvEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        size = event.block_size
        blocks = [common_pb2.KvBlock(block_hash=h, token_ids=event.token_ids[i * size:(i + 1) * size],
                                     block_size=size) for i, h in enumerate(event.block_hashes)]
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=DEVICE, medium="GPU", locality=LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=event.block_hashes, tier=DEVICE, medium="GPU", locality=LOCAL))
    if isinstance(event, AllBlocksCleared):
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    raise TypeError(f"not a KV-cache event: {event!r}")


def batch_to_proto(batch: KvEventBatch) -> common_pb2.KvEventBatch:
    return common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0,
        events=[event_to_proto(e, i) for i, e in enumerate(batch.events, 1)])


async def relay(batches: AsyncIterator[KvEventBatch], load: Callable[[], common_pb2.EngineLoad],
                records_before_first: bool) -> AsyncIterator[common_pb2.KvEventBatch]:
    """The subscription's messages: each event batch with the engine's load record on it, and a
    `load_only` batch (the last sequence repeated) after HEARTBEAT_S without one, as SMG's relay
    sends them; before the first event batch only if the subscriber asked (records numbered 0)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for batch in batches:
                await queue.put(batch)
        except Exception as exc:  # handed to the stream, which ends with its status
            await queue.put(exc)
        await queue.put(None)

    task = asyncio.ensure_future(pump())
    sample, last_sequence = itertools.count(1), None
    try:
        while True:
            try:
                batch = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
            except TimeoutError:
                if last_sequence is None and not records_before_first:
                    continue  # a heartbeat repeats a sequence: none was sent yet
                record = load()
                record.sample, record.load_only = next(sample), True
                yield common_pb2.KvEventBatch(sequence_number=last_sequence or 0, timestamp=time.time(), dp_rank=0,
                                              load=record)
                continue
            if batch is None:
                return
            if isinstance(batch, BaseException):
                raise batch
            proto = batch_to_proto(batch)
            record = load()
            record.sample = next(sample)
            proto.load.CopyFrom(record)
            last_sequence = batch.sequence_number
            yield proto
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
