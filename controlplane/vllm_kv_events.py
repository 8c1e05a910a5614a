"""KV-cache events (proto/kv_events.py, from EngineFront.kv_events) as vllm.grpc.engine's SubscribeKvEvents
sends them: smg.grpc.common.KvEventBatch; block hashes are already the signed 64-bit integers it holds."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

from nanoplane.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

LOCAL = common_pb2.KV_CACHE_LOCALITY_LOCAL
DEVICE = common_pb2.KV_CACHE_TIER_DEVICE


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
