"""Binary encoding of the plane messages, as lists of ZeroMQ frames.

Every message starts with a frame whose first four bytes are `b"NP"`, a protocol version and a
message type, so a foreign or outdated peer is rejected with a `ProtocolError` naming the problem
instead of being misread. All integers are little-endian; the layouts below are the schema a data
plane in another language would implement.

    DESCRIPTOR  [header <2sBB q q I I I I: epoch, step_id, rows R, appended A, freed F, new N,
                 int32 columns: slots[R] num_computed[R] num_scheduled[R] appended_offsets[R+1]
                                appended_block_ids[A] free_slots[F],
                 new-request records: NEW_REQUEST[N] (numpy structured, packed),
                 int32 data: each new request's token ids then block ids, in order]
    RESULT      [header <2sBB q q i B I d: epoch, step_id, rank, flags, rows, forward time,
                 int32 sampled[rows], utf-8 error]
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
VERSION = 1
I32 = np.dtype("<i4")


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
_DESC = struct.Struct("<2sBBqqIIII")
_RESULT = struct.Struct("<2sBBqqiBId")
_PEER = struct.Struct("<2sBBQqiii")
_SHUTDOWN = struct.Struct("<2sBBi")
_EXITED = struct.Struct("<2sBBQii")

# float64 keeps Python floats exact across the wire; has_seed distinguishes seed None from 0.
NEW_REQUEST = np.dtype([("request_id", "<i8"), ("seed", "<i8"), ("temperature", "<f8"), ("top_p", "<f8"),
                        ("min_p", "<f8"), ("slot", "<i4"), ("num_tokens", "<i4"), ("num_blocks", "<i4"),
                        ("num_cached_tokens", "<i4"), ("top_k", "<i4"), ("has_seed", "<i4")])
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
    head = _DESC.pack(MAGIC, VERSION, MsgType.DESCRIPTOR, desc.epoch, desc.step_id, rows,
                      len(desc.appended_block_ids), len(desc.free_slots), num_new)
    columns = np.concatenate((desc.slots, desc.num_computed, desc.num_scheduled, desc.appended_offsets,
                              desc.appended_block_ids, desc.free_slots), dtype=I32)
    if not num_new:
        return [head, columns, b"", b""]
    records = np.array([(r.request_id, r.sampling.seed or 0, r.sampling.temperature, r.sampling.top_p,
                         r.sampling.min_p, r.slot, len(r.token_ids), len(r.block_ids), r.num_cached_tokens,
                         r.sampling.top_k, r.sampling.seed is not None) for r in desc.new_requests], NEW_REQUEST)
    data = np.concatenate([a for r in desc.new_requests for a in (r.token_ids, r.block_ids)], dtype=I32)
    return [head, columns, records, data]


def _decode_descriptor(frames: Frames) -> StepDescriptor:
    _expect_frames(frames, 4, "descriptor")
    _, _, _, epoch, step_id, rows, num_appended, num_free, num_new = _header(frames, _DESC, "descriptor")
    cols = _int32s(frames[1], 4 * rows + 1 + num_appended + num_free, "descriptor columns")
    e = 4 * rows + 1 + num_appended
    offsets = cols[3 * rows:4 * rows + 1]
    if offsets[0] != 0 or offsets[-1] != num_appended or (rows and (np.diff(offsets) < 0).any()):
        raise ProtocolError("descriptor appended_offsets are not a CSR index over appended_block_ids")
    desc = StepDescriptor(step_id, epoch, [], cols[:rows], cols[rows:2 * rows], cols[2 * rows:3 * rows],
                          offsets, cols[4 * rows + 1:e], cols[e:])
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
    if (records["num_tokens"] < 0).any() or (records["num_blocks"] < 0).any():
        raise ProtocolError("new request with a negative length")
    sizes = records["num_tokens"].astype(np.int64) + records["num_blocks"]
    data = _int32s(data_frame, int(sizes.sum()), "new-request token and block ids")
    out, pos = [], 0
    for r in records.tolist():
        request_id, seed, temperature, top_p, min_p, slot, n_tok, n_blk, cached, top_k, has_seed = r
        spec = SamplingSpec(temperature, top_k, top_p, min_p, seed if has_seed else None)
        out.append(NewRequest(request_id, slot, data[pos:pos + n_tok], data[pos + n_tok:pos + n_tok + n_blk],
                              cached, spec))
        pos += n_tok + n_blk
    return out


def encode_result(result: StepResult, epoch: int, rank: int, fatal: bool = False) -> list:
    sampled = np.ascontiguousarray(result.sampled_token_ids, dtype=I32)
    head = _RESULT.pack(MAGIC, VERSION, MsgType.RESULT, epoch, result.step_id, rank,
                        RESULT_FATAL if fatal else 0, sampled.shape[0], result.forward_time_s)
    return [head, sampled, result.error.encode()]


def _decode_result(frames: Frames) -> Result:
    _expect_frames(frames, 3, "result")
    _, _, _, epoch, step_id, rank, flags, rows, forward_time = _header(frames, _RESULT, "result")
    sampled = _int32s(frames[1], rows, "sampled token ids")
    try:
        error = bytes(frames[2]).decode()
    except UnicodeDecodeError:
        raise ProtocolError("result error text is not UTF-8") from None
    return Result(epoch, rank, StepResult(step_id, sampled, forward_time, error), bool(flags & RESULT_FATAL))


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
