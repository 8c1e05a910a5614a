"""The gRPC API when things go wrong: cancelled and expired calls, request ids in use, a data plane
that stops answering, a bug in the engine loop, readiness pushed by the transport, a server-side
abort and a shutdown with streams open. Each must end every affected stream with a status code a
person can act on, free its KV blocks, and leave the server serving. What does not depend on where
the engine runs is checked against both engine fronts; a data plane that fails on cue and a bug in
the engine loop are staged in this process (the engine process's own failures: test_engine_process.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
import zmq
from support.grpc_server import FRONTS, PROMPTS, ServerThread, rpc_error, serving, wait_health, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.controlplane.errors import DataPlaneUnavailable, RequestIdInUse
from nanoplane.controlplane.front import REQUEST_ID_GRACE_S, Stream, wait_for_free_id
from nanoplane.controlplane.grpc_server import SERVICE
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto import engine_link as link


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("grpc-failures") / "tiny", arch="qwen3", seed=3))


@pytest.fixture(scope="module", params=FRONTS)
def served(model, request) -> Iterator[tuple[ServerThread, Client]]:
    with serving(model, front=request.param) as both:
        yield both


def test_cancel_and_deadline_free_blocks(model):
    # On an idle machine the tiny model makes 200 tokens in under 0.3 s, and a call could end before
    # its cancel or its deadline: a slow data plane (10 ms a step) makes it last 2 s whatever the machine.
    with serving(model, flaky=True) as (s, client):
        s.plane.delay = 0.01
        stream = client.generate(PROMPTS[0], max_tokens=200, ignore_eos=True)
        next(stream), next(stream)
        status = client.server_status()
        assert status.running_requests == 1 and status.kv_blocks_used > 0
        stream.close()  # cancels the call
        wait_idle(client, timeout=5)
        err = rpc_error(lambda: list(client.generate(PROMPTS[1], max_tokens=200, ignore_eos=True, timeout=0.3)))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(client, timeout=5)


def test_duplicate_request_id(served, monkeypatch):
    _, client = served
    # No grace for a cancelled holder of the id: the first stream (200 tokens) may end within it.
    monkeypatch.setattr("nanoplane.controlplane.front.REQUEST_ID_GRACE_S", 0.0)
    first = client.generate(PROMPTS[0], request_id="dup", max_tokens=200, ignore_eos=True)
    assert next(first).request_id == "dup"
    err = rpc_error(lambda: list(client.generate(PROMPTS[1], request_id="dup", max_tokens=4)))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
    first.close()
    wait_idle(client)
    assert {c.request_id for c in client.generate(PROMPTS[1], request_id="dup", max_tokens=2)} == {"dup"}


def test_a_cancelled_calls_request_id_is_free_for_its_retry(served):
    _, client = served
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


@pytest.mark.parametrize("error", [ConnectionError, DataPlaneUnavailable])
def test_data_plane_failure_and_recovery(model, error, caplog):
    with serving(model, flaky=True) as (s, c):
        s.plane.error = error
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
        assert c.health("") == "SERVING"  # liveness: the process works while it waits for a data plane
        s.plane.fail = False  # the recover hook now succeeds
        wait_health(c, "SERVING")
        assert s.restarts == 1 and s.server.front.loop.engine.step_id == 0
        assert len([t for ch in c.generate(PROMPTS[1], max_tokens=4, ignore_eos=True) for t in ch.token_ids]) == 4


def test_a_bug_in_the_engine_loop_ends_the_streams_instead_of_the_thread(model, caplog):
    """An unexpected error in the engine thread's loop (here its status snapshot raises once) must
    not kill the thread with streams waiting on it: they end with UNAVAILABLE, the error is logged with
    its traceback, and the engine re-attaches and serves again."""
    with serving(model, flaky=True) as (s, c):
        engine = s.server.front.loop
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


def test_readiness_pushed_by_transport(served):
    """set_data_plane_ready: the push-style hook (e.g. a heartbeat lost while idle, then regained)."""
    server, client = served
    server.server.front.set_data_plane_ready(False, "rank 1 missed its heartbeats")
    wait_health(client, "NOT_SERVING")
    err = rpc_error(lambda: list(client.generate(PROMPTS[0], max_tokens=2)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "heartbeats" in err.details()
    server.server.front.set_data_plane_ready(True)
    wait_health(client, "SERVING")
    assert client.generate_text(PROMPTS[0], max_tokens=2, ignore_eos=True) is not None


def test_server_side_abort(served):
    server, client = served
    stream = client.generate(PROMPTS[0], request_id="to-abort", max_tokens=200, ignore_eos=True)
    next(stream)
    aborted = asyncio.run_coroutine_threadsafe(_abort(server, "to-abort"), server.loop).result(5)
    assert aborted
    assert list(stream)[-1].finish_reason == "abort"
    wait_idle(client)


async def _abort(server: ServerThread, request_id: str) -> bool:
    return server.server.front.abort(request_id)  # EngineFront.abort belongs to the event loop thread


def test_a_malformed_event_replaces_the_engine_process(model):
    """Bytes on the events socket that are not the engine link's (a foreign sender, another release)
    do not crash the serving process: the engine process, which can no longer be trusted with the
    streams, is killed and a new one serves."""
    with serving(model, front="engine-process") as (s, client):
        front = s.server.front
        first = front._process
        ctx = zmq.Context()
        intruder = ctx.socket(zmq.PUSH)
        intruder.connect(f"ipc://{front._dir}/events.sock")
        intruder.send(b"NE\x01\xc1 not msgpack")
        intruder.close(linger=1000)
        ctx.term()
        wait_health(client, "NOT_SERVING", timeout=10)
        assert first.wait(10) == -signal.SIGKILL
        wait_health(client, "SERVING", timeout=90)
        assert front._process is not first
        assert len([t for ch in client.generate(PROMPTS[1], max_tokens=4, ignore_eos=True) for t in ch.token_ids]) == 4


def test_a_refused_command_is_a_typed_failure_not_an_engine_process_crash(model):
    """An Add that the serving process would have refused (here a negative temperature, sent past its
    checks) ends that request with ValueError, carried over the link as a kind and a message; the
    engine process goes on serving."""
    with serving(model, front="engine-process") as (s, client):
        front = s.server.front
        first = front._process

        async def send_bad_add() -> BaseException:
            key = 10**9  # far above the keys real requests get here
            stream = Stream("bad", [5, 6], SamplingParams())
            front._by_key[key] = stream
            try:
                front._send(link.Add(key, [5, 6], link.Sampling(-1.0, 1.0, 0, 0.0, 4, None, False, []), None))
                return await asyncio.wait_for(stream.queue.get(), 10)
            finally:
                front._by_key.pop(key, None)

        error = asyncio.run_coroutine_threadsafe(send_bad_add(), s.loop).result(15)
        assert type(error) is ValueError and "temperature" in str(error)
        assert front._process is first and first.poll() is None
        assert len([t for ch in client.generate(PROMPTS[1], max_tokens=4, ignore_eos=True) for t in ch.token_ids]) == 4
