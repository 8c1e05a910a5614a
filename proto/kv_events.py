"""KV-cache events: what the engine's prefix cache gained and lost, in vLLM's shape.

vLLM's `vllm/distributed/kv_events.py` (BlockStored, BlockRemoved, AllBlocksCleared in numbered
batches) field for field, so that a servicer of `vllm.grpc.engine.VllmEngine` fills SubscribeKvEvents'
`KvEventBatch` from them one to one. A block's hash is the prefix cache's chained xxhash64 of its
tokens and its parent's hash (controlplane/block_manager.py:chain_hash) as a signed 64-bit integer,
the protocol's `int64 block_hash`. The engine link carries these structs too (proto/engine_link.py).

This module imports msgspec only: it is the schema.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Full blocks that joined the prefix cache: a chain, each block the parent of the next."""

    block_hashes: list[int]  # signed 64-bit chain hashes, in chain order
    parent_block_hash: int | None  # the first block's parent; None: it starts a sequence
    token_ids: list[int]  # block_size ids per hash, concatenated in the same order
    block_size: int  # tokens per block
    lora_id: int | None = None  # no adapters here: always None
    medium: str | None = None  # None: the device's KV cache (the protocol's default tier)


class BlockRemoved(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Blocks that left the prefix cache (evicted: reused for other content)."""

    block_hashes: list[int]  # signed 64-bit chain hashes
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Everything cached before is gone: a flush, a new data plane (epoch), a new engine process, or the
    start of a snapshot (the events after it in its batch list every cached block)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, frozen=True, array_like=True):
    """One engine step's events, numbered: 1, 2, 3, ... without gaps for a serving process's life."""

    sequence_number: int
    timestamp: float  # time.time() on the engine when the step ended
    events: list[KvEvent]


def signed64(h: int) -> int:
    """An unsigned 64-bit hash as the protocol's int64 (two's complement)."""
    return h - (1 << 64) if h >= 1 << 63 else h
