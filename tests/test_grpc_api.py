"""The public gRPC API end to end: a real grpc.aio server on 127.0.0.1 (ephemeral port), a tiny
random model, the in-process data plane, and the Python client library."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny_models import make_tiny_model

from clients import AsyncClient, Client
from controlplane.config import EngineConfig
from controlplane.engine import Engine
from controlplane.errors import DataPlaneUnavailable, RequestIdInUse
from controlplane.llm import LLM
from controlplane.sampling_params import SamplingParams
from controlplane.server import SERVICE, build_server
from controlplane.stream import REQUEST_ID_GRACE_S, wait_for_free_id
from dataplane.config import DataPlaneConfig
from dataplane.local import LocalDataPlane
from proto.nanoplane.v1 import generation_pb2 as pb
from proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc

PROMPTS = ["héllo wörld ☃ 東京 🙂", "the quick brown fox", "paged attention keeps"]
MAX_LEN, BLOCKS, SEQS = 256, 256, 64


class FlakyDataPlane:
    """LocalDataPlane that can lose step results, as a crashed transport would."""

    def __init__(self, inner: LocalDataPlane):
        self.inner, self.fail = inner, False
        self.error: type[Exception] = ConnectionError
        self.delay = 0.0  # seconds each step takes longer (a slow data plane)

    def start(self):
        return self.inner.start()

    def execute(self, desc):
        time.sleep(self.delay)
        result = self.inner.execute(desc)  # the rank computed the step; only the answer is lost
        if self.fail:
            raise self.error("rank 0 stopped answering")
        return result

    def close(self):
        self.inner.close()


class ServerThread:
    """A server on its own event loop in a daemon thread, so tests can use the blocking client."""

    def __init__(self, model: str, flaky: bool = False):
        cfg = EngineConfig(model, device="cpu", max_model_len=MAX_LEN, num_kvcache_blocks=BLOCKS, max_num_seqs=SEQS)
        plane = LocalDataPlane(DataPlaneConfig(model=model, device="cpu", max_num_seqs=SEQS, max_model_len=MAX_LEN,
                                               block_size=cfg.kvcache_block_size, num_kvcache_blocks=BLOCKS))
        self.plane = FlakyDataPlane(plane) if flaky else plane
        self.restarts = 0
        self.server = build_server(cfg, self.plane, recover=self.restart if flaky else None, recover_interval_s=0.05)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            started.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(60)
        self.address = f"127.0.0.1:{self.server.port}"

    def restart(self, old: Engine) -> Engine | None:
        """The recover hook: once the plane works again, a new engine over a restarted rank 0 (fresh
        model runner, step 0), as a transport re-attaching to a restarted launch would give."""
        if self.plane.fail:
            return None
        self.restarts += 1
        return Engine(old.config, old.data_plane, tuple(old.scheduler.eos_token_ids))

    def stop(self, grace: float = 1.0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("grpc") / "tiny", arch="qwen3", seed=3))


@pytest.fixture(scope="module")
def server(model):
    s = ServerThread(model)
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


def wait_idle(client: Client, timeout: float = 10.0) -> pb.ServerStatus:
    """Poll until no request holds blocks; fails the test if that does not happen in time."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.server_status()
        if status.kv_blocks_used == 0 and status.running_requests == 0 and status.waiting_requests == 0:
            return status
        assert time.monotonic() < deadline, f"requests still hold blocks: {status}"
        time.sleep(0.02)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def test_greedy_stream_matches_embedded_llm(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        chunks = list(client.generate(prompt, temperature=0, max_tokens=24))
        assert [t for c in chunks for t in c.token_ids] == want["token_ids"]
        assert "".join(c.text for c in chunks) == want["text"]
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].finish_reason == ("length" if len(want["token_ids"]) == 24 else "stop")
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


def test_cancel_and_deadline_free_blocks(model):
    # On an idle machine the tiny model makes 200 tokens in under 0.3 s, and a call could end before
    # its cancel or its deadline: a slow data plane (10 ms a step) makes it last 2 s whatever the machine.
    s = ServerThread(model, flaky=True)
    s.plane.delay = 0.01
    try:
        with Client(s.address) as client:
            stream = client.generate(PROMPTS[0], max_tokens=200, ignore_eos=True)
            next(stream), next(stream)
            status = client.server_status()
            assert status.running_requests == 1 and status.kv_blocks_used > 0
            stream.close()  # cancels the call
            wait_idle(client, timeout=5)
            err = rpc_error(lambda: list(client.generate(PROMPTS[1], max_tokens=200, ignore_eos=True, timeout=0.3)))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_idle(client, timeout=5)
    finally:
        s.stop()


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


@pytest.mark.parametrize("field, value", [
    ("min_tokens", 1), ("presence_penalty", 0.5), ("frequency_penalty", -0.25), ("repetition_penalty", 1.1),
    ("logprobs", 0),
])
def test_unimplemented_parameters_are_refused(stub, field, value):
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**{field: value}))
    err = rpc_error(lambda: list(stub.Generate(request)))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert field in err.details()


def test_duplicate_request_id(client, monkeypatch):
    # No grace for a cancelled holder of the id: the first stream (200 tokens) may end within it.
    monkeypatch.setattr("controlplane.stream.REQUEST_ID_GRACE_S", 0.0)
    first = client.generate(PROMPTS[0], request_id="dup", max_tokens=200, ignore_eos=True)
    assert next(first).request_id == "dup"
    err = rpc_error(lambda: list(client.generate(PROMPTS[1], request_id="dup", max_tokens=4)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
    first.close()
    wait_idle(client)
    assert {c.request_id for c in client.generate(PROMPTS[1], request_id="dup", max_tokens=2)} == {"dup"}


def test_a_cancelled_calls_request_id_is_free_for_its_retry(client):
    # What a mesh does after a per-try timeout: cancel, then send again at once with the same id.
    # The new call may arrive before the cancelled one's handler has let go of the id.
    for i in range(10):
        first = client.generate(PROMPTS[0], request_id=f"retry{i}", max_tokens=200, ignore_eos=True)
        next(first)
        first.close()
        retry = list(client.generate(PROMPTS[1], request_id=f"retry{i}", max_tokens=2, ignore_eos=True))
        assert {c.request_id for c in retry} == {f"retry{i}"} and retry[-1].finish_reason == "length"
    wait_idle(client)


def test_a_request_id_waits_out_its_grace_then_is_refused():
    async def run():
        streams = {"held": object(), "freed": object()}
        asyncio.get_running_loop().call_later(0.05, streams.pop, "freed")
        start = time.monotonic()
        await wait_for_free_id(streams, "freed")  # let go of within the grace: taken
        freed = time.monotonic() - start
        with pytest.raises(RequestIdInUse, match="held"):
            await wait_for_free_id(streams, "held")
        return freed, time.monotonic() - start - freed

    freed, refused = asyncio.run(run())
    assert 0.04 < freed < REQUEST_ID_GRACE_S and REQUEST_ID_GRACE_S - 0.01 < refused < REQUEST_ID_GRACE_S + 0.2


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
    assert client.health() == "SERVING" and client.health(SERVICE) == "SERVING"
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


def test_streams_open_at_shutdown_are_told_why_they_end(model, caplog):
    """Streams still running when the shutdown grace ends get UNAVAILABLE "the server is shutting
    down" from the server, not gRPC's cancellation, and the log gets no traceback for them."""
    s = ServerThread(model, flaky=True)
    s.plane.delay = 0.05  # a generation of 100 tokens outlasts the grace
    errors: list[grpc.RpcError] = []
    try:
        with Client(s.address) as c:
            streams = [c.generate(p, max_tokens=100, ignore_eos=True) for p in PROMPTS[:2]]
            for stream in streams:
                next(stream)
            stopped_at = time.monotonic()
            s.stop(grace=0.3)
            for stream in streams:
                errors.append(rpc_error(lambda stream=stream: list(stream)))
    finally:
        s.loop.call_soon_threadsafe(s.loop.stop)
    assert time.monotonic() - stopped_at < 10
    for err in errors:
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def wait_health(client: Client, want: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while client.health() != want:
        assert time.monotonic() < deadline, f"health never became {want}"
        time.sleep(0.02)


@pytest.mark.parametrize("error", [ConnectionError, DataPlaneUnavailable])
def test_data_plane_failure_and_recovery(model, error, caplog):
    s = ServerThread(model, flaky=True)
    s.plane.error = error
    try:
        with Client(s.address) as c:
            stream = c.generate(PROMPTS[0], max_tokens=100, ignore_eos=True)
            next(stream)
            s.plane.fail = True
            err = rpc_error(lambda: list(stream))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "rank 0 stopped answering" in err.details()
            # A lost data plane is an operational event, logged in a line; anything else is a bug,
            # logged with its traceback.
            failed = [r for r in caplog.records if r.getMessage().startswith("engine step failed")]
            assert failed, "the failed step was not logged"
            want = ("WARNING", False) if error is DataPlaneUnavailable else ("ERROR", True)
            assert [(r.levelname, r.exc_info is not None) for r in failed] == [want] * len(failed)
            err = rpc_error(lambda: list(c.generate(PROMPTS[1], max_tokens=4)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "not available" in err.details()
            status = c.server_status()
            assert not status.data_plane_ready and status.kv_blocks_used == 0 and status.running_requests == 0
            assert c.health() == "NOT_SERVING" and c.health(SERVICE) == "NOT_SERVING"
            s.plane.fail = False  # the recover hook now succeeds
            wait_health(c, "SERVING")
            assert s.restarts == 1 and s.server.engine.engine.step_id == 0
            assert len([t for ch in c.generate(PROMPTS[1], max_tokens=4, ignore_eos=True) for t in ch.token_ids]) == 4
    finally:
        s.stop()


def test_a_bug_in_the_engine_loop_ends_the_streams_instead_of_the_thread(model, caplog):
    """An unexpected error in the engine thread's loop (here its status snapshot raises once) must
    not kill the thread with streams waiting on it: they end with UNAVAILABLE, the error is logged with
    its traceback, and the engine re-attaches and serves again."""
    s = ServerThread(model, flaky=True)
    engine = s.server.engine
    try:
        with Client(s.address) as c:
            stream = c.generate(PROMPTS[0], max_tokens=100, ignore_eos=True, timeout=30)  # no hang if it breaks
            next(stream)
            snapshot = engine._snapshot

            def broken():
                engine._snapshot = snapshot  # once
                raise RuntimeError("a bug")

            engine._snapshot = broken
            err = rpc_error(lambda: list(stream))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "the engine failed: RuntimeError: a bug" in err.details()
            assert any(r.levelname == "ERROR" and r.exc_info for r in caplog.records)
            wait_health(c, "SERVING")
            assert s.restarts == 1 and engine._thread.is_alive()
            assert len([t for ch in c.generate(PROMPTS[1], max_tokens=4, ignore_eos=True) for t in ch.token_ids]) == 4
    finally:
        s.stop()


def test_readiness_pushed_by_transport(server, client):
    """set_data_plane_ready: the push-style hook (e.g. a heartbeat lost while idle, then regained)."""
    server.server.engine.set_data_plane_ready(False, "rank 1 missed its heartbeats")
    wait_health(client, "NOT_SERVING")
    err = rpc_error(lambda: list(client.generate(PROMPTS[0], max_tokens=2)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "heartbeats" in err.details()
    server.server.engine.set_data_plane_ready(True)
    wait_health(client, "SERVING")
    assert client.generate_text(PROMPTS[0], max_tokens=2, ignore_eos=True) is not None


def test_server_side_abort(server, client):
    stream = client.generate(PROMPTS[0], request_id="to-abort", max_tokens=200, ignore_eos=True)
    next(stream)
    aborted = asyncio.run_coroutine_threadsafe(_abort(server, "to-abort"), server.loop).result(5)
    assert aborted
    assert list(stream)[-1].finish_reason == "abort"
    wait_idle(client)


async def _abort(server: ServerThread, request_id: str) -> bool:
    return server.server.engine.abort(request_id)  # AsyncEngine.abort belongs to the event loop thread


def test_idle_engine_thread_sleeps(server, client):
    wait_idle(client)
    thread = server.server.engine._thread
    stat = f"/proc/self/task/{thread.native_id}/stat"
    if not Path(stat).exists():
        pytest.skip("needs Linux /proc")

    def cpu_ticks() -> int:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 2  # clock ticks (1/100 s): asleep, not spinning
