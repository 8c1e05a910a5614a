"""The plane codec: every message round-trips exactly, and anything else is a ProtocolError."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoplane.proto import codec
from nanoplane.proto.codec import (
    Heartbeat,
    Hello,
    ProtocolError,
    RankExited,
    Ready,
    Result,
    Shutdown,
    Welcome,
    decode,
)
from nanoplane.proto.plane import NewRequest, PlaneInfo, SamplingSpec, StepDescriptor, StepResult, int32_column

i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
columns = st.lists(i32, max_size=40).map(int32_column)
floats = st.floats(allow_nan=False)


@st.composite
def new_requests(draw) -> NewRequest:
    spec = SamplingSpec(draw(floats), draw(i32), draw(floats), draw(floats), draw(st.none() | i64))
    return NewRequest(draw(i64), draw(i32), draw(columns), draw(columns), draw(i32), spec)


@st.composite
def descriptors(draw) -> StepDescriptor:
    rows = draw(st.integers(0, 40))
    appends = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    col = st.lists(i32, min_size=rows, max_size=rows).map(int32_column)
    return StepDescriptor(
        step_id=draw(i64), epoch=draw(i64), new_requests=draw(st.lists(new_requests(), max_size=4)),
        slots=draw(col), num_computed=draw(col), num_scheduled=draw(col),
        appended_offsets=int32_column(np.cumsum([0, *appends])),
        appended_block_ids=draw(st.lists(i32, min_size=sum(appends), max_size=sum(appends)).map(int32_column)),
        free_slots=draw(columns))


def same(a, b) -> bool:
    """Field-by-field equality that understands numpy columns."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and b.dtype == np.int32 and np.array_equal(a, b)
    if hasattr(a, "__slots__") and not isinstance(a, str | int | float):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__slots__)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b and type(a) is type(b)


def wire(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]  # what the far side receives


@settings(max_examples=200, deadline=None)
@given(descriptors())
def test_descriptor_round_trip(desc):
    assert same(decode(wire(codec.encode_descriptor(desc))), desc)


@settings(max_examples=200, deadline=None)
@given(i64, i64, st.integers(-1, 2**31 - 1), columns, floats, st.text(), st.booleans())
def test_result_round_trip(epoch, step_id, rank, sampled, seconds, error, fatal):
    result = StepResult(step_id, sampled, seconds, error)
    assert same(decode(wire(codec.encode_result(result, epoch, rank, fatal))), Result(epoch, rank, result, fatal))


plane_infos = st.builds(PlaneInfo, i32, i32, i64, i64, i32, i32, i32, i32, st.text(), st.text(), st.text())
controls = st.one_of(
    st.builds(Hello, st.integers(0, 2**64 - 1), i32, i32, i32),
    st.builds(Welcome, st.integers(0, 2**64 - 1), i64),
    st.builds(Heartbeat, st.integers(0, 2**64 - 1), i64, i32),
    st.builds(Ready, i64, plane_infos),
    st.builds(Shutdown, i32, st.text()),
    st.builds(RankExited, st.integers(0, 2**64 - 1), i32, i32),
)


@settings(max_examples=200, deadline=None)
@given(controls)
def test_control_round_trip(msg):
    assert decode(wire(codec.encode_control(msg))) == msg


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_garbage_is_a_protocol_error(frames):
    with contextlib.suppress(ProtocolError):
        decode(frames)


HEADER_SIZES = [0, 4, 16, 28, 32, 33]  # the fixed headers less their 4-byte prefix, and none


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(list(codec.MsgType)), st.sampled_from(HEADER_SIZES).flatmap(lambda n: st.binary(min_size=n,
       max_size=n)), st.lists(st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]), max_size=4))
def test_our_header_with_a_garbage_body_is_a_protocol_error(kind, tail, rest):
    """The hard case: magic, version and header size are right, so decoding goes deep into the body."""
    with contextlib.suppress(ProtocolError):
        decode([b"NP\x01" + bytes([kind]) + tail, *rest])


@settings(max_examples=300, deadline=None)
@given(descriptors(), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                               max_size=4))
def test_a_corrupted_descriptor_is_refused_or_decodes(desc, flips):
    """Bytes flipped anywhere (counts, offsets, new-request records) never escape as another error."""
    frames = [bytearray(f) for f in wire(codec.encode_descriptor(desc))]
    for i, pos, byte in flips:
        if frames[i]:
            frames[i][pos % len(frames[i])] = byte
    with contextlib.suppress(ProtocolError):
        decode([bytes(f) for f in frames])


def test_rejections_say_what_is_wrong():
    desc = StepDescriptor(3, 1, slots=int32_column([0, 1]), num_computed=int32_column([5, 6]),
                          num_scheduled=int32_column([1, 1]), appended_offsets=int32_column([0, 1, 1]),
                          appended_block_ids=int32_column([9]))
    good = wire(codec.encode_descriptor(desc))
    with pytest.raises(ProtocolError, match="not a nanoplane message"):
        decode([b"GET / HTTP/1.1\r\n", *good[1:]])
    with pytest.raises(ProtocolError, match="version 9"):
        decode([b"NP\x09" + good[0][3:], *good[1:]])
    with pytest.raises(ProtocolError, match="unknown message type 99"):
        decode([b"NP\x01\x63" + good[0][4:], *good[1:]])
    with pytest.raises(ProtocolError, match="frames"):
        decode(good[:2])
    with pytest.raises(ProtocolError, match="int32 values"):
        decode([good[0], good[1][:-4], *good[2:]])
    bad_offsets = bytearray(good[1])
    struct.pack_into("<i", bad_offsets, 4 * 6, 2)  # offsets [0, 2, 1]: not a CSR index
    with pytest.raises(ProtocolError, match="CSR"):
        decode([good[0], bytes(bad_offsets), *good[2:]])
    with pytest.raises(ProtocolError, match="new-request"):
        decode([*good[:3], b"\x00" * 8])


def test_decoded_columns_are_int32_views_of_the_frame():
    """Zero copy on the hot path: the columns share the received buffer (and are read-only)."""
    desc = StepDescriptor(0, 0, slots=int32_column(range(256)), num_computed=int32_column(range(256)),
                          num_scheduled=int32_column([1] * 256), appended_offsets=int32_column([0] * 257))
    frames = wire(codec.encode_descriptor(desc))
    out = decode(frames)
    assert out.slots.dtype == np.int32 and not out.slots.flags.writeable
    assert np.shares_memory(out.slots, np.frombuffer(frames[1], np.int32))
