"""A request's stream of outputs, as the engine loop and the gRPC handlers share it.

The vocabulary both engine front ends speak (`AsyncEngine` in the serving process, `EngineClient`
for an engine in its own process): what a request gained in a step (`Output`), the queue a
handler reads it from (`Stream`, `read_stream`), the engine's counters (`EngineStatus`), and the
wait for a request id that a cancelled call still holds (`wait_for_free_id`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from controlplane.errors import RequestIdInUse
from controlplane.sampling_params import SamplingParams
from controlplane.sequence import FinishReason

# A client that cancels a call and at once sends it again with the same request_id (a mesh retrying
# after its per-try timeout, a client reconnecting) can get here before the cancelled call's handler
# has run its cleanup: wait this long for the id to come free before answering ALREADY_EXISTS.
REQUEST_ID_GRACE_S = 0.25


async def wait_for_free_id(streams: dict, request_id: str) -> None:
    """Return once no running request uses request_id; RequestIdInUse after REQUEST_ID_GRACE_S."""
    deadline = time.monotonic() + REQUEST_ID_GRACE_S
    while request_id in streams:
        if time.monotonic() >= deadline:
            raise RequestIdInUse(f"request_id {request_id!r} is already in use by a running request")
        await asyncio.sleep(0.01)


@dataclass(slots=True)
class Output:
    """What a request gained: new token ids since the last output, and its counters after them."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache

    def merge(self, later: Output) -> None:
        """Fold a later output into this one (a consumer that fell behind sends one message)."""
        self.token_ids.extend(later.token_ids)
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.num_completion_tokens = later.num_completion_tokens
        self.num_cached_tokens = later.num_cached_tokens


@dataclass(frozen=True, slots=True)
class EngineStatus:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int  # held by live requests; cached-but-free prefix blocks do not count
    data_plane_ready: bool


@dataclass(eq=False, slots=True)
class Stream:
    """One request as both threads know it; eq=False hashes by identity, so a reused id is a new key."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Output items, or an exception to raise


async def read_stream(stream: Stream) -> AsyncIterator[Output]:
    """A stream's outputs up to the finished one; a consumer that fell behind gets what queued up
    meanwhile as one output. An exception in the queue is raised after the outputs before it."""
    pending: Output | BaseException | None = None
    while True:
        item = pending if pending is not None else await stream.queue.get()
        pending = None
        if isinstance(item, BaseException):
            raise item
        while not stream.queue.empty():
            later = stream.queue.get_nowait()
            if isinstance(later, BaseException):
                pending = later  # send what arrived before the error first
                break
            item.merge(later)
        yield item
        if item.finished:
            return
