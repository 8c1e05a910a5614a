"""`nanoplane serve` as users run it: real processes, the ZeroMQ data plane, gRPC clients.

Streams equal the embedded engine's tokens at TP=1 and TP=2 (gloo); a data-plane rank killed mid-stream
ends the open streams with UNAVAILABLE within seconds, health goes NOT_SERVING, the supervisor restarts
the data plane and new requests succeed.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from nanoplane.clients.client import Client
from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.demo import serve_in_background
from nanoplane.process import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]


def wait_serving(client: Client, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    client.wait_until_serving(timeout, still_starting=lambda: proc.poll() is None)


class Server:
    def __init__(self, model: Path, tp: int):
        self._stack = contextlib.ExitStack()
        flags = ["--model", str(model), "--device", "cpu", "--tensor-parallel-size", str(tp),
                 "--max-num-batched-tokens", "64"]
        address, self.proc = self._stack.enter_context(serve_in_background(flags, 120, cwd=ROOT))
        self.client = self._stack.enter_context(Client(address))

    def ranks(self) -> list[psutil.Process]:
        """The rank processes: children of the data-plane launcher that serve supervises."""
        children = psutil.Process(self.proc.pid).children()
        launchers = [c for c in children if "nanoplane.dataplane.launcher" in " ".join(c.cmdline())]
        return [r for launcher in launchers for r in launcher.children()]

    def close(self) -> None:
        self._stack.close()


PROMPTS_SEED = 4


def prompts() -> list[list[int]]:
    rng = random.Random(PROMPTS_SEED)
    return [[rng.randrange(1, 380) for _ in range(n)] for n in (3, 40, 130)]


def embedded_run(model: Path) -> list[list[int]]:
    """The embedded engine's greedy tokens for prompts(): what every served stream must equal."""
    llm = LLM(str(model), device="cpu", max_num_batched_tokens=64)
    try:
        outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def embedded_tokens(tiny_models) -> list[list[int]]:
    return embedded_run(tiny_models["qwen3"])


# The engine runs in its own process by default (tests/service/test_engine_process.py covers it at TP=1 with
# bad input and a killed engine process); "0" keeps it in the serving process, the other layout.
# CPU ranks get one step in flight unless told otherwise; "2" runs the GPU ranks' default here.
@pytest.mark.parametrize("tp, engine_process, steps_in_flight", [(2, "1", ""), (1, "0", ""), (1, "1", "2")])
def test_streams_equal_the_embedded_engine(tiny_models, embedded_tokens, tp, engine_process, steps_in_flight,
                                           monkeypatch):
    monkeypatch.setenv("NANOPLANE_ENGINE_PROCESS", engine_process)  # serve and its children inherit it
    if steps_in_flight:
        monkeypatch.setenv("NANOPLANE_STEPS_IN_FLIGHT", steps_in_flight)
    server = Server(tiny_models["qwen3"], tp)
    try:
        assert server.client.model_info().tensor_parallel_size == tp
        got = [[t for chunk in server.client.generate(p, temperature=0.0, max_tokens=16, ignore_eos=True)
                for t in chunk.token_ids] for p in prompts()]
        assert got == embedded_tokens
        assert server.client.server_status().kv_blocks_used == 0
    finally:
        server.close()


def kill_mid_stream(server: Server, victim: psutil.Process, freeze: bool = False,
                    within_s: float = 15) -> grpc.RpcError:
    """Open a long stream and kill `victim` (or stop it with SIGSTOP: `freeze`) once tokens flow: the
    stream must end with UNAVAILABLE within `within_s` seconds and the service say SERVING again.
    Returns the stream's error."""
    errors: list[grpc.RpcError] = []
    started = threading.Event()

    def stream() -> None:
        try:
            for _ in server.client.generate(prompts()[2], temperature=0.0, max_tokens=1024 - 130, ignore_eos=True):
                started.set()
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), errors
    killed_at = time.monotonic()
    victim.suspend() if freeze else victim.kill()
    t.join(within_s + 15)
    assert not t.is_alive() and errors, "the open stream did not end"
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - killed_at < within_s
    wait_serving(server.client, server.proc, timeout=120)
    return errors[0]


def greedy(server: Server, prompt: list[int]) -> list[int]:
    return [t for chunk in server.client.generate(prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
            for t in chunk.token_ids]


@pytest.mark.parametrize("engine_process", ["1", "0"])
def test_killed_rank_gives_unavailable_then_the_service_recovers(tiny_models, embedded_tokens, engine_process,
                                                                 monkeypatch):
    monkeypatch.setenv("NANOPLANE_ENGINE_PROCESS", engine_process)
    server = Server(tiny_models["qwen3"], 2)
    try:
        kill_mid_stream(server, server.ranks()[-1])
        assert greedy(server, prompts()[0]) == embedded_tokens[0]
    finally:
        server.close()


def test_controlplane_answers_before_a_data_plane_attaches(tiny_models, embedded_tokens, tmp_path, monkeypatch):
    """The planes apart: the API is up at once, NOT_SERVING and UNAVAILABLE until ranks attach; when
    the control plane is killed, the data plane exits asking to be restarted."""
    monkeypatch.setenv("NANOPLANE_ENGINE_PROCESS", "1")  # the default layout, whatever this shell says
    model, port, bind = tiny_models["qwen3"], free_port(), f"ipc://{tmp_path}/plane.sock"
    control = subprocess.Popen([sys.executable, "-m", "nanoplane", "controlplane", "--model", str(model),
                                "--host", "127.0.0.1", "--port", str(port), "--bind", bind,
                                "--max-num-batched-tokens", "64"], cwd=ROOT)
    data = None
    client = Client(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:  # the port opens without any data plane
            try:
                status = client.health()
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline and control.poll() is None
                time.sleep(0.2)
        assert status == "NOT_SERVING" and client.health("") == "SERVING"  # ready: no; live: yes
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(prompts()[0], max_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "data plane" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not client.server_status().data_plane_ready
        data = subprocess.Popen([sys.executable, "-m", "nanoplane", "dataplane", "--model", str(model),
                                 "--control", bind, "--device", "cpu", "--max-num-batched-tokens", "64"], cwd=ROOT)
        wait_serving(client, control)
        got = [t for chunk in client.generate(prompts()[0], temperature=0.0, max_tokens=16, ignore_eos=True)
               for t in chunk.token_ids]
        assert got == embedded_tokens[0]
        # The serving process dies (an OOM kill): its engine process retires the data plane with 75,
        # "restart me", not 0, which a supervisor that restarts on failure would leave down.
        control.kill()
        assert data.wait(30) == 75
    finally:
        client.close()
        for proc in (control, data):
            if proc is not None:
                stop_process(proc)
