"""The engine link (serving process <-> engine process): every message round-trips exactly, anything
else decodes to a LinkError (never another exception), and errors cross it as a kind and a message."""

from __future__ import annotations

import dataclasses
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoplane.controlplane import engine_process
from nanoplane.controlplane.errors import DataPlaneUnavailable, RequestIdInUse, failure_error, failure_kind
from nanoplane.controlplane.front import Output
from nanoplane.controlplane.front_process import sampling_to_link
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob
from nanoplane.proto import engine_link as link

ints = st.integers(-(2**63), 2**63 - 1)
counts = st.integers(0, 2**31 - 1)
token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=40)
floats = st.floats(allow_nan=False)
texts = st.text(max_size=60)

optional_counts = st.none() | counts
structured = st.none() | st.sampled_from([{"json_schema": '{"type": "object"}'}, {"json_object": True},
                                          {"regex": "[0-9]+"}, {"choice": ["yes", "no"]}, {"grammar": "start: 'x'"}])
samplings = st.builds(link.Sampling, floats, floats, ints, floats, counts, st.none() | ints, st.booleans(),
                      token_lists, counts, st.lists(texts, max_size=3), st.booleans(), st.booleans(), st.booleans(),
                      floats, floats, floats, st.dictionaries(counts, floats, max_size=4), optional_counts,
                      optional_counts, counts, structured)
top = st.lists(st.tuples(counts, floats), max_size=3)
logprobs = st.builds(link.Logprob, counts, floats, counts, top)
commands = st.one_of(
    st.builds(link.Add, counts, token_lists, samplings, st.none() | floats),
    st.builds(link.Abort, counts, st.booleans()),
    st.builds(link.StopSample, counts, counts, texts),
    st.builds(link.SetReady, st.booleans(), texts),
    st.just(link.Stop()))
deltas = st.builds(link.Delta, counts, token_lists, st.booleans(),
                   st.sampled_from([None, "stop", "eos", "length", "abort"]), counts, counts, counts, counts,
                   st.none() | st.lists(logprobs, max_size=3), st.none() | st.lists(st.none() | logprobs, max_size=3),
                   st.none() | counts | texts)
failures = st.builds(link.Failure, counts, st.sampled_from(link.FAILURE_KINDS), texts)
facts = st.builds(link.Facts, texts, counts, counts, counts, counts, counts)
events = st.one_of(
    st.builds(link.Outputs, st.lists(deltas | failures, max_size=20)),
    st.just(link.Beat()),
    st.builds(link.Status, counts, counts, counts, counts, st.booleans()),
    st.builds(link.Stats, counts, counts, counts, counts, st.lists(floats, max_size=20), st.lists(floats, max_size=20),
              ints, st.lists(floats, max_size=8)),
    st.builds(link.Readiness, st.booleans(), st.none() | facts, texts))


def _decodes_or_refuses(decode, frame: bytes) -> None:
    """The only acceptable outcomes for arbitrary bytes: a typed message, or LinkError."""
    try:
        message = decode(frame)
    except link.LinkError:
        return
    assert isinstance(message, (*typing.get_args(link.Command), *typing.get_args(link.Event)))


@settings(max_examples=300, deadline=None)
@given(commands)
def test_command_round_trip(command):
    assert link.decode_command(link.encode(command)) == command


@settings(max_examples=300, deadline=None)
@given(events)
def test_event_round_trip(event):
    assert link.decode_event(link.encode(event)) == event


def test_a_command_is_not_an_event_and_back():
    with pytest.raises(link.LinkError, match="malformed engine-link event"):
        link.decode_event(link.encode(link.Abort(3, True)))
    with pytest.raises(link.LinkError, match="malformed engine-link command"):
        link.decode_command(link.encode(link.Beat()))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_a_link_error(frame):
    _decodes_or_refuses(link.decode_command, frame)
    _decodes_or_refuses(link.decode_event, frame)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_our_header_with_a_random_body_is_refused_or_decodes(body):
    _decodes_or_refuses(link.decode_command, link.MAGIC + bytes([link.VERSION]) + body)
    _decodes_or_refuses(link.decode_event, link.MAGIC + bytes([link.VERSION]) + body)


@settings(max_examples=500, deadline=None)
@given(st.one_of(commands, events), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                              max_size=4), st.integers(0, 10**6))
def test_a_mutated_message_is_refused_or_decodes(message, flips, cut):
    frame = bytearray(link.encode(message))
    for at, value in flips:
        frame[3 + at % max(1, len(frame) - 3)] = value  # the body: a changed header is refused below
    for mutated in (bytes(frame), bytes(frame[:3 + cut % len(frame)])):
        _decodes_or_refuses(link.decode_command, mutated)
        _decodes_or_refuses(link.decode_event, mutated)


def test_rejections_say_what_is_wrong():
    frame = link.encode(link.Beat())
    with pytest.raises(link.LinkError, match="too short"):
        link.decode_event(b"NE")
    with pytest.raises(link.LinkError, match="not an engine-link message"):
        link.decode_event(b"XX" + frame[2:])
    other = link.VERSION - 1
    with pytest.raises(link.LinkError, match=f"version {other}, this side speaks {link.VERSION}: run the same "
                       "nanoplane release"):
        link.decode_event(frame[:2] + bytes([other]) + frame[3:])
    bad_kind = msgspec.msgpack.encode(["Outputs", [["Failure", 1, "bogus", "x"]]])
    with pytest.raises(link.LinkError, match="Invalid enum value 'bogus'"):
        link.decode_event(frame[:3] + bad_kind)
    bad_reason = msgspec.msgpack.encode(["Outputs", [["Delta", 1, [5], True, "tired", 1, 1, 0]]])
    with pytest.raises(link.LinkError, match="Invalid enum value 'tired'"):
        link.decode_event(frame[:3] + bad_reason)


def test_sampling_carries_every_field_of_the_engines_parameters_both_ways():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, max_tokens=9, min_tokens=2, seed=3,
                            stop_token_ids=[7], stop=["x"], include_stop_str_in_output=True,
                            skip_special_tokens=False, spaces_between_special_tokens=False, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.5, logit_bias={4: 100.0}, logprobs=3,
                            prompt_logprobs=2, n=4, structured={"choice": ["a", "b"]})
    assert set(link.Sampling.__struct_fields__) == {f.name for f in dataclasses.fields(SamplingParams)}
    wire = link.decode_command(link.encode(link.Add(1, [5], sampling_to_link(params), None)))
    assert engine_process.sampling_from_link(wire.sampling) == params


def test_outputs_carry_the_sample_index_logprobs_and_stop_reason():
    lp = Logprob(5, -0.25, 1, [(5, -0.25), (6, -2.0)])
    out = Output("r", [5], True, FinishReason.STOP, 3, 1, 0, 2, [lp], [None, lp], "stop here")
    [delta] = link.decode_event(link.encode(engine_process.outputs_event([(_Stream(7), out)]))).items
    assert (delta.index, delta.finish_reason, delta.stop_reason) == (2, "stop", "stop here")
    assert delta.logprobs == [link.Logprob(5, -0.25, 1, [(5, -0.25), (6, -2.0)])]
    assert delta.prompt_logprobs == [None, delta.logprobs[0]]


def test_failure_kinds_are_the_schemas():
    kind = typing.get_type_hints(link.Failure)["kind"]
    assert set(typing.get_args(kind)) == set(link.FAILURE_KINDS)


@pytest.mark.parametrize("error, kind, raised", [
    (ValueError("prompt token 0 is -1"), link.INVALID, ValueError),
    (RequestIdInUse("request_id 'x' is already in use"), link.ID_IN_USE, RequestIdInUse),
    (DataPlaneUnavailable("the data plane is not available (rank 1 died)"), link.UNAVAILABLE, DataPlaneUnavailable),
    (KeyError("a bug"), link.INTERNAL, RuntimeError),
])
def test_errors_cross_the_link_as_a_kind_and_a_message(error, kind, raised):
    wire = link.decode_event(link.encode(engine_process.outputs_event([(_Stream(7), error)])))
    [failure] = wire.items
    assert (failure.key, failure.kind, failure.message) == (7, kind, str(error))
    again = failure_error(failure.kind, failure.message)
    assert type(again) is raised and str(again) == str(error)
    assert failure_kind(again) == kind


class _Stream:
    """The one field outputs_event reads: in the engine process a stream's id is its key."""

    def __init__(self, key: int):
        self.request_id = key


def test_launch_round_trip_and_version_check():
    launch = link.Launch(link.VERSION, {"model": "/m", "max_num_seqs": 8, "cpu_kvcache_gib": 2.0,
                                        "enforce_eager": False}, "ipc:///p", "ipc:///c", "ipc:///e", [2, 3], 1.0, 2.0)
    assert link.decode_launch(link.encode_launch(launch)) == launch
    with pytest.raises(link.LinkError, match=f"version 9, this engine process speaks {link.VERSION}"):
        link.decode_launch(link.encode_launch(msgspec.structs.replace(launch, version=9)))
    with pytest.raises(link.LinkError, match="malformed engine-process launch"):
        link.decode_launch("{not json")


def test_the_engine_process_refuses_a_bad_launch_with_a_message(capsys):
    assert engine_process.main(["{}"]) == 2
    assert "malformed engine-process launch" in capsys.readouterr().err
    assert engine_process.main([]) == 2
