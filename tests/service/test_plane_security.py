"""The plane link with CURVE, over real processes and sockets: keys written by `nanoplane keys`, a data plane
holding the right keys attaches and serves the embedded engine's greedy tokens; one with another key, one with
no key and a plain socket never get a word (no welcome, no descriptor) while the real one keeps serving; a
tcp:// link without keys refuses to start unless --insecure-plane. Forgers on an open link: test_plane_forgers.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from conftest import ROOT
from support.rank_processes import check_tokens, embedded_reference, engine_over, kill_all, launch

from nanoplane.controlplane.dataplane_client import RemoteDataPlane
from nanoplane.plane_keys import PlaneKeys
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode


def nanoplane(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOPLANE_")} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nanoplane", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_keys(folder: Path) -> Path:
    done = nanoplane("keys", str(folder))
    assert done.returncode == 0, done.stderr
    return folder


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


def test_keys_writes_each_sides_files_and_never_overwrites(tmp_path):
    keys = write_keys(tmp_path / "keys")
    for name in ("controlplane.key", "controlplane.key_secret", "dataplane.key_secret", "authorized/dataplane.key"):
        assert (keys / name).is_file(), name
    assert (keys / "controlplane.key_secret").stat().st_mode & 0o077 == 0, "a secret key readable by others"
    assert PlaneKeys.control_plane(keys).public == PlaneKeys.data_plane(keys).server_public
    again = nanoplane("keys", str(keys))
    assert again.returncode == 2 and "already holds" in again.stderr


def test_only_the_key_holder_attaches_and_the_others_get_no_word(model, reference, tmp_path, launchers):
    keys, other = write_keys(tmp_path / "keys"), write_keys(tmp_path / "other")
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, keys=PlaneKeys.control_plane(keys))
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)  # no CURVE at all: a stand-in data plane in a few lines
    rogue = ctx.socket(zmq.DEALER)  # CURVE with the right server key but a key of its own, not authorised
    dataclasses.replace(PlaneKeys.data_plane(other), server_public=PlaneKeys.control_plane(keys).public).apply(rogue)
    try:
        for sock in (plain, rogue):
            sock.linger = 0
            sock.connect(client.address)
            sock.send_multipart(codec.encode_control(codec.Hello(99, 0, 1, os.getpid())))
        wrong = launch(model, client.address, 1, ("--plane-keys", str(other)))
        bare = launch(model, client.address, 1, ("--insecure-plane",))
        real = launch(model, client.address, 1, ("--plane-keys", str(keys)))
        launchers += [wrong, bare, real]
        engine = engine_over(client, model)
        epoch = client.epoch
        check_tokens(engine, reference, seed=0)
        # The others' ranks hear nothing from the control plane and leave after --control-timeout (3 s).
        assert wrong.wait(60) == ExitCode.RESTART and bare.wait(60) == ExitCode.RESTART
        check_tokens(engine, reference, seed=1)
        assert client.ready and client.epoch == epoch and real.poll() is None
        assert 99 not in client._launches and 99 not in client._retired, "a HELLO got through the handshake"
        for name, sock in (("plain", plain), ("rogue", rogue)):
            assert not sock.poll(0), f"the {name} socket got a message: {codec.decode(sock.recv_multipart())}"
    finally:
        plain.close()
        rogue.close()
        ctx.term()
        client.close()
    assert real.wait(15) == ExitCode.STOPPED


@pytest.mark.parametrize("argv", [
    ["controlplane", "--bind", "tcp://127.0.0.1:0"],
    ["serve", "--bind", "tcp://127.0.0.1:0"],
    ["dataplane", "--control", "tcp://127.0.0.1:9"],
])
def test_tcp_without_keys_refuses_to_start(argv, model):
    start = time.monotonic()
    done = nanoplane(*argv, "--model", str(model))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--plane-keys" in lines[0] and "--insecure-plane" in lines[0]
    assert time.monotonic() - start < 30


def test_a_taken_port_with_keys_leaves_no_authenticator_behind(tmp_path):
    write_keys(tmp_path)
    first = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, keys=PlaneKeys.control_plane(tmp_path))
    try:
        threads = threading.active_count()
        with pytest.raises(zmq.ZMQError):
            RemoteDataPlane(first.address, world_size=1, keys=PlaneKeys.control_plane(tmp_path))
        assert threading.active_count() == threads
    finally:
        first.close()
