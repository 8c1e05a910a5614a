"""The link between the serving process and the engine process: typed, versioned messages.

Two one-way ZeroMQ sockets (controlplane/front_process.py and controlplane/engine_process.py):
commands go from the serving process to the engine process, events come back. Each message is
one frame: `b"NE"`, the link version (one byte), then the message as MessagePack (msgspec), a
struct tagged with its name. A peer of another version, a foreign sender or a malformed body
decodes to `LinkError`, never to anything else, so neither process can be crashed or misled by
what arrives on its socket. Errors that cross the link travel as `Failure` (a kind and a
message), not as exceptions: the receiving side raises its own class for the kind.

This module imports msgspec only: it is the schema another implementation of either side follows.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from nanoplane.proto.kv_events import KvEvent

MAGIC = b"NE"
# 2: the Stats event; 3: Add.timeout_s, the "exhausted" and "deadline" failures; 4: the full sampling API
# (Sampling's processors, logprobs, n, stop details, structured output; Delta's sample index, logprobs, stop
# reason; the StopSample command); 5: Flush / Flushed (drop the prefix cache), RecordKvEvents / KvEvents
# (KV-cache events)
VERSION = 5
_HEADER = MAGIC + bytes([VERSION])


class LinkError(ValueError):
    """Bytes that are not a well-formed engine-link message of this version."""


class Sampling(msgspec.Struct, frozen=True, array_like=True):
    """A request's sampling parameters (controlplane.sampling_params.SamplingParams, field for field;
    with its defaults, so that older positional construction stays valid)."""

    temperature: float  # 0 is greedy
    top_p: float  # nucleus mass in (0, 1]; 1 disables
    top_k: int  # 0 (or -1) disables
    min_p: float  # in [0, 1]; 0 disables
    max_tokens: int  # output tokens at most
    seed: int | None  # None: the data plane's shared random stream
    ignore_eos: bool  # keep going past the end-of-sequence token
    stop_token_ids: list[int]  # extra ids that end the output
    min_tokens: int = 0  # end-of-sequence and stop ids are masked until the output holds this many
    stop: list[str] = []  # strings that end the output (matched by the serving process's detokenizer)
    include_stop_str_in_output: bool = False  # keep the stop string in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # a space between special tokens and their neighbours' text
    presence_penalty: float = 0.0  # in [-2, 2]; 0 disables
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 disables
    repetition_penalty: float = 1.0  # in (0, 2]; 1 disables
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the top N
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    n: int = 1  # parallel samples of the prompt
    structured: dict[str, Any] | None = None  # one of json_schema / json_object / regex / choice / grammar


# ---- commands: serving process -> engine process ---------------------------------------------------

class Add(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Queue a request the serving process has already checked against the engine's facts."""

    key: int  # the serving process's number for the request: every output and failure names it
    token_ids: list[int]  # the prompt
    sampling: Sampling  # how to sample it
    timeout_s: float | None  # seconds left of its deadline when sent (the engine adds its own clock); None: none


class Abort(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Drop a request and free its blocks; unknown keys are ignored."""

    key: int  # Add.key of the request
    notify: bool  # send the request a final ABORT output (a server-side abort); False: its consumer left


class StopSample(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A stop string ended one sample of a request on the serving side: end it in the engine (finish
    reason STOP, its blocks freed) while the request's other samples go on; unknown keys are ignored."""

    key: int  # Add.key of the request
    index: int  # the sample, in [0, n)
    stop: str  # the stop string (its stop reason)


class SetReady(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Readiness of the data plane as seen from outside the engine process (a transport's push)."""

    ready: bool  # up or down
    reason: str  # why it went down; empty when up


class Stop(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Stop in order: open streams end with UNAVAILABLE, the data plane is told to exit 0."""


class RecordKvEvents(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Someone subscribes to KV-cache events: record them, starting with a snapshot (a fresh one if
    recording already); or nobody does any more: stop."""

    on: bool


class Flush(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Drop the prefix cache between steps; answered by Flushed with the same token."""

    token: int  # the serving process's number for this flush


Command = Add | Abort | StopSample | SetReady | Stop | Flush | RecordKvEvents


# ---- events: engine process -> serving process -----------------------------------------------------

class Logprob(msgspec.Struct, frozen=True, array_like=True):
    """Log probabilities at one position (controlplane.sequence.Logprob, field for field)."""

    token_id: int  # the sampled token, or the prompt's
    logprob: float  # its log probability
    rank: int  # 1 + the number of tokens more likely than it
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), most likely first


class Delta(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """What one sample of a request gained in a step (controlplane.front.Output without the request id).
    The fields after num_cached_tokens keep their defaults for requests that use none of them."""

    key: int  # Add.key of the request
    token_ids: list[int]  # new token ids since its previous Delta
    finished: bool  # this is the sample's last Delta (the request's once every sample has had one)
    finish_reason: Literal["stop", "eos", "length", "abort"] | None  # once finished: sequence.FinishReason's value
    num_prompt_tokens: int  # tokens in the prompt
    num_completion_tokens: int  # output tokens so far
    num_cached_tokens: int  # prompt tokens reused from the prefix cache
    index: int = 0  # which of the request's n samples gained the tokens
    logprobs: list[Logprob] | None = None  # one per entry of token_ids, when the request asked
    prompt_logprobs: list[Logprob | None] | None = None  # the prompt's (None for token 0), once, on sample 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the sample
    queue_seconds: float | None = None  # from arrival to first admission, on the first token (tracing)


# Failure kinds, each raised as its own class on the serving side.
UNAVAILABLE = "unavailable"  # controlplane.errors.DataPlaneUnavailable
INVALID = "invalid"  # ValueError: the request cannot run on this engine
ID_IN_USE = "id_in_use"  # controlplane.errors.RequestIdInUse
EXHAUSTED = "exhausted"  # controlplane.scheduler.QueueFull: the waiting queue is at its bound
DEADLINE = "deadline"  # controlplane.errors.DeadlineExceeded: its deadline passed while it waited
INTERNAL = "internal"  # anything else: a bug on the engine side
FAILURE_KINDS = (UNAVAILABLE, INVALID, ID_IN_USE, EXHAUSTED, DEADLINE, INTERNAL)


class Failure(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A request that ended with an error instead of a finished Delta."""

    key: int  # Add.key of the request
    kind: Literal["unavailable", "invalid", "id_in_use", "exhausted", "deadline", "internal"]  # FAILURE_KINDS
    message: str  # for the client, as the gRPC status details


class Outputs(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Everything one engine-loop iteration has for the streams, in order."""

    items: list[Delta | Failure]  # per request, in the order the engine produced them


class Beat(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The engine process is alive; sent by its main thread every second whatever the engine does."""


class Status(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The engine's counters (controlplane.front.EngineStatus), sent when they change."""

    running: int  # requests being computed
    waiting: int  # requests queued for blocks or a slot
    kv_blocks_total: int  # KV cache blocks in all
    kv_blocks_used: int  # blocks held by live requests; cached-but-free prefix blocks do not count
    data_plane_ready: bool  # whether requests can run


class Stats(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """What the engine did since its previous Stats (controlplane.front.EngineStats), sent about every
    engine_stats.STATS_INTERVAL_S while an engine is attached: increments and observations, so that a
    replaced engine process adds to the serving process's counters instead of resetting them."""

    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found there
    preemptions: int  # running requests sent back to the queue for want of KV blocks
    descriptor_bytes: int  # step descriptors' encoded bytes sent to one rank
    step_seconds: list[float]  # one engine step call that applied a result, each
    queue_seconds: list[float]  # from a request's arrival to its first admission, each
    epoch: int  # the attached data plane's epoch
    heartbeat_ages: list[float]  # seconds since each rank's latest heartbeat, by rank; empty in-process


class Facts(msgspec.Struct, frozen=True, array_like=True):
    """The attached engine's sizes (controlplane.front.EngineFacts): enough to check a request before
    sending it and to answer GetModelInfo."""

    architecture: str  # config.json architectures[0], as the data plane reported it
    tensor_parallel_size: int  # ranks of the data plane
    max_model_len: int  # longest prompt plus output
    vocab_size: int  # token ids are below it
    block_size: int  # tokens per KV block
    kv_capacity_tokens: int  # tokens the KV cache holds in all


class Readiness(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The data plane came up (with the engine's facts) or went down (with the reason)."""

    ready: bool  # up or down
    facts: Facts | None  # the engine's sizes when up; None when down
    reason: str  # why it is down, bare (the serving side words it for clients); empty when up


class KvEvents(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One engine-loop iteration's KV-cache events, while recording (the serving process numbers them)."""

    timestamp: float  # time.time() on the engine
    events: list[KvEvent]  # proto/kv_events.py
    snapshot: bool  # the answer to RecordKvEvents(on): AllBlocksCleared, then every cached block


class Flushed(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The answer to Flush: whether the prefix cache was dropped (not while a request holds blocks)."""

    token: int  # Flush.token
    success: bool


Event = Outputs | Beat | Status | Stats | Readiness | Flushed | KvEvents

# ---- the engine process's start: its command line -------------------------------------------------

class Launch(msgspec.Struct, frozen=True):
    """What the engine process is started with, as JSON in its command line (encode_launch)."""

    version: int  # VERSION of the starting side: a mismatch is refused before anything else happens
    config: dict[str, str | int | float | bool | None]  # controlplane.config.EngineConfig's fields but hf_config
    data_plane_address: str  # the ZeroMQ endpoint the engine process binds for the data plane's ranks
    commands_address: str  # the serving process's commands socket, which the engine process connects
    events_address: str  # the serving process's events socket, which the engine process connects
    eos_token_ids: list[int]  # the tokenizer's end-of-sequence ids
    recover_interval_s: float  # how often to try attaching a data plane while none is ready
    attach_timeout_s: float  # how long each attempt waits for the ranks' handshakes
    plane_keys: str = ""  # folder of the plane link's CURVE keys (nanoplane/plane_keys.py); empty: none


def encode_launch(launch: Launch) -> str:
    return msgspec.json.encode(launch).decode()


def decode_launch(text: str) -> Launch:
    """A Launch, or LinkError (also for a Launch of another version)."""
    try:
        launch = msgspec.json.decode(text, type=Launch)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkError(f"malformed engine-process launch: {exc}") from None
    if launch.version != VERSION:
        raise LinkError(f"the serving process speaks engine-link version {launch.version}, this engine process "
                        f"speaks {VERSION}: run the same nanoplane release in both processes")
    return launch


_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_events = msgspec.msgpack.Decoder(Event)


def encode(message: Command | Event) -> bytes:
    """One frame: the link header, then the message."""
    return _HEADER + _encoder.encode(message)


def _decode(frame: bytes | memoryview, decoder: msgspec.msgpack.Decoder, what: str):
    data = memoryview(frame)
    if data.nbytes < len(_HEADER):
        raise LinkError(f"engine-link {what} of {data.nbytes} bytes is too short for its header")
    if bytes(data[:2]) != MAGIC:
        raise LinkError(f"not an engine-link message (starts with {bytes(data[:4])!r})")
    if data[2] != VERSION:
        raise LinkError(f"the peer speaks engine-link version {data[2]}, this side speaks {VERSION}: "
                        "run the same nanoplane release in both processes")
    try:
        return decoder.decode(data[len(_HEADER):])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise LinkError(f"malformed engine-link {what}: {exc}") from None


def decode_command(frame: bytes | memoryview) -> Command:
    """A command, or LinkError (never anything else)."""
    return _decode(frame, _commands, "command")


def decode_event(frame: bytes | memoryview) -> Event:
    """An event, or LinkError (never anything else)."""
    return _decode(frame, _events, "event")
