"""The full sampling and output API over real gRPC, on both engine fronts (as tests/service/test_grpc_api.py):
penalties, min_tokens, logit_bias, logprobs and prompt logprobs, n parallel samples, stop details, the
finish reasons, structured output, and each bad value refused with INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from support.grpc_server import FRONTS, MAX_LEN, PROMPTS, ServerThread, rpc_error, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.controlplane.llm import LLM
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("sampling") / "tiny", arch="qwen3", seed=3))


@pytest.fixture(scope="module", params=FRONTS)
def server(model, request):
    s = ServerThread(model, front=request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def llm(model):
    llm = LLM(model, device="cpu", max_model_len=MAX_LEN, num_kvcache_blocks=64)
    yield llm
    llm.close()


def generate(stub, prompt: str = PROMPTS[2], **sampling) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(**sampling)), timeout=60))


def tokens(responses: list[pb.GenerateResponse], index: int = 0) -> list[int]:
    return [t for r in responses if r.index == index for t in r.token_ids]


def text(responses: list[pb.GenerateResponse], index: int = 0) -> str:
    return "".join(r.text for r in responses if r.index == index)


def test_penalties_match_the_embedded_engine(stub, llm):
    plain = tokens(generate(stub, temperature=0, max_tokens=24, ignore_eos=True))
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.5)
    got = tokens(generate(stub, temperature=0, max_tokens=24, ignore_eos=True, **penalties))
    [want] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties),
                          use_tqdm=False)
    assert got == want["token_ids"]
    assert got != plain, "the penalties changed nothing: they were not applied"


def test_min_tokens_masks_stop_ids_until_reached(stub):
    first = tokens(generate(stub, temperature=0, max_tokens=8))[0]
    assert tokens(generate(stub, temperature=0, max_tokens=8, stop_token_ids=[first])) == [first]
    got = tokens(generate(stub, temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[first]))
    assert len(got) == 8 and first not in got


def test_logit_bias_forces_a_token(stub, client):
    forced = 100
    responses = generate(stub, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0})
    assert tokens(responses) == [forced] * 6
    wait_idle(client)


def test_logprobs_equal_the_embedded_engines(stub, llm):
    responses = generate(stub, temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    [want] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
                          use_tqdm=False)
    assert tokens(responses) == want["token_ids"]
    got = [lp for r in responses for lp in r.logprobs]
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert [lp.token_id for lp in got] == want["token_ids"]
    for lp, expected in zip(got, want["logprobs"], strict=True):
        assert lp.rank == 1 and len(lp.top) == 3  # greedy: the sampled token is the most likely
        assert lp.top[0].token_id == lp.token_id
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert {t.token_id for t in lp.top} | {lp.token_id} == set(expected)
        for t in lp.top:
            assert t.logprob == pytest.approx(expected[t.token_id], abs=1e-4)


def test_prompt_logprobs_come_once_on_the_first_message(stub, client, llm):
    prompt_ids = client.tokenize(PROMPTS[1])
    responses = generate(stub, PROMPTS[1], temperature=0, max_tokens=4, prompt_logprobs=2)
    assert [len(r.prompt_logprobs) for r in responses] == [len(prompt_ids) - 1] + [0] * (len(responses) - 1)
    got = responses[0].prompt_logprobs
    assert [lp.token_id for lp in got] == prompt_ids[1:]
    [want] = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                          use_tqdm=False)
    assert want["prompt_logprobs"][0] is None
    for lp, expected in zip(got, want["prompt_logprobs"][1:], strict=True):
        assert len(lp.top) == 2 and lp.rank >= 0  # 0: the data plane did not rank it (outside the top)
        assert lp.logprob == pytest.approx(expected[lp.token_id], abs=1e-4)


def test_n_samples_share_one_stream_tagged_by_index(stub, client):
    responses = generate(stub, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, n=3)
    assert {r.index for r in responses} == {0, 1, 2}
    finals = [r for r in responses if r.finish_reason]
    assert sorted(r.index for r in finals) == [0, 1, 2]
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in finals)
    assert responses[-1].finish_reason and responses[-1].usage.completion_tokens == 30
    samples = [tokens(responses, i) for i in range(3)]
    assert all(len(s) == 10 for s in samples) and len({tuple(s) for s in samples}) > 1
    for i, sample in enumerate(samples):  # sample i draws with seed + i, as a request of its own would
        assert tokens(generate(stub, temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True)) == sample
    wait_idle(client)


def test_a_stop_string_ends_one_sample_while_the_others_go_on(server, stub, client, monkeypatch):
    stopped = []
    if server.in_process:  # the engine ends the stopped sample at once, not at max_tokens
        engine = server.server.front.loop.engine
        stop_on_string = engine.stop_on_string
        monkeypatch.setattr(engine, "stop_on_string",
                            lambda seq, s: (stopped.append((seq.sample_index, s)), stop_on_string(seq, s)))
    ref = generate(stub, temperature=1.0, seed=4, max_tokens=16, ignore_eos=True, n=2)
    first, second = text(ref, 0), text(ref, 1)
    start = next(i for i in range(2, len(first) - 3) if "\ufffd" not in first[i:i + 3] and first[i:i + 3] not in second)
    stop = first[start:start + 3]
    responses = generate(stub, temperature=1.0, seed=4, max_tokens=16, ignore_eos=True, n=2, stop=[stop])
    [end0] = [r for r in responses if r.index == 0 and r.finish_reason]
    assert end0.finish_reason == pb.FINISH_REASON_STOP and end0.stop_string == stop
    assert text(responses, 0) == first[:first.find(stop)]
    assert tokens(responses, 1) == tokens(ref, 1) and responses[-1].index == 1
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(client)
    assert stopped == ([(0, stop)] if server.in_process else [])


def _stop_string(stub) -> tuple[str, str]:
    """The greedy text of PROMPTS[2] and a 3-character piece of it to stop on."""
    full = text(generate(stub, temperature=0, max_tokens=40, ignore_eos=True))
    start = next(i for i in range(3, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    return full, full[start:start + 3]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_sample_and_names_itself(stub, client, include):
    full, stop = _stop_string(stub)
    responses = generate(stub, temperature=0, max_tokens=40, ignore_eos=True, stop=["never", stop],
                         include_stop_str_in_output=include)
    end = full.find(stop) + (len(stop) if include else 0)
    assert text(responses) == full[:end]
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.WhichOneof("stop_reason") == "stop_string"
    assert last.stop_string == stop
    wait_idle(client)  # the stopped request was aborted in the engine


def test_stop_token_id_is_the_stop_reason(stub):
    ids = tokens(generate(stub, temperature=0, max_tokens=20, ignore_eos=True))
    responses = generate(stub, temperature=0, max_tokens=20, stop_token_ids=[ids[5]])
    assert tokens(responses) == ids[:ids.index(ids[5]) + 1]
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.WhichOneof("stop_reason") == "stop_token_id"
    assert last.stop_token_id == ids[5]


def test_end_of_sequence_is_its_own_finish_reason(stub, client):
    [eos, *_] = client.model_info().eos_token_ids
    responses = generate(stub, temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    assert tokens(responses) == [eos]
    assert responses[-1].finish_reason == pb.FINISH_REASON_EOS and responses[-1].WhichOneof("stop_reason") is None


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "size": {"type": "integer"}},
          "required": ["colour", "size"], "additionalProperties": False}


@pytest.mark.parametrize("kind, value, check", [
    ("json_schema", json.dumps(SCHEMA),
     lambda t: set(json.loads(t)) == {"colour", "size"} and json.loads(t)["colour"] in ("red", "green")),
    ("json_object", True, lambda t: isinstance(json.loads(t), dict) and len(t) > 2),
    ("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)),
    ("choice", pb.Choices(choices=["alpha", "beta", "gamma"]), lambda t: t in ("alpha", "beta", "gamma")),
    ("grammar", 'start: "yes" | "no" | "maybe"', lambda t: t in ("yes", "no", "maybe")),
])
def test_structured_output(stub, client, kind, value, check):
    # Seed 5 has the tiny model close a JSON object with a key in it well within max_tokens (seed 2 does not).
    seed = 5 if kind == "json_object" else 2
    responses = generate(stub, PROMPTS[0], temperature=0.8, seed=seed, max_tokens=48, **{kind: value})
    last = responses[-1]  # a complete grammar ends the sample as STOP with no stop reason
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.WhichOneof("stop_reason") is None, text(responses)
    assert check(text(responses)), text(responses)
    wait_idle(client)


def test_cancel_mid_structured_output_frees_blocks_and_grammar(server, stub, client):
    # 400 digits cannot be done within 200 tokens: the grammar is mid-way when the call is cancelled.
    call = stub.Generate(pb.GenerateRequest(text=PROMPTS[1], sampling=pb.SamplingParams(
        temperature=1.0, seed=3, max_tokens=200, regex="[0-9]{400}")), timeout=60)
    first = [next(call) for _ in range(3)]
    assert all(r.token_ids and not r.finish_reason for r in first)  # running, past its first tokens
    call.cancel()
    wait_idle(client)
    if server.in_process:  # the engine drops the sequences that held the matchers
        engine = server.server.front.loop.engine
        assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("sampling, field", [
    (dict(n=-1), "parameter n="),
    (dict(n=0), "parameter n="),
    (dict(n=65), "parameter n="),
    (dict(logprobs=21), "parameter logprobs="),
    (dict(prompt_logprobs=21), "prompt_logprobs="),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema="[1, 2]"), "json_schema"),
    (dict(json_object=False), "json_object"),
    (dict(choice=pb.Choices()), "choice"),
])
def test_bad_values_name_their_field(stub, sampling, field):
    err = rpc_error(lambda: generate(stub, **sampling))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()


@pytest.mark.parametrize("sampling", [
    dict(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
    dict(regex="(unclosed"),
    dict(grammar="start: undefined_rule"),
])
def test_a_grammar_the_compiler_refuses_is_invalid_argument(stub, sampling):
    err = rpc_error(lambda: generate(stub, **sampling))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details()
