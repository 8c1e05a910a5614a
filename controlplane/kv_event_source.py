"""What SubscribeKvEvents relays: the KV-cache events of the block manager, numbered and resumable.

`KvEventSource` is the interface between the event producer (the block manager's events, issue 34's
item 2) and the vLLM servicer (controlplane/vllm_servicer.py), in vLLM's own event shapes
(vllm/distributed/kv_events.py): BlockStored, BlockRemoved, AllBlocksCleared in numbered batches.
Block hashes are the prefix cache's chained xxh64 (block_manager.chain_hash), unsigned 64-bit.

`StubKvEventSource` is a STAND-IN until the real source lands: it publishes no events at all, so a
subscriber learns nothing of the cache (SMG then routes without precise prefix knowledge).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks hashed into the prefix cache, parents before children."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first of them; None at the start of a sequence
    token_ids: list[int]  # every block's tokens, concatenated (block_size each)
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks whose cached content is gone (handed out again for other content)."""

    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache is gone (a flush, or a new data-plane epoch)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    sequence_number: int  # 1, 2, ...: consecutive, so a subscriber sees a gap
    timestamp: float  # time.time() when the batch was made
    events: list[KvEvent] = field(default_factory=list)


class KvEventSource(Protocol):
    def subscribe(self, start_sequence_number: int) -> AsyncIterator[KvEventBatch]:
        """Batches from `start_sequence_number` on (those still in the replay buffer first; 0: from
        now on), then live ones, until the caller closes the iterator. Runs on the serving event loop."""


class StubKvEventSource:
    """STUB: no events. Stands in for the block manager's event source until it exists."""

    async def subscribe(self, start_sequence_number: int) -> AsyncIterator[KvEventBatch]:
        log.warning("SubscribeKvEvents: this server has no KV-event source yet (a stub that publishes nothing)")
        await asyncio.Event().wait()  # until the subscriber goes away
        yield KvEventBatch(0, 0.0)  # never reached; makes this an async generator
