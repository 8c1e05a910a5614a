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
f32 = st.floats(allow_nan=False, width=32)


def f32_column(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).reshape(-1)


@st.composite
def new_requests(draw) -> NewRequest:
    bias = draw(st.lists(st.tuples(i32, f32), max_size=6))
    spec = SamplingSpec(draw(floats), draw(i32), draw(floats), draw(floats), draw(st.none() | i64),
                        presence_penalty=draw(floats), frequency_penalty=draw(floats),
                        repetition_penalty=draw(floats), min_tokens=draw(i32), stop_ids=draw(columns),
                        logit_bias_ids=int32_column([b[0] for b in bias]),
                        logit_bias_values=f32_column([b[1] for b in bias]), logprobs=draw(i32),
                        prompt_logprobs=draw(i32))
    return NewRequest(draw(i64), draw(i32), draw(columns), draw(columns), draw(i32), spec, draw(i32))


@st.composite
def descriptors(draw) -> StepDescriptor:
    rows = draw(st.integers(0, 40))
    copies = draw(st.integers(0, 5))
    mask_rows, width = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    appends = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    col = st.lists(i32, min_size=rows, max_size=rows).map(int32_column)
    return StepDescriptor(
        step_id=draw(i64), epoch=draw(i64), new_requests=draw(st.lists(new_requests(), max_size=4)),
        slots=draw(col), num_computed=draw(col), num_scheduled=draw(col),
        appended_offsets=int32_column(np.cumsum([0, *appends])),
        appended_block_ids=draw(st.lists(i32, min_size=sum(appends), max_size=sum(appends)).map(int32_column)),
        free_slots=draw(columns),
        copy_src=draw(st.lists(i32, min_size=copies, max_size=copies).map(int32_column)),
        copy_dst=draw(st.lists(i32, min_size=copies, max_size=copies).map(int32_column)),
        bitmask_rows=draw(st.lists(i32, min_size=mask_rows, max_size=mask_rows).map(int32_column)),
        bitmask=np.array(draw(st.lists(i32, min_size=mask_rows * width, max_size=mask_rows * width)),
                         dtype=np.int32).reshape(mask_rows, width))


@st.composite
def results(draw) -> StepResult:
    """A StepResult with logprob arrays of consistent shapes (L rows of K, P prompt rows over T tokens of K2)."""
    n, k, k2 = draw(st.integers(0, 6)), draw(st.integers(0, 4)), draw(st.integers(0, 4))
    spans = draw(st.lists(st.integers(0, 5), max_size=4))
    t = sum(spans)

    def ints(*shape):
        return np.array(draw(st.lists(i32, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                        dtype=np.int32).reshape(shape)

    def reals(*shape):
        return np.array(draw(st.lists(f32, min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                        dtype=np.float32).reshape(shape)

    return StepResult(draw(i64), draw(columns), draw(floats), draw(st.text()), logprob_rows=ints(n),
                      sampled_logprobs=reals(n), sampled_ranks=ints(n), top_ids=ints(n, k), top_logprobs=reals(n, k),
                      prompt_rows=ints(len(spans)), prompt_starts=ints(len(spans)),
                      prompt_offsets=int32_column(np.cumsum([0, *spans])), prompt_token_logprobs=reals(t),
                      prompt_top_ids=ints(t, k2), prompt_top_logprobs=reals(t, k2))


def same(a, b) -> bool:
    """Field-by-field equality that understands numpy columns."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and b.dtype == a.dtype and b.dtype in (np.int32, np.float32)
                and a.shape == b.shape and np.array_equal(a, b))
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
@given(i64, st.integers(-1, 2**31 - 1), results(), st.booleans())
def test_result_round_trip(epoch, rank, result, fatal):
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


HEADER_SIZES = [0, 4, 16, 28, 44, 53]  # the fixed headers less their 4-byte prefix, and none


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(list(codec.MsgType)), st.sampled_from(HEADER_SIZES).flatmap(lambda n: st.binary(min_size=n,
       max_size=n)), st.lists(st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]), max_size=5))
def test_our_header_with_a_garbage_body_is_a_protocol_error(kind, tail, rest):
    """The hard case: magic, version and header size are right, so decoding goes deep into the body."""
    with contextlib.suppress(ProtocolError):
        decode([b"NP\x02" + bytes([kind]) + tail, *rest])


@settings(max_examples=300, deadline=None)
@given(descriptors(), st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
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
        decode([b"NP\x02\x63" + good[0][4:], *good[1:]])
    with pytest.raises(ProtocolError, match="frames"):
        decode(good[:2])
    with pytest.raises(ProtocolError, match="int32 values"):
        decode([good[0], good[1][:-4], *good[2:]])
    bad_offsets = bytearray(good[1])
    struct.pack_into("<i", bad_offsets, 4 * 6, 2)  # offsets [0, 2, 1]: not a CSR index
    with pytest.raises(ProtocolError, match="CSR"):
        decode([good[0], bytes(bad_offsets), *good[2:]])
    with pytest.raises(ProtocolError, match="new-request"):
        decode([*good[:3], b"\x00" * 8, good[4]])
    with pytest.raises(ProtocolError, match="bitmask"):
        decode([*good[:4], b"\x00" * 4])


def test_decoded_columns_are_int32_views_of_the_frame():
    """Zero copy on the hot path: the columns share the received buffer (and are read-only)."""
    desc = StepDescriptor(0, 0, slots=int32_column(range(256)), num_computed=int32_column(range(256)),
                          num_scheduled=int32_column([1] * 256), appended_offsets=int32_column([0] * 257))
    frames = wire(codec.encode_descriptor(desc))
    out = decode(frames)
    assert out.slots.dtype == np.int32 and not out.slots.flags.writeable
    assert np.shares_memory(out.slots, np.frombuffer(frames[1], np.int32))


def test_result_logprobs_round_trip_and_bad_csr_is_refused():
    result = StepResult(4, int32_column([7, 8]), logprob_rows=int32_column([1]), sampled_logprobs=f32_column([-0.5]),
                        sampled_ranks=int32_column([2]), top_ids=np.array([[3, -1]], np.int32),
                        top_logprobs=np.array([[-0.1, -np.inf]], np.float32), prompt_rows=int32_column([0]),
                        prompt_starts=int32_column([1]), prompt_offsets=int32_column([0, 2]),
                        prompt_token_logprobs=f32_column([-1.0, -2.0]), prompt_top_ids=np.array([[5], [6]], np.int32),
                        prompt_top_logprobs=np.array([[-0.2], [-0.3]], np.float32))
    frames = wire(codec.encode_result(result, 1, 0))
    assert same(decode(frames).result, result)
    bad = bytearray(frames[3])
    struct.pack_into("<i", bad, 4 * 6, 3)  # prompt_offsets [0, 3] over 2 tokens
    with pytest.raises(ProtocolError, match="CSR"):
        decode([*frames[:3], bytes(bad), frames[4]])
    with pytest.raises(ProtocolError, match="logprobs"):
        decode([*frames[:4], frames[4][:-4]])
    with pytest.raises(ValueError, match="top_ids"):
        codec.encode_result(StepResult(0, int32_column([1]), logprob_rows=int32_column([0]),
                                       sampled_logprobs=f32_column([0]), sampled_ranks=int32_column([1])), 0, 0)


def test_every_new_request_field_travels():
    spec = SamplingSpec(0.7, 5, 0.9, 0.05, 11, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
                        min_tokens=3, stop_ids=int32_column([2, 9]), logit_bias_ids=int32_column([4, 6]),
                        logit_bias_values=f32_column([100.0, -3.5]), logprobs=5, prompt_logprobs=0)
    desc = StepDescriptor(0, 2, [NewRequest(3, 1, int32_column([1, 2, 3, 4]), int32_column([7]), 0, spec, 3)],
                          slots=int32_column([1]), num_computed=int32_column([0]), num_scheduled=int32_column([4]),
                          appended_offsets=int32_column([0, 0]), copy_src=int32_column([7]),
                          copy_dst=int32_column([8]), bitmask_rows=int32_column([0]),
                          bitmask=np.array([[-1, 5]], np.int32))
    out = decode(wire(codec.encode_descriptor(desc)))
    assert same(out, desc)
    assert out.new_requests[0].sampling.logit_bias_values.dtype == np.float32
