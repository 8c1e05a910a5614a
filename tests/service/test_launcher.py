"""The engine over real rank processes (`python -m dataplane.launcher`, a tiny model on the CPU)
gives the embedded engine's tokens, refuses steps it cannot have asked for, and turns failures (a
killed rank, a vanished control plane, a second signal) into errors in bounded time. The client
against fake ranks: tests/service/test_dataplane_client.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT
from support.rank_processes import (
    LENGTHS,
    check_tokens,
    embedded_reference,
    engine_over,
    generate,
    kill_all,
    launch,
    random_prompts,
)

from nanoplane.controlplane.dataplane_client import DataPlaneUnavailable, RemoteDataPlane
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto.exit_codes import ExitCode, killed_by
from nanoplane.proto.plane import StepDescriptor

DETECT_BOUND_S = 10.0
NOTICE_BOUND_S = 0.5  # a killed rank, told by its launcher (the heartbeat timeout would take seconds)


@pytest.fixture(scope="module")
def model(tiny_models) -> Path:
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def reference(model) -> dict[tuple[int, int], list[int]]:
    return embedded_reference(model)


@pytest.fixture
def launchers():
    procs: list[subprocess.Popen] = []
    yield procs
    kill_all(procs)


def test_tp1_over_ipc_matches_embedded_and_refuses_bad_steps(model, reference, tmp_path, launchers):
    client = RemoteDataPlane(f"ipc://{tmp_path}/control", world_size=1)
    try:
        launchers.append(launch(model, client.address, tp=1))
        engine = engine_over(client, model)
        check_tokens(engine, reference, seed=0)

        result = client.execute(StepDescriptor(engine.step_id + 5, client.epoch))  # a lost step
        assert "refused: expected step" in result.error and len(result.sampled_token_ids) == 0
        result = client.execute(StepDescriptor(engine.step_id, client.epoch + 3))  # another epoch's step
        assert "refused: descriptor of epoch" in result.error
        with client._lock:  # garbage straight to the rank's data socket (private: a test of the rank)
            client._sock.send_multipart([client._attached.ranks[0].data_ident, b"NP\x01\x01", b"junk"])
        prompts = random_prompts(LENGTHS[:3], seed=1)  # the rank computed none of it: state intact
        assert generate(engine, prompts) == [reference[(1, len(p))] for p in prompts]
    finally:
        client.close()
    assert launchers[0].wait(10) == ExitCode.STOPPED  # stopped on purpose: the supervisor should not restart it


def test_tp2_kill_a_rank_then_reattach(model, reference, launchers):
    """The launcher tells the control plane at once: the steps end long before the heartbeat timeout."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=2, heartbeat_timeout=5.0)
    insecure = ("--insecure-plane",)  # keys: test_plane_security.py
    try:
        launchers.append(launch(model, client.address, tp=2, extra=insecure))
        engine = engine_over(client, model)
        check_tokens(engine, reference, seed=0)

        for p in random_prompts([30] * 4, seed=5):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        failure: list = []

        def run() -> None:  # steps back to back, so the kill most likely lands inside one
            try:
                while engine.has_work():
                    engine.step()
            except DataPlaneUnavailable as e:
                failure.append((time.monotonic(), e))

        stepping = threading.Thread(target=run)
        stepping.start()
        time.sleep(0.3)
        os.kill(client.rank_pids[1], signal.SIGKILL)
        killed = time.monotonic()
        stepping.join(DETECT_BOUND_S)
        assert failure, "the engine did not notice the killed rank"
        detected = failure[0][0] - killed
        print(f"killed rank detected after {detected:.2f}s: {failure[0][1]}")
        assert detected < NOTICE_BOUND_S and not client.ready and "exited with code 137" in str(failure[0][1])
        assert launchers[0].wait(DETECT_BOUND_S) != 0  # so that a supervisor restarts it

        launchers.append(launch(model, client.address, tp=2, extra=insecure))  # the supervisor's restart
        engine = engine_over(client, model)  # the engine re-attaches with nothing in flight
        check_tokens(engine, reference, seed=1)
    finally:
        client.close(stop_data_plane=False)  # as if the control plane crashed
    start = time.monotonic()
    assert launchers[1].wait(15) == ExitCode.RESTART
    print(f"ranks left {time.monotonic() - start:.2f}s after the control plane vanished")
    assert time.monotonic() - start < 3 + 5  # control_timeout 3 s, and slack


def test_a_second_signal_while_the_launcher_stops_leaves_no_traceback(tiny_models, tmp_path):
    """Ctrl-C, then a supervisor's SIGTERM while the launcher is stopping its ranks: it finishes stopping them
    and exits 130, without a KeyboardInterrupt traceback. The rank is frozen (SIGSTOP), so the launcher is
    still waiting out its grace period when the second signal comes."""
    cmd = [sys.executable, "-m", "nanoplane.dataplane.launcher", "--model", str(tiny_models["qwen3"]), "--control",
           f"ipc://{tmp_path}/nobody.sock", "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    try:
        err = ""
        while "starting 1 rank" not in err:
            line = proc.stderr.readline()
            assert line, f"the launcher ended before starting its rank: {err}"
            err += line
        time.sleep(0.5)  # the rank is up (or importing torch)
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        ranks = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1  # not multiprocessing's resource tracker, which must see the launcher go
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        err += proc.communicate(timeout=30)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the launcher left behind
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == killed_by(signal.SIGINT) and "Traceback" not in err, err
