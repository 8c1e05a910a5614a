"""The public gRPC API end to end: a real grpc.aio server on 127.0.0.1 (ephemeral port), a tiny
random model, and the Python client library; each test runs against both engine fronts (the engine
in this process over an in-process data plane, and the default layout: the engine in its own
process, a data plane process attached to it). What happens when calls are cancelled or the data
plane fails: tests/service/test_grpc_failures.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.grpc_server import BLOCKS, FRONTS, MAX_LEN, PROMPTS, ServerThread, rpc_error, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import AsyncClient, Client
from nanoplane.controlplane.grpc_server import SERVICE
from nanoplane.controlplane.llm import LLM
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("grpc") / "tiny", arch="qwen3", seed=3))


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


def test_greedy_stream_matches_embedded_llm(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        chunks = list(client.generate(prompt, temperature=0, max_tokens=24))
        assert [t for c in chunks for t in c.token_ids] == want["token_ids"]
        assert "".join(c.text for c in chunks) == want["text"]
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].finish_reason in (("length",) if len(want["token_ids"]) == 24 else ("eos", "stop"))
        prompt_tokens = len(client.tokenize(prompt))
        assert chunks[0].usage.prompt_tokens == prompt_tokens
        assert chunks[-1].usage.completion_tokens == len(want["token_ids"])
    wait_idle(client)


def test_64_concurrent_streams(server, client):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(64)]

    async def run():
        async with AsyncClient(server.address) as ac:
            return await ac.generate_batch(prompts, max_concurrency=64, use_tqdm=False, max_tokens=12,
                                           ignore_eos=True, temperature=0.8, seed=7)

    done = asyncio.run(run())
    assert len(done) == 64
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in done)
    assert all(c.usage.completion_tokens == 12 for c in done)
    wait_idle(client)


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(), "no prompt"),
    (dict(text=""), "empty"),
    (dict(token_ids=pb.TokenIds()), "empty"),
    (dict(token_ids=pb.TokenIds(ids=[5, 10**6])), "token ids must be"),
    (dict(token_ids=pb.TokenIds(ids=[5] * 300)), "max_model_len"),
    (dict(messages=pb.ChatMessages()), "messages is empty"),
    (dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")])), "no role"),
    (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(text="hi", sampling=pb.SamplingParams(max_tokens=MAX_LEN)), "max_model_len"),
    (dict(text="hi", sampling=pb.SamplingParams(min_p=1.5)), "min_p"),
    (dict(text="hi", sampling=pb.SamplingParams(top_k=-2)), "top_k"),
    (dict(text="hi", sampling=pb.SamplingParams(seed=2**63)), "seed"),
    (dict(text="hi", sampling=pb.SamplingParams(stop=["ok", ""])), "stop"),
    (dict(text="hi", sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty"),
    (dict(text="hi", sampling=pb.SamplingParams(stop=["s"] * 65)), "at most 64 stop strings"),
    (dict(text="hi", sampling=pb.SamplingParams(stop=["s" * 1025])), "at most 1024 characters"),
    (dict(text="hi", sampling=pb.SamplingParams(stop_token_ids=[1] * 1025)), "stop_token_ids"),
    (dict(text="hi", request_id="r" * 257), "request_id"),
    # Refused on its length alone, before seconds of tokenizing on the loop every stream shares.
    (dict(text="x" * 1_000_000), "characters) is longer than max_model_len"),
    # The same for a chat: roles count, and a flood of messages is refused on its count.
    (dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="x" * 1_000_000, content="hi")])),
     "characters) is longer than max_model_len"),
    (dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * (MAX_LEN + 1))),
     f"{MAX_LEN + 1} messages cannot fit max_model_len"),
    # Under that bound but far over the limit: refused once its first pieces hold too many tokens,
    # without encoding the whole text (hundreds of MB a request at a real model's max_model_len).
    (dict(text="a b " * (MAX_LEN * 4)), f"characters) has more than max_model_len {MAX_LEN} tokens"),
    (dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a b " * (MAX_LEN * 4))])),
     f"characters) has more than max_model_len {MAX_LEN} tokens"),
])
def test_invalid_requests(stub, request_kwargs, message):
    err = rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(**request_kwargs))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()


def test_tokenizing_does_not_stall_the_event_loop(server, client, monkeypatch):
    """Tokenizing runs off the event loop that serves every stream: while a slow tokenization runs (a
    stand-in for a long prompt's second of work), other calls are still answered."""
    tokenizer = server.server.tokenizer
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: (time.sleep(1.0), encode(text))[1])
    with grpc.insecure_channel(server.address) as channel:
        start = time.monotonic()
        call = pb_grpc.GenerationStub(channel).Tokenize.future(pb.TokenizeRequest(text=PROMPTS[1]))
        waits = []
        while not call.done():
            t = time.monotonic()
            client.server_status()  # answered on the event loop
            waits.append(time.monotonic() - t)
        took = time.monotonic() - start
        assert list(call.result().token_ids) == encode(PROMPTS[1])
    assert len(waits) > 3 and max(waits) < 0.25, f"a status call waited {max(waits):.2f} s of {took:.2f} s"


def test_tokenize_refuses_text_no_prompt_could_hold(stub):
    """Tokenize answers for prompts: a text longer than max_model_len tokens can hold is refused at once,
    as Generate refuses it, rather than tokenized into a reply larger than a client accepts."""
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="the quick brown fox " * 200_000)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters) is longer than max_model_len" in err.details()
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(text="a b " * (MAX_LEN * 4))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"has more than max_model_len {MAX_LEN} tokens" in err.details()


def test_client_keepalive_pings_keep_the_connection(server):
    """Clients and meshes ping every few seconds; gRPC's default server policy answers pings more
    frequent than every 5 minutes with GOAWAY too_many_pings, which ends every stream on the
    connection. The server accepts them."""
    options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(server.address, options=options) as channel:
        channel.subscribe(states.append, try_to_connect=True)
        grpc.channel_ready_future(channel).result(timeout=10)
        time.sleep(5)  # ~5 pings; the default policy sends GOAWAY after the third
        stub = pb_grpc.GenerationStub(channel)
        assert stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=10).data_plane_ready
        channel.unsubscribe(states.append)
    ready = states.index(grpc.ChannelConnectivity.READY)
    assert states[ready:] == [grpc.ChannelConnectivity.READY], f"the connection was dropped: {states}"


def test_stop_strings_and_stop_tokens(client):
    ref = list(client.generate(PROMPTS[2], temperature=0, max_tokens=40, ignore_eos=True))
    text, ids = "".join(c.text for c in ref), [t for c in ref for t in c.token_ids]
    start = next(i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    chunks = list(client.generate(PROMPTS[2], temperature=0, max_tokens=40, ignore_eos=True, stop=["never", stop]))
    assert "".join(c.text for c in chunks) == text[:text.find(stop)]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens < 40
    assert client.generate_text(PROMPTS[2], temperature=0, max_tokens=40, ignore_eos=True, stop=["\n\n\0"]) == text
    wait_idle(client)  # the stopped request was aborted in the engine
    stop_id = ids[5]
    got = [t for c in client.generate(PROMPTS[2], temperature=0, max_tokens=40, stop_token_ids=[stop_id])
           for t in c.token_ids]
    assert got == ids[:ids.index(stop_id) + 1]


def test_chat_messages(client, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo ☃"}]
    want_ids = llm.tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want_ids = list(want_ids if isinstance(want_ids, list) else want_ids["input_ids"])  # BatchEncoding in v5
    assert client.tokenize(messages=messages) == want_ids
    expected = llm.generate([want_ids], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    chunks = list(client.generate(messages=messages, temperature=0, max_tokens=16))
    assert [t for c in chunks for t in c.token_ids] == expected["token_ids"]
    assert chunks[0].usage.prompt_tokens == len(want_ids)


def test_model_info_and_tokenize(client, llm):
    info = client.model_info()
    assert (info.model, info.architecture, info.max_model_len, info.vocab_size) == ("tiny", "Qwen3ForCausalLM",
                                                                                    MAX_LEN, 384)
    assert info.tensor_parallel_size == 1 and info.kv_block_size == 16 and info.has_chat_template
    assert info.kv_capacity_tokens == BLOCKS * 16
    assert list(info.eos_token_ids) == [llm.tokenizer.hf.eos_token_id]
    assert client.tokenize("the quick ☃") == llm.tokenizer.encode("the quick ☃")
    status = client.server_status()
    assert status.kv_blocks_total == BLOCKS and status.data_plane_ready


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING" and client.health(SERVICE) == "SERVING" and client.health("") == "SERVING"
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"nanoplane.v1.Generation", "grpc.health.v1.Health"} <= names


def test_garbage_bytes_and_unknown_fields(server, client):
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_stream(f"/{SERVICE}/Generate")  # no serializers: bytes go out as they are
        err = rpc_error(lambda: list(raw(b"\xff\xfe\x00garbage")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in err.details()
        # An unknown field (number 99, varint) is skipped, as protobuf does for newer clients.
        request = pb.GenerateRequest(text="the", sampling=pb.SamplingParams(max_tokens=3)).SerializeToString()
        replies = list(raw(request + b"\x98\x06\x01"))
        assert pb.GenerateResponse.FromString(replies[-1]).finish_reason != pb.FINISH_REASON_UNSPECIFIED
        # Health and reflection too: INVALID_ARGUMENT, not UNKNOWN (and no traceback in the log).
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        err = rpc_error(lambda: check(b"\xff\xfe\x00garbage"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in err.details()
        reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        err = rpc_error(lambda: list(reflect(iter([b"\xff\xfe\x00garbage"]))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in err.details()
    assert len(client.generate_text("the quick", max_tokens=3, ignore_eos=True)) > 0
    wait_idle(client)


def test_idle_engine_sleeps(server, client):
    """An idle engine spends no CPU: its thread (in-process), or its whole process, sleeps."""
    wait_idle(client)
    if server.in_process:
        stat = f"/proc/self/task/{server.server.front.loop._thread.native_id}/stat"
    else:
        stat = f"/proc/{server.server.front._process.pid}/stat"
    if not Path(stat).exists():
        pytest.skip("needs Linux /proc")

    def cpu_ticks() -> int:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 2  # clock ticks (1/100 s): asleep, not spinning
