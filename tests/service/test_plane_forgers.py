"""Only the attached launch's own sockets are heard: a peer that is not one of them (a forger on the port)
cannot end the streams, take a rank's place or stop a step with any message, fatal RESULT included; the
launcher's socket (its HELLO as rank -1) can say a rank exited, which ends the steps at once. Fake ranks
of raw sockets (tests/support/fake_rank.py); the same with CURVE and real ranks: test_plane_security.py."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq
from support.fake_rank import FakeRank, decode_step

from nanoplane.controlplane.dataplane_client import DataPlaneUnavailable, RemoteDataPlane
from nanoplane.proto import codec
from nanoplane.proto.plane import PlaneInfo, StepResult

LAUNCH = 21


@pytest.fixture
def attached():
    """A client with one fake rank attached, a forger's socket on its port, and a pool to run steps in."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=3.0, step_timeout=5)
    launcher = zmq.Socket(zmq.Context.instance(), zmq.DEALER)  # the launcher names its socket first
    launcher.connect(client.address)
    launcher.send_multipart(codec.encode_control(codec.Hello(LAUNCH, -1, 1, os.getpid())))
    fake = FakeRank(client.address, launch_id=LAUNCH)
    client.start(timeout=5)
    forger = zmq.Socket(zmq.Context.instance(), zmq.DEALER)
    forger.connect(client.address)
    pool = ThreadPoolExecutor(1)
    yield client, fake, launcher, forger, pool
    pool.shutdown(cancel_futures=True)
    client.close()
    for sock in (launcher, forger):
        sock.close(0)
    fake.close()


def step_served(client: RemoteDataPlane, fake: FakeRank, pool: ThreadPoolExecutor, step_id: int) -> bool:
    running = pool.submit(client.execute, decode_step(step_id, fake.epoch))
    assert codec.decode(fake.data.recv_multipart()).step_id == step_id
    fake.answer(step_id, [step_id + 100])
    return running.result(5).sampled_token_ids.tolist() == [step_id + 100]


def dropped_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanoplane.dataplane_client"
            and r.getMessage().startswith("dropped")]


def test_a_forged_fatal_result_is_dropped_and_logged_once(attached, caplog):
    client, fake, _, forger, pool = attached
    caplog.set_level(logging.WARNING, "nanoplane.dataplane_client")
    fatal = StepResult(0, np.zeros(0, np.int32), error="rank 0 failed: forged")
    for _ in range(3):  # the right epoch and rank: only the sender gives it away
        forger.send_multipart(codec.encode_result(fatal, fake.epoch, 0, fatal=True))
    running = pool.submit(client.execute, decode_step(0, fake.epoch))
    assert codec.decode(fake.data.recv_multipart()).step_id == 0
    forger.send_multipart(codec.encode_result(StepResult(0, np.array([66], np.int32)), fake.epoch, 0))  # a fake answer
    time.sleep(0.3)
    fake.answer(0, [7])
    assert running.result(5).sampled_token_ids.tolist() == [7], "the forged answer was taken"
    assert client.ready and step_served(client, fake, pool, 1)
    lines = dropped_lines(caplog)
    assert len(lines) == 1 and "Result" in lines[0], lines


def test_forged_liveness_ready_and_exit_notices_change_nothing(attached, caplog):
    client, fake, _, forger, pool = attached
    caplog.set_level(logging.WARNING, "nanoplane.dataplane_client")
    epoch = fake.epoch
    info = PlaneInfo(0, 1, epoch, 64, 16, 8, 256, 100, "Fake", "cpu", "float32")
    for msg in (codec.Hello(LAUNCH, 0, 1, 1), codec.Heartbeat(LAUNCH, epoch, 0), codec.Ready(LAUNCH, info),
                codec.Hello(LAUNCH, -1, 1, 1), codec.RankExited(LAUNCH, 0, 137)):
        forger.send_multipart(codec.encode_control(msg))
    time.sleep(0.3)
    assert client.ready and client.epoch == epoch
    assert step_served(client, fake, pool, 0)  # the descriptor went to the rank's socket
    assert not forger.poll(300), "the forger was answered (welcomed, or sent a descriptor)"
    fake.paused = True  # the rank falls silent: a forger's beats for it do not keep it alive
    start = time.monotonic()
    while client.ready and time.monotonic() - start < 6:
        forger.send_multipart(codec.encode_control(codec.Heartbeat(LAUNCH, epoch, 0)))
        time.sleep(0.1)
    assert not client.ready and "no heartbeat" in client._failure
    assert len(dropped_lines(caplog)) == 1  # one peer: said once


def test_the_launchers_notice_ends_the_steps_at_once(attached):
    client, fake, launcher, _, pool = attached
    running = pool.submit(client.execute, decode_step(0, fake.epoch))
    assert codec.decode(fake.data.recv_multipart()).step_id == 0
    start = time.monotonic()
    launcher.send_multipart(codec.encode_control(codec.RankExited(LAUNCH, 0, 137)))
    with pytest.raises(DataPlaneUnavailable, match="rank 0 exited with code 137"):
        running.result(5)
    assert time.monotonic() - start < 0.5 and not client.ready  # the heartbeat timeout is 3 s

