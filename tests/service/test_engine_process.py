"""`nanoplane serve` with the engine in its own process (NANOPLANE_ENGINE_PROCESS=1): the same tokens as
the embedded engine, bad input refused in the serving process, a killed rank or a killed engine
process ends the open streams with UNAVAILABLE and the service comes back.
"""

from __future__ import annotations

import threading

import grpc
import psutil
import pytest

from nanoplane.process import stop_process
from tests.service.test_service import Server, embedded_run, greedy, kill_mid_stream, prompts


@pytest.fixture(scope="module")
def embedded_tokens(tiny_models) -> list[list[int]]:
    return embedded_run(tiny_models["qwen3"])


@pytest.fixture
def engine_process(monkeypatch):
    monkeypatch.setenv("NANOPLANE_ENGINE_PROCESS", "1")  # the serve process and its children inherit it


def engine_processes(server: Server) -> list[psutil.Process]:
    # ProcessFront starts `python -m nanoplane.controlplane.engine_process LAUNCH`
    children = psutil.Process(server.proc.pid).children()
    return [c for c in children if "nanoplane.controlplane.engine_process" in c.cmdline()]


def test_streams_equal_the_embedded_engine_and_bad_input_is_refused(tiny_models, embedded_tokens, engine_process):
    server = Server(tiny_models["qwen3"], 1)
    try:
        assert len(engine_processes(server)) == 1
        info = server.client.model_info()
        assert info.tensor_parallel_size == 1 and info.vocab_size > 0
        assert [greedy(server, p) for p in prompts()] == embedded_tokens
        status = server.client.server_status()
        assert status.data_plane_ready and status.kv_blocks_used == 0 and status.kv_blocks_total > 0
        assert info.kv_capacity_tokens == status.kv_blocks_total * info.kv_block_size
        for prompt, max_tokens, words in (([info.vocab_size], 4, "token ids must be integers"),
                                          ([1, 2, 3], 10**6, "max_model_len"), ([], 4, "empty")):
            with pytest.raises(grpc.RpcError) as err:
                list(server.client.generate(prompt, max_tokens=max_tokens))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    finally:
        server.close()


def test_killed_engine_process_gives_unavailable_then_the_service_recovers(tiny_models, embedded_tokens,
                                                                           engine_process):
    server = Server(tiny_models["qwen3"], 1)
    try:
        [victim] = engine_processes(server)
        assert "engine process exited with code -9" in kill_mid_stream(server, victim).details()
        [replacement] = engine_processes(server)
        assert replacement.pid != victim.pid
        assert greedy(server, prompts()[0]) == embedded_tokens[0]
    finally:
        server.close()


def test_frozen_engine_process_is_killed_and_replaced(tiny_models, embedded_tokens, engine_process):
    """An engine process that is alive but silent (SIGSTOP here; a call holding its GIL looks the same)
    would hold every stream forever: after ENGINE_SILENCE_S without a beat it is killed, the open
    streams end with UNAVAILABLE and a new engine process serves."""
    from nanoplane.controlplane.front_process import ENGINE_SILENCE_S

    server = Server(tiny_models["qwen3"], 1)
    try:
        [victim] = engine_processes(server)
        error = kill_mid_stream(server, victim, freeze=True, within_s=ENGINE_SILENCE_S + 10)
        assert "engine process sent nothing" in error.details()
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
        assert greedy(server, prompts()[0]) == embedded_tokens[0]
    finally:
        server.close()


def test_frozen_rank_is_replaced(tiny_models, embedded_tokens, engine_process):
    """A stopped rank cannot read the control plane's Shutdown: serve's supervisor stops its data plane
    once it has been lost for LOST_GRACE_S and starts another, rather than wait for as long as it hangs."""
    server = Server(tiny_models["qwen3"], 1)
    try:
        victim = server.ranks()[-1]  # as in test_killed_rank_gives_unavailable_then_the_service_recovers
        kill_mid_stream(server, victim, freeze=True)
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
        assert greedy(server, prompts()[0]) == embedded_tokens[0]
    finally:
        server.close()


def test_killed_rank_gives_unavailable_then_the_service_recovers(tiny_models, embedded_tokens, engine_process):
    server = Server(tiny_models["qwen3"], 1)
    try:
        kill_mid_stream(server, server.ranks()[-1])
        assert greedy(server, prompts()[0]) == embedded_tokens[0]
    finally:
        server.close()


def test_stopping_the_service_ends_open_streams_and_the_engine_process(tiny_models, engine_process):
    server = Server(tiny_models["qwen3"], 1)
    [engine] = engine_processes(server)
    errors: list[grpc.RpcError] = []
    tokens: list[int] = []
    started = threading.Event()

    def stream() -> None:
        try:
            for chunk in server.client.generate(prompts()[2], temperature=0.0, max_tokens=1024 - 130,
                                                ignore_eos=True):
                tokens.extend(chunk.token_ids)
                started.set()
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(60), errors
        stop_process(server.proc)  # SIGTERM: the service stops in order
        t.join(30)
        assert not t.is_alive(), "the open stream hung"
        # Running calls get a grace period: the stream either finished whole or was told why it ended.
        if errors:
            assert errors[0].code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in errors[0].details()
        else:
            assert len(tokens) == 1024 - 130
        engine.wait(10)  # raises psutil.TimeoutExpired if the engine process outlived the service
        assert server.proc.returncode == 0
    finally:
        server.close()


def test_a_front_never_started_shuts_down_cleanly(tiny_models):
    from pathlib import Path

    from nanoplane.controlplane.config import EngineConfig
    from nanoplane.controlplane.front_process import ProcessFront

    front = ProcessFront(EngineConfig(str(tiny_models["qwen3"]), device="cpu"), "ipc:///nonexistent/plane.sock", ())
    sockets = Path(front._dir)
    assert sockets.is_dir() and not front.data_plane_ready and front.facts is None
    front.shutdown()
    assert not sockets.exists()


def test_both_fronts_have_the_whole_interface():
    """The gRPC server is typed to EngineFront: each front has every member, with the parameters it names."""
    import inspect

    from nanoplane.controlplane.front import EngineFront
    from nanoplane.controlplane.front_inproc import InProcessFront
    from nanoplane.controlplane.front_process import ProcessFront

    members = [name for name in vars(EngineFront) if not name.startswith("_")]
    assert {"facts", "generate", "abort", "status", "start", "shutdown", "set_data_plane_ready"} <= set(members)
    for front in (InProcessFront, ProcessFront):
        for name in members:
            want, got = getattr(EngineFront, name), getattr(front, name, None)
            assert got is not None, f"{front.__name__} has no {name}"
            assert isinstance(got, property) == isinstance(want, property), f"{front.__name__}.{name}"
            if not isinstance(want, property):
                have = inspect.signature(got).parameters
                assert all(p in have for p in inspect.signature(want).parameters), f"{front.__name__}.{name}"
