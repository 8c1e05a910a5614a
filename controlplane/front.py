"""The engine front: what the gRPC server drives, whichever process the engine loop runs in.

`EngineFront` is the one interface; two implementations: `front_inproc.InProcessFront` (the loop on a
thread of the serving process) and `front_process.ProcessFront` (the loop in an engine process of its
own, the default). Also here, the values a front hands out: a request's `Output`s, read from its
`Stream`; the engine's counters (`EngineStatus`) and sizes (`EngineFacts`); and the wait for a request
id that a cancelled call still holds (`wait_for_free_id`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nanoplane.controlplane.engine import Engine, validate_request
from nanoplane.controlplane.errors import RequestIdInUse
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob
from nanoplane.controlplane.sequence import Sequence as EngineSequence
from nanoplane.proto.kv_events import KvEventBatch

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
    index: int = 0  # which of the request's n samples gained these tokens
    logprobs: list[Logprob] | None = None  # one per entry of token_ids, when the request asked
    prompt_logprobs: list[Logprob | None] | None = None  # the whole prompt's (None for token 0), once, on sample 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the sample
    queue_seconds: float | None = None  # from arrival to first admission, on sample 0's first token (tracing)

    @classmethod
    def of(cls, request_id: str | int, seq: EngineSequence, token_ids: list[int]) -> Output:
        """What sample `seq` gained: `token_ids`, its latest (empty when it only ended)."""
        out = cls(request_id, token_ids, seq.is_finished, seq.finish_reason, seq.num_prompt_tokens,
                  seq.num_completion_tokens, seq.num_cached_prompt_tokens, seq.sample_index, None, None,
                  seq.stop_reason)
        if seq.logprobs is not None and token_ids:  # the entries of the tokens just produced (the latest known)
            end = seq.num_completion_tokens
            out.logprobs = seq.logprobs[end - len(token_ids):end]
        # Once, with sample 0's first token: prefill is complete by then, so the list is whole.
        if seq.prompt_logprobs is not None and seq.sample_index == 0 and token_ids and seq.num_completion_tokens == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        if token_ids and seq.num_completion_tokens == 1:
            out.queue_seconds = seq.queue_seconds
        return out

    def merge(self, later: Output) -> None:
        """Fold a later output of the same sample into this one (a consumer that fell behind sends one message)."""
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.queue_seconds = self.queue_seconds if self.queue_seconds is not None else later.queue_seconds
        self.stop_reason = later.stop_reason
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


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine did since its previous report (increments, observations) and the data plane's
    state, for the metrics (controlplane/metrics.py); proto/engine_link.py's Stats, field for field."""

    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found there
    preemptions: int
    descriptor_bytes: int  # step descriptors' encoded bytes sent to one rank
    step_seconds: list[float]  # one observation per engine step that applied a result
    queue_seconds: list[float]  # one per request admitted: arrival to first admission
    epoch: int  # the attached data plane's epoch
    heartbeat_ages: list[float]  # seconds since each rank's latest heartbeat, by rank; empty in-process


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The attached engine's sizes: enough to check a request before it is queued and to answer
    GetModelInfo. Fixed for an engine's life, so any thread may read them."""

    architecture: str
    tensor_parallel_size: int
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_capacity_tokens: int

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        info = engine.infos[0]
        return cls(info.architecture, info.world_size, engine.max_model_len, engine.vocab_size, engine.block_size,
                   engine.kv_capacity_tokens)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a message a person understands if the request cannot run."""
        validate_request(token_ids, params, self.vocab_size, self.max_model_len, self.kv_capacity_tokens)


@dataclass(eq=False, slots=True)
class Stream:
    """One request as both sides of a front know it; eq=False hashes by identity, so a reused id is a
    new key. In the engine process `request_id` holds the serving process's integer key instead."""

    request_id: str | int
    token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue | None = field(default_factory=asyncio.Queue)  # Outputs, or an exception to raise
    deadline: float | None = None  # time.monotonic() of this process by which it must start; None: none


async def read_stream(stream: Stream) -> AsyncIterator[Output]:
    """A stream's outputs until every sample (params.n of them) has had its finished one; a consumer
    that fell behind gets what queued up meanwhile as one output per sample. An exception in the
    queue is raised after the outputs before it."""
    left = stream.params.n
    while True:
        items, error = _coalesce(await stream.queue.get(), stream.queue)
        for item in items:
            yield item
            left -= item.finished
            if not left:
                return
        if error is not None:
            raise error


def _coalesce(item: Output | BaseException, queue: asyncio.Queue) -> tuple[list[Output], BaseException | None]:
    """`item` and what `queue` holds now, up to the first exception: merged into one Output per
    sample (in the order the samples first appear), and that exception."""
    merged: dict[int, Output] = {}
    error = None
    while True:
        if isinstance(item, BaseException):
            error = item  # sent after what arrived before it
            break
        if (first := merged.get(item.index)) is None:
            merged[item.index] = item
        else:
            first.merge(item)
        if queue.empty():
            break
        item = queue.get_nowait()
    return list(merged.values()), error


class EngineFront(Protocol):
    """What the gRPC server drives. Call `start` and `generate` from the event loop that serves the
    streams; the readiness methods from any thread."""

    @property
    def facts(self) -> EngineFacts | None:
        """The attached engine's sizes; the last known ones while the data plane is down; None before
        any data plane has attached."""

    @property
    def data_plane_ready(self) -> bool:
        """Whether requests can run now."""

    def start(self) -> None:
        """Start the engine loop (a thread, or a process); call from the serving event loop."""

    def generate(self, token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                 timeout_s: float | None = None) -> AsyncIterator[Output]:
        """Run one request; yields its outputs until the one with finished=True. Closing the iterator
        early aborts the request and frees its blocks (use `contextlib.aclosing`). `timeout_s`: seconds
        from now by which it must start, else it is dropped before prefill (None: no deadline). Raises
        ValueError, RequestIdInUse, DataPlaneUnavailable, QueueFull or DeadlineExceeded."""

    def abort(self, request_id: str) -> bool:
        """End a running request from the server side (its stream gets a final ABORT output); False
        if no request runs under that id. Event-loop thread only."""

    async def flush_prefix_cache(self) -> bool:
        """Drop every cached-but-free block from the prefix cache between engine steps (blocks running
        requests hold stay cached); KV-event subscribers get AllBlocksCleared, then a BlockStored for
        each block that stayed. False (nothing dropped) while the data plane is down."""

    def stop_sample(self, request_id: str, index: int, stop: str) -> None:
        """A stop string ended sample `index` of a running request of n > 1 (the consumer has its last
        message): end it in the engine while the other samples go on. Event-loop thread only."""

    def status(self) -> EngineStatus:
        """The engine's counters as of its latest iteration."""

    def add_ready_listener(self, callback: Callable[[bool], None]) -> None:
        """callback(ready) runs on a thread of the front's whenever the data plane's readiness changes."""

    def add_stats_listener(self, callback: Callable[[EngineStats], None]) -> None:
        """callback(stats) runs on a thread of the front's about every engine_stats.STATS_INTERVAL_S
        while an engine is attached; add it before `start`."""

    def set_data_plane_ready(self, ready: bool, reason: str = "") -> None:
        """Readiness pushed from outside (a transport that lost or regained the plane); thread-safe."""

    def kv_events(self, start_sequence_number: int = 0) -> AsyncIterator[KvEventBatch]:
        """KV-cache event batches (proto/kv_events.py), numbered from 1; 0, or a number the replay
        buffer no longer holds, starts with a snapshot (AllBlocksCleared, then every cached block).
        Raises KvEventsOff (controlplane/kv_events.py) under --kv-events off. Event-loop thread only;
        closing the iterator ends the subscription. The module docstring of kv_events.py has the rest."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (open streams end with DataPlaneUnavailable "the server is shutting down");
        blocks, so call it off the event loop."""
