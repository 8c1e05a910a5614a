"""Binary encoding of the plane messages, as lists of ZeroMQ frames.

Every message starts with a frame whose first four bytes are `b"NP"`, a protocol version and a
message type, so a foreign or outdated peer is rejected with a `ProtocolError` naming the problem
instead of being misread. All integers are little-endian; the layouts below are the schema a data
plane in another language would implement.

    DESCRIPTOR  [header <2sBB q q I I I I I I I: epoch, step_id, rows R, appended A, freed F, new N,
                 copies C, bitmask rows M, bitmask width W,
                 int32 columns: slots[R] num_computed[R] num_scheduled[R] appended_offsets[R+1]
                                appended_block_ids[A] free_slots[F] copy_src[C] copy_dst[C]
                                bitmask_rows[M],
                 new-request records: NEW_REQUEST[N] (numpy structured, packed),
                 int32 data: each new request's token ids, block ids, stop ids, logit-bias ids and
                             logit-bias values (float32 bits), in order,
                 int32 bitmask[M * W] (row-major)]
    RESULT      [header <2sBB q q i B I d I I I I I: epoch, step_id, rank, flags, rows, forward time,
                 logprob rows L, top K, prompt rows P, prompt tokens T, prompt top K2,
                 int32 sampled[rows], utf-8 error,
                 int32 logprob_rows[L] sampled_ranks[L] top_ids[L * K] prompt_rows[P]
                       prompt_starts[P] prompt_offsets[P + 1] prompt_top_ids[T * K2],
                 float32 sampled_logprobs[L] top_logprobs[L * K] prompt_token_logprobs[T]
                         prompt_top_logprobs[T * K2]]
    HELLO, WELCOME, HEARTBEAT  [header <2sBB Q q i i i: launch_id, epoch, rank, world_size, pid]
    READY       [header, utf-8 JSON {"launch_id", **PlaneInfo}]
    SHUTDOWN    [header <2sBB i: exit code, utf-8 reason]
    RANK_EXITED [header <2sBB Q i i: launch_id, rank, exit code]

The hot path is a decode step: one struct and one concatenated int32 buffer each way, decoded
into zero-copy (read-only) numpy views. Rare messages (handshake) use JSON.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from nanoplane.proto.plane import NewRequest, PlaneInfo, SamplingSpec, StepDescriptor, StepResult

MAGIC = b"NP"
VERSION = 2
I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


class MsgType(IntEnum):
    DESCRIPTOR = 1
    RESULT = 2
    HELLO = 3  # rank -> control plane, until welcomed: "this launch exists"
    WELCOME = 4  # control plane -> rank: the epoch assigned to the rank's launch
    HEARTBEAT = 5  # both ways, every heartbeat interval
    READY = 6  # rank -> control plane once its model and KV cache are up
    SHUTDOWN = 7  # control plane -> rank: exit with this code
    RANK_EXITED = 8  # launcher -> control plane: a rank's process ended (sent before the launcher exits)


class ProtocolError(ValueError):
    """A message that is not a well-formed nanoplane message of this protocol version."""


RESULT_FATAL = 1  # RESULT flag: the rank failed (not merely refused); its state is gone


@dataclass(slots=True, frozen=True)
class Hello:
    launch_id: int  # random per launcher run; groups the ranks of one data plane
    rank: int
    world_size: int
    pid: int


@dataclass(slots=True, frozen=True)
class Welcome:
    launch_id: int
    epoch: int


@dataclass(slots=True, frozen=True)
class Heartbeat:
    launch_id: int
    epoch: int
    rank: int  # -1 when the control plane sends it


@dataclass(slots=True, frozen=True)
class Ready:
    launch_id: int
    info: PlaneInfo


@dataclass(slots=True, frozen=True)
class Shutdown:
    exit_code: int  # 0: stop for good; non-zero: a supervisor should restart the data plane
    reason: str


@dataclass(slots=True, frozen=True)
class RankExited:
    """The launcher saw a rank's process end: the control plane need not wait for its heartbeats to stop."""

    launch_id: int
    rank: int
    exit_code: int  # as a shell reports it (128 + N for signal N)


@dataclass(slots=True, frozen=True)
class Result:
    """A StepResult as it travels: with the sender's epoch, rank and a fatal flag."""

    epoch: int
    rank: int
    result: StepResult
    fatal: bool = False


Message = StepDescriptor | Result | Hello | Welcome | Heartbeat | Ready | Shutdown | RankExited
Frames = Sequence  # of bytes-like objects (bytes, memoryview, zmq.Frame, numpy arrays)

_PREFIX = struct.Struct("<2sBB")
_DESC = struct.Struct("<2sBBqqIIIIIII")
_RESULT = struct.Struct("<2sBBqqiBIdIIIII")
_PEER = struct.Struct("<2sBBQqiii")
_SHUTDOWN = struct.Struct("<2sBBi")
_EXITED = struct.Struct("<2sBBQii")

# float64 keeps Python floats exact across the wire; has_seed distinguishes seed None from 0.
NEW_REQUEST = np.dtype([("request_id", "<i8"), ("seed", "<i8"), ("temperature", "<f8"), ("top_p", "<f8"),
                        ("min_p", "<f8"), ("presence_penalty", "<f8"), ("frequency_penalty", "<f8"),
                        ("repetition_penalty", "<f8"), ("slot", "<i4"), ("num_tokens", "<i4"),
                        ("num_blocks", "<i4"), ("num_cached_tokens", "<i4"), ("top_k", "<i4"), ("has_seed", "<i4"),
                        ("min_tokens", "<i4"), ("num_stop_ids", "<i4"), ("num_bias", "<i4"), ("logprobs", "<i4"),
                        ("prompt_logprobs", "<i4"), ("num_prompt_tokens", "<i4")])
# The int32 runs of a new request in the descriptor's data frame, in order (the counts' record fields).
_RUNS = ("num_tokens", "num_blocks", "num_stop_ids", "num_bias", "num_bias")
_PLANE_FIELDS = {f.name: f.type for f in dataclasses.fields(PlaneInfo)}


def _header(frames: Frames, layout: struct.Struct, what: str) -> tuple:
    head = memoryview(frames[0])
    if head.nbytes != layout.size:
        raise ProtocolError(f"{what} header is {head.nbytes} bytes, expected {layout.size}")
    return layout.unpack(head)


def message_type(frames: Frames) -> MsgType:
    """Check the magic, version and type of a message; raise ProtocolError if it is not ours."""
    if not frames:
        raise ProtocolError("empty message")
    head = memoryview(frames[0])
    if head.nbytes < _PREFIX.size:
        raise ProtocolError(f"message of {head.nbytes} bytes is too short for a nanoplane header")
    magic, version, kind = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise ProtocolError(f"not a nanoplane message (starts with {bytes(head[:4])!r})")
    if version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this side speaks {VERSION}: "
                            "run the same nanoplane release on both planes")
    try:
        return MsgType(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind}") from None


def _expect_frames(frames: Frames, n: int, what: str) -> None:
    if len(frames) != n:
        raise ProtocolError(f"{what} has {len(frames)} frames, expected {n}")


def _int32s(frame, count: int, what: str) -> np.ndarray:
    arr = np.frombuffer(frame, dtype=I32)
    if arr.shape[0] != count:
        raise ProtocolError(f"{what}: {arr.shape[0]} int32 values, the header says {count}")
    return arr


def encode_descriptor(desc: StepDescriptor) -> list:
    rows, num_new = desc.num_rows, len(desc.new_requests)
    bitmask = np.ascontiguousarray(desc.bitmask, dtype=I32)
    if bitmask.ndim != 2 or bitmask.shape[0] != len(desc.bitmask_rows):
        raise ValueError(f"bitmask of shape {bitmask.shape} for {len(desc.bitmask_rows)} bitmask rows")
    if len(desc.copy_src) != len(desc.copy_dst):
        raise ValueError("copy_src and copy_dst differ in length")
    head = _DESC.pack(MAGIC, VERSION, MsgType.DESCRIPTOR, desc.epoch, desc.step_id, rows,
                      len(desc.appended_block_ids), len(desc.free_slots), num_new, len(desc.copy_src),
                      bitmask.shape[0], bitmask.shape[1])
    columns = np.concatenate((desc.slots, desc.num_computed, desc.num_scheduled, desc.appended_offsets,
                              desc.appended_block_ids, desc.free_slots, desc.copy_src, desc.copy_dst,
                              desc.bitmask_rows), dtype=I32)
    if not num_new:
        return [head, columns, b"", b"", bitmask.ravel()]
    records = np.array([_record(r) for r in desc.new_requests], NEW_REQUEST)
    data = np.concatenate([a for r in desc.new_requests for a in (
        r.token_ids, r.block_ids, r.sampling.stop_ids, r.sampling.logit_bias_ids,
        np.ascontiguousarray(r.sampling.logit_bias_values, dtype=F32).view(I32))], dtype=I32)
    return [head, columns, records, data, bitmask.ravel()]


def _record(r: NewRequest) -> tuple:
    s = r.sampling
    if len(s.logit_bias_ids) != len(s.logit_bias_values):
        raise ValueError(f"request {r.request_id}: {len(s.logit_bias_ids)} logit-bias ids but "
                         f"{len(s.logit_bias_values)} values")
    return (r.request_id, s.seed or 0, s.temperature, s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty,
            s.repetition_penalty, r.slot, len(r.token_ids), len(r.block_ids), r.num_cached_tokens, s.top_k,
            s.seed is not None, s.min_tokens, len(s.stop_ids), len(s.logit_bias_ids), s.logprobs, s.prompt_logprobs,
            r.num_prompt_tokens)


def _decode_descriptor(frames: Frames) -> StepDescriptor:
    _expect_frames(frames, 5, "descriptor")
    (_, _, _, epoch, step_id, rows, num_appended, num_free, num_new, num_copies, mask_rows,
     mask_width) = _header(frames, _DESC, "descriptor")
    cols = _int32s(frames[1], 4 * rows + 1 + num_appended + num_free + 2 * num_copies + mask_rows,
                   "descriptor columns")
    e = 4 * rows + 1 + num_appended
    offsets = cols[3 * rows:4 * rows + 1]
    if offsets[0] != 0 or offsets[-1] != num_appended or (rows and (np.diff(offsets) < 0).any()):
        raise ProtocolError("descriptor appended_offsets are not a CSR index over appended_block_ids")
    c = e + num_free
    bitmask = _int32s(frames[4], mask_rows * mask_width, "descriptor bitmask").reshape(mask_rows, mask_width)
    desc = StepDescriptor(step_id, epoch, [], cols[:rows], cols[rows:2 * rows], cols[2 * rows:3 * rows],
                          offsets, cols[4 * rows + 1:e], cols[e:c], cols[c:c + num_copies],
                          cols[c + num_copies:c + 2 * num_copies], cols[c + 2 * num_copies:], bitmask)
    if num_new:
        desc.new_requests = _decode_new_requests(frames[2], frames[3], num_new)
    elif memoryview(frames[2]).nbytes or memoryview(frames[3]).nbytes:
        raise ProtocolError("descriptor carries new-request data but the header says none")
    return desc


def _decode_new_requests(records_frame, data_frame, count: int) -> list[NewRequest]:
    raw = memoryview(records_frame)
    if raw.nbytes != count * NEW_REQUEST.itemsize:
        raise ProtocolError(f"new-request records are {raw.nbytes} bytes, expected {count} records")
    records = np.frombuffer(raw, dtype=NEW_REQUEST)
    if any((records[name] < 0).any() for name in _RUNS):
        raise ProtocolError("new request with a negative length")
    sizes = sum(records[name].astype(np.int64) for name in _RUNS)
    data = _int32s(data_frame, int(sizes.sum()), "new-request token and block ids")
    out, pos = [], 0
    for r in records:
        runs = []
        for name in _RUNS:
            n = int(r[name])
            runs.append(data[pos:pos + n])
            pos += n
        tokens, blocks, stop_ids, bias_ids, bias_values = runs
        spec = SamplingSpec(float(r["temperature"]), int(r["top_k"]), float(r["top_p"]), float(r["min_p"]),
                            int(r["seed"]) if r["has_seed"] else None, float(r["presence_penalty"]),
                            float(r["frequency_penalty"]), float(r["repetition_penalty"]), int(r["min_tokens"]),
                            stop_ids, bias_ids, bias_values.view(F32), int(r["logprobs"]), int(r["prompt_logprobs"]))
        out.append(NewRequest(int(r["request_id"]), int(r["slot"]), tokens, blocks, int(r["num_cached_tokens"]),
                              spec, int(r["num_prompt_tokens"])))
    return out


# The result's int32 and float32 arrays, in wire order, each with its shape in the header's
# dimensions L, K, P, T, K2 ("P+1": the CSR offsets).
_RESULT_INTS = (("logprob_rows", "L"), ("sampled_ranks", "L"), ("top_ids", "L K"), ("prompt_rows", "P"),
                ("prompt_starts", "P"), ("prompt_offsets", "P+1"), ("prompt_top_ids", "T K2"))
_RESULT_FLOATS = (("sampled_logprobs", "L"), ("top_logprobs", "L K"), ("prompt_token_logprobs", "T"),
                  ("prompt_top_logprobs", "T K2"))


def _shape(spec: str, dims: tuple) -> tuple[int, ...]:
    named = dict(zip(("L", "K", "P", "T", "K2"), dims, strict=True))
    named["P+1"] = named["P"] + 1
    return tuple(named[d] for d in spec.split())


def encode_result(result: StepResult, epoch: int, rank: int, fatal: bool = False) -> list:
    sampled = np.ascontiguousarray(result.sampled_token_ids, dtype=I32)
    dims = (len(result.logprob_rows), result.top_ids.shape[1] if result.top_ids.ndim == 2 else 0,
            len(result.prompt_rows), len(result.prompt_token_logprobs),
            result.prompt_top_ids.shape[1] if result.prompt_top_ids.ndim == 2 else 0)
    for name, spec in (*_RESULT_INTS, *_RESULT_FLOATS):
        if np.shape(getattr(result, name)) != _shape(spec, dims):
            raise ValueError(f"result {name} has shape {np.shape(getattr(result, name))}, "
                             f"expected {_shape(spec, dims)}")
    head = _RESULT.pack(MAGIC, VERSION, MsgType.RESULT, epoch, result.step_id, rank,
                        RESULT_FATAL if fatal else 0, sampled.shape[0], result.forward_time_s, *dims)
    ints = np.concatenate([np.ravel(getattr(result, n)) for n, _ in _RESULT_INTS], dtype=I32)
    floats = np.concatenate([np.ravel(getattr(result, n)) for n, _ in _RESULT_FLOATS], dtype=F32)
    return [head, sampled, result.error.encode(), ints, floats]


def _split(frame, dtype: np.dtype, names, dims: tuple, what: str) -> dict[str, np.ndarray]:
    shapes = [_shape(spec, dims) for _, spec in names]
    sizes = [int(np.prod(s)) for s in shapes]
    flat = np.frombuffer(frame, dtype=dtype)
    if flat.shape[0] != sum(sizes):
        raise ProtocolError(f"{what}: {flat.shape[0]} values, the header says {sum(sizes)}")
    out, pos = {}, 0
    for (name, _), shape, size in zip(names, shapes, sizes, strict=True):
        out[name] = flat[pos:pos + size].reshape(shape)
        pos += size
    return out


def _decode_result(frames: Frames) -> Result:
    _expect_frames(frames, 5, "result")
    _, _, _, epoch, step_id, rank, flags, rows, forward_time, *dims = _header(frames, _RESULT, "result")
    sampled = _int32s(frames[1], rows, "sampled token ids")
    try:
        error = bytes(frames[2]).decode()
    except UnicodeDecodeError:
        raise ProtocolError("result error text is not UTF-8") from None
    ints = _split(frames[3], I32, _RESULT_INTS, tuple(dims), "result logprob ids")
    floats = _split(frames[4], F32, _RESULT_FLOATS, tuple(dims), "result logprobs")
    offsets = ints["prompt_offsets"]
    if offsets[0] != 0 or offsets[-1] != dims[3] or (np.diff(offsets) < 0).any():
        raise ProtocolError("result prompt_offsets are not a CSR index over the prompt tokens")
    result = StepResult(step_id, sampled, forward_time, error, **ints, **floats)
    return Result(epoch, rank, result, bool(flags & RESULT_FATAL))


def encode_control(msg: Hello | Welcome | Heartbeat | Ready | Shutdown | RankExited) -> list:
    """Encode one of the (rare) handshake and liveness messages."""
    if isinstance(msg, Hello):
        return [_PEER.pack(MAGIC, VERSION, MsgType.HELLO, msg.launch_id, -1, msg.rank, msg.world_size, msg.pid)]
    if isinstance(msg, Welcome):
        return [_PEER.pack(MAGIC, VERSION, MsgType.WELCOME, msg.launch_id, msg.epoch, -1, 0, 0)]
    if isinstance(msg, Heartbeat):
        return [_PEER.pack(MAGIC, VERSION, MsgType.HEARTBEAT, msg.launch_id, msg.epoch, msg.rank, 0, 0)]
    if isinstance(msg, Ready):
        body = json.dumps({"launch_id": msg.launch_id, **dataclasses.asdict(msg.info)})
        return [_PREFIX.pack(MAGIC, VERSION, MsgType.READY), body.encode()]
    if isinstance(msg, Shutdown):
        return [_SHUTDOWN.pack(MAGIC, VERSION, MsgType.SHUTDOWN, msg.exit_code), msg.reason.encode()]
    if isinstance(msg, RankExited):
        return [_EXITED.pack(MAGIC, VERSION, MsgType.RANK_EXITED, msg.launch_id, msg.rank, msg.exit_code)]
    raise TypeError(f"not a control message: {type(msg).__name__}")


def _decode_ready(frames: Frames) -> Ready:
    _expect_frames(frames, 2, "ready")
    _header(frames, _PREFIX, "ready")
    try:
        body = json.loads(bytes(frames[1]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"ready body is not JSON: {e}") from None
    if not isinstance(body, dict) or set(body) != {"launch_id", *_PLANE_FIELDS}:
        raise ProtocolError(f"ready body must hold launch_id and the PlaneInfo fields {sorted(_PLANE_FIELDS)}")
    launch_id = body.pop("launch_id")
    for name, kind in _PLANE_FIELDS.items():
        want = int if kind == "int" else str
        if type(body[name]) is not want:
            raise ProtocolError(f"ready field {name} must be {want.__name__}, got {body[name]!r}")
    if type(launch_id) is not int:
        raise ProtocolError(f"ready launch_id must be int, got {launch_id!r}")
    return Ready(launch_id, PlaneInfo(**body))


def decode(frames: Frames) -> Message:
    """Decode any plane message; raise ProtocolError (never anything else) on a malformed one."""
    kind = message_type(frames)
    try:
        if kind is MsgType.DESCRIPTOR:
            return _decode_descriptor(frames)
        if kind is MsgType.RESULT:
            return _decode_result(frames)
        if kind is MsgType.READY:
            return _decode_ready(frames)
        if kind is MsgType.SHUTDOWN:
            _expect_frames(frames, 2, "shutdown")
            return Shutdown(_header(frames, _SHUTDOWN, "shutdown")[3], bytes(frames[1]).decode(errors="replace"))
        _expect_frames(frames, 1, kind.name.lower())
        if kind is MsgType.RANK_EXITED:
            return RankExited(*_header(frames, _EXITED, "rank_exited")[3:])
        _, _, _, launch_id, epoch, rank, world_size, pid = _header(frames, _PEER, kind.name.lower())
        if kind is MsgType.HELLO:
            return Hello(launch_id, rank, world_size, pid)
        if kind is MsgType.WELCOME:
            return Welcome(launch_id, epoch)
        return Heartbeat(launch_id, epoch, rank)
    except ProtocolError:
        raise
    except (ValueError, TypeError, struct.error) as e:  # e.g. a buffer whose size is not a multiple of 4
        raise ProtocolError(f"malformed {kind.name.lower()} message: {e}") from None
