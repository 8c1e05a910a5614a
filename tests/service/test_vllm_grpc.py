"""vllm.grpc.engine.VllmEngine on the same port as nanoplane.v1, called with the stubs of PyPI's
smg-grpc-proto: every RPC, over a real server (both engine fronts) on a tiny random model.
SMG in front of `nanoplane serve` on the default model: tests/service/test_smg_gateway.py."""

from __future__ import annotations

import contextlib
import hashlib
import io
import threading
import time
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from support.grpc_server import FRONTS, MAX_LEN, PROMPTS, SEQS, ServerThread, rpc_error, serving, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.controlplane.grpc_server import SERVICE
from nanoplane.controlplane.vllm_servicer import SERVICE as VLLM_SERVICE
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", arch="qwen3", seed=3))


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
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def vllm(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def sampling(**kwargs) -> vpb.SamplingParams:
    return vpb.SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "skip_special_tokens": True,
                                 "spaces_between_special_tokens": True, **kwargs})


def generate(vllm, ids: list[int] | None = None, text: str | None = None, stream: bool = False,
             request_id: str = "", **kwargs) -> list[vpb.GenerateResponse]:
    request = vpb.GenerateRequest(request_id=request_id, sampling_params=sampling(**kwargs), stream=stream)
    if text is not None:
        request.text = text
    else:
        request.tokenized.input_ids.extend(ids)
    return list(vllm.Generate(request, timeout=60))


def completes(responses: list[vpb.GenerateResponse]) -> list[vpb.GenerateComplete]:
    return [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def test_reflection_and_health_list_both_services(channel, server):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, VLLM_SERVICE} <= names
    health = health_pb2_grpc.HealthStub(channel)
    for name in (SERVICE, VLLM_SERVICE):
        answer = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_greedy_tokens_equal_nanoplane_v1(vllm, client):
    for prompt in PROMPTS:
        ids = client.tokenize(prompt)
        want = [t for c in client.generate(ids, temperature=0, max_tokens=16, ignore_eos=True) for t in c.token_ids]
        (done,) = completes(generate(vllm, ids, ignore_eos=True))
        assert list(done.output_ids) == want
        assert done.finish_reason == "length" and done.completion_tokens == 16 and done.prompt_tokens == len(ids)
        streamed = generate(vllm, ids, stream=True, ignore_eos=True)
        chunks = [r.chunk for r in streamed if r.WhichOneof("response") == "chunk"]
        assert [t for c in chunks for t in c.token_ids] == want
        assert all(c.prompt_tokens == len(ids) for c in chunks)
        assert sum(c.completion_tokens for c in chunks) == 16  # deltas, as vLLM's servicer counts them
        assert streamed[-1].WhichOneof("response") == "complete" and streamed[-1].complete.finish_reason == "length"
    wait_idle(client)


def test_text_input_is_tokenized_as_nanoplane_v1(vllm, client):
    (by_text,) = completes(generate(vllm, text=PROMPTS[1]))
    (by_ids,) = completes(generate(vllm, client.tokenize(PROMPTS[1])))
    assert by_text.prompt_tokens == by_ids.prompt_tokens and list(by_text.output_ids) == list(by_ids.output_ids)


def test_repeated_prompt_reports_cached_tokens_and_flush_drops_them(vllm, client):
    ids = client.tokenize(PROMPTS[0] * 8)[:40]  # over two blocks of 16
    generate(vllm, ids, max_tokens=2)
    (again,) = completes(generate(vllm, ids, max_tokens=2))
    assert again.cached_tokens >= 32
    wait_idle(client)
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5))
    assert flushed.success, flushed.message
    (after,) = completes(generate(vllm, ids, max_tokens=2))
    assert after.cached_tokens == 0


def test_flush_keeps_what_a_running_request_holds(vllm, client, server):
    ids = client.tokenize(PROMPTS[2] * 12)[:40]
    assert len(ids) == 40
    request = vpb.GenerateRequest(request_id="hold", sampling_params=sampling(max_tokens=MAX_LEN - 60, ignore_eos=True),
                                  stream=True, tokenized=vpb.TokenizedInput(input_ids=ids))
    stream = vllm.Generate(request, timeout=60)
    next(stream)  # running now, its two full prompt blocks cached
    flushed = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    assert flushed.success, flushed.message
    (again,) = completes(generate(vllm, ids, max_tokens=2))  # the held blocks are still found
    assert again.cached_tokens >= 32
    vllm.Abort(vpb.AbortRequest(request_ids=["hold"]))
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    wait_idle(client)
    assert vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5)).success
    (after,) = completes(generate(vllm, ids, max_tokens=2))
    assert after.cached_tokens == 0


def test_abort_ends_the_stream_and_frees_blocks(vllm, client):
    request = vpb.GenerateRequest(request_id="to-abort", stream=True,
                                  sampling_params=sampling(max_tokens=MAX_LEN - 40, ignore_eos=True),
                                  tokenized=vpb.TokenizedInput(input_ids=client.tokenize(PROMPTS[0])))
    stream = vllm.Generate(request, timeout=60)
    first = next(stream)
    assert first.chunk.token_ids
    vllm.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown-id"]))
    last = list(stream)[-1]
    assert last.complete.finish_reason == "abort" and last.complete.completion_tokens < MAX_LEN - 40
    wait_idle(client)
    (load,) = vllm.GetLoads(vpb.GetLoadsRequest()).loads
    assert load.num_running_reqs == 0 and load.num_used_tokens == 0


def test_cancelling_the_call_frees_blocks(vllm, client):
    request = vpb.GenerateRequest(stream=True, sampling_params=sampling(max_tokens=MAX_LEN - 40, ignore_eos=True),
                                  tokenized=vpb.TokenizedInput(input_ids=client.tokenize(PROMPTS[1])))
    call = vllm.Generate(request, timeout=60)
    next(call)
    assert vllm.GetLoads(vpb.GetLoadsRequest()).loads[0].num_used_tokens > 0
    call.cancel()
    wait_idle(client)


def test_n_samples_logprobs_and_prompt_logprobs(vllm, client):
    ids = client.tokenize(PROMPTS[0])
    for stream in (False, True):
        responses = generate(vllm, ids, stream=stream, n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                             logprobs=3, prompt_logprobs=2)
        done = sorted(completes(responses), key=lambda c: c.index)
        assert [c.index for c in done] == [0, 1]
        if stream:
            chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
            outputs = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in (0, 1)}
            logprobs = {i: [x for c in chunks if c.index == i for x in c.output_logprobs.token_ids] for i in (0, 1)}
            prompt = [c.input_logprobs for c in chunks if c.HasField("input_logprobs")]
        else:
            outputs = {c.index: list(c.output_ids) for c in done}
            logprobs = {c.index: list(c.output_logprobs.token_ids) for c in done}
            prompt = [done[0].input_logprobs]
            assert all(len(c.output_logprobs.top_logprobs) == 6 for c in done)
            assert all(len(top.values) == 3 for c in done for top in c.output_logprobs.top_logprobs)
        assert all(len(outputs[i]) == 6 and logprobs[i] == outputs[i] for i in (0, 1))
        assert outputs[0] != outputs[1]  # seed + index
        assert list(prompt[0].token_ids) == ids
        assert not prompt[0].token_logprobs[0].HasField("value")
        assert all(x.HasField("value") and x.value <= 0 for x in prompt[0].token_logprobs[1:])
    wait_idle(client)


def test_stop_token_and_stop_string_are_matched(vllm, client, server):
    ids = client.tokenize(PROMPTS[1])
    (free,) = completes(generate(vllm, ids, ignore_eos=True))
    token = free.output_ids[3]
    (by_id,) = completes(generate(vllm, ids, ignore_eos=True, stop_token_ids=[token]))
    assert by_id.finish_reason == "stop" and by_id.matched_token_id == token
    assert list(by_id.output_ids) == list(free.output_ids[:list(free.output_ids).index(token) + 1])
    text = server.server.tokenizer.decode(list(free.output_ids))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        (by_text,) = completes(generate(vllm, ids, ignore_eos=True, stop=[stop]))
        assert by_text.finish_reason == "stop" and by_text.matched_stop_str == stop
        assert by_text.completion_tokens < 16


def test_choice_constraint(vllm, client, server):
    ids = client.tokenize(PROMPTS[2])
    (done,) = completes(generate(vllm, ids, choice=vpb.ChoiceConstraint(choices=["yes", "no"])))
    assert server.server.tokenizer.decode(list(done.output_ids), skip_special_tokens=True) in ("yes", "no")


def test_penalties_bias_and_min_tokens_reach_the_engine(vllm, client):
    ids = client.tokenize(PROMPTS[0])
    (plain,) = completes(generate(vllm, ids, ignore_eos=True, max_tokens=4))
    banned = plain.output_ids[0]
    (biased,) = completes(generate(vllm, ids, ignore_eos=True, max_tokens=4, logit_bias={banned: -100.0}))
    assert biased.output_ids[0] != banned
    (held,) = completes(generate(vllm, ids, max_tokens=8, min_tokens=8, stop_token_ids=[banned]))
    assert held.completion_tokens == 8


@pytest.mark.parametrize("build, code, words", [
    (lambda r: r.mm_inputs.mm_hashes.append("x"), grpc.StatusCode.UNIMPLEMENTED, "mm_inputs"),
    (lambda r: r.media_refs.items.add(url="http://x"), grpc.StatusCode.UNIMPLEMENTED, "media_refs"),
    (lambda r: setattr(r, "kv_transfer_params_json", "{}"), grpc.StatusCode.UNIMPLEMENTED, "KV transfer"),
    (lambda r: r.kv_transfer_params.SetInParent(), grpc.StatusCode.UNIMPLEMENTED, "KV transfer"),
    (lambda r: setattr(r.sampling_params, "structural_tag", "{}"), grpc.StatusCode.UNIMPLEMENTED, "structural_tag"),
    (lambda r: setattr(r, "data_parallel_rank", 1), grpc.StatusCode.INVALID_ARGUMENT, "data_parallel_rank"),
    (lambda r: setattr(r.sampling_params, "logprobs", -1), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (lambda r: setattr(r.sampling_params, "prompt_logprobs", 21), grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs"),
    (lambda r: setattr(r.sampling_params, "truncate_prompt_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT,
     "truncate_prompt_tokens"),
    (lambda r: setattr(r.sampling_params, "temperature", -1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (lambda r: setattr(r.sampling_params, "n", 65), grpc.StatusCode.INVALID_ARGUMENT, "n="),
    (lambda r: setattr(r.sampling_params, "json_schema", "{not json"), grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    (lambda r: r.sampling_params.logit_bias.update({-3: 1.0}), grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
    (lambda r: r.ClearField("tokenized"), grpc.StatusCode.INVALID_ARGUMENT, "no input"),
    (lambda r: r.tokenized.ClearField("input_ids"), grpc.StatusCode.INVALID_ARGUMENT, "input_ids is empty"),
    (lambda r: r.tokenized.input_ids.extend([10**6]), grpc.StatusCode.INVALID_ARGUMENT, "token ids must be"),
    (lambda r: setattr(r.sampling_params, "max_tokens", MAX_LEN), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
])
def test_refused_fields_are_named(vllm, build, code, words):
    request = vpb.GenerateRequest(sampling_params=sampling(), tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]))
    build(request)
    err = rpc_error(lambda: list(vllm.Generate(request, timeout=30)))
    assert err.code() == code and words in err.details(), err.details()


def test_truncate_prompt_tokens_keeps_the_last_tokens(vllm, client):
    ids = client.tokenize(PROMPTS[0] + " " + PROMPTS[1])
    (cut,) = completes(generate(vllm, ids, truncate_prompt_tokens=4))
    (tail,) = completes(generate(vllm, ids[-4:]))
    assert cut.prompt_tokens == 4 and list(cut.output_ids) == list(tail.output_ids)


def test_unsupported_rpcs_name_what_is_missing(vllm):
    for call, words in ((lambda: vllm.Embed(vpb.EmbedRequest()), "embeddings"),
                        (lambda: vllm.StartProfile(common_pb2.StartProfileRequest()), "profiling"),
                        (lambda: vllm.StopProfile(common_pb2.StopProfileRequest()), "profiling")):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED and words in err.details()


def test_health_model_server_info_and_loads(vllm, server, model):
    assert vllm.HealthCheck(vpb.HealthCheckRequest()).healthy
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.is_generation and info.max_context_length == MAX_LEN and info.vocab_size > 0
    assert info.model_path == model and info.tokenizer_path == model and info.served_model_name == "tiny"
    assert list(info.eos_token_ids) == list(server.server.tokenizer.eos_token_ids)
    assert info.model_type == "qwen3" and list(info.architectures) == ["Qwen3ForCausalLM"]
    server_info = vllm.GetServerInfo(vpb.GetServerInfoRequest())
    assert server_info.server_type == "vllm-grpc" and server_info.block_size == 16
    assert server_info.max_num_seqs == SEQS and server_info.data_parallel_size == 1
    assert server_info.uptime_seconds > 0 and server_info.model_dtype == "torch.float32"
    loads = vllm.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    assert loads.loads[0].max_running_requests == SEQS
    assert rpc_error(lambda: vllm.GetLoads(vpb.GetLoadsRequest(dp_rank=2))).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenizer_zip_and_its_digest(vllm, model):
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1]) and all(len(c.data) <= 64 * 1024 for c in chunks)
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "config.json" in names


def test_kv_events_stream_stored_blocks(vllm, client):
    got: list[common_pb2.KvEventBatch] = []
    call = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30)

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # CANCELLED, by the call.cancel() below
            got.extend(call)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)
    generate(vllm, client.tokenize(PROMPTS[0] * 8)[:40], max_tokens=2)
    deadline = time.monotonic() + 10
    while not any(e.HasField("stored") for b in got for e in b.events):
        assert time.monotonic() < deadline, "no BlockStored event arrived"
        time.sleep(0.05)
    call.cancel()
    stored = [e.stored for b in got for e in b.events if e.HasField("stored")]
    assert all(len(block.token_ids) == 16 and block.block_size == 16 for s in stored for block in s.blocks)
    assert got[0].sequence_number == 1 and got[0].events[0].HasField("cleared")  # the snapshot comes first


def test_nanoplane_v1_still_answers_beside(client):
    assert [t for c in client.generate(PROMPTS[0], temperature=0, max_tokens=4) for t in c.token_ids]
    assert isinstance(client.server_status(), pb.ServerStatus)


def test_kv_events_off_answers_unimplemented(model):
    """As vLLM's servicer answers when its events are off: the gateway then polls GetLoads."""
    with serving(model, kv_events="off") as (s, _), grpc.insecure_channel(s.address) as ch:
        call = vllm_engine_pb2_grpc.VllmEngineStub(ch).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        err = rpc_error(lambda: next(call))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "--kv-events on" in err.details()


def test_each_of_n_samples_stops_on_its_stop_string(vllm, client, server):
    ids = client.tokenize(PROMPTS[1])
    samples = completes(generate(vllm, ids, ignore_eos=True, n=3, temperature=1.0, seed=2, max_tokens=24))
    text = server.server.tokenizer.decode(list(samples[0].output_ids))
    stop = next(piece for piece in (text[i:i + 2] for i in range(2, len(text) - 2))
                if piece.strip() and "\ufffd" not in piece)
    for stream in (False, True):
        responses = generate(vllm, ids, stream=stream, ignore_eos=True, n=3, temperature=1.0, seed=2, max_tokens=24,
                             stop=[stop])
        done = {c.index: c for c in completes(responses)}
        assert sorted(done) == [0, 1, 2]
        assert done[0].finish_reason == "stop" and done[0].matched_stop_str == stop
        for c in done.values():  # each ends on the stop string or runs to its length, on its own
            assert (c.finish_reason, c.matched_stop_str) in (("stop", stop), ("length", ""))
    wait_idle(client)
