"""The ZeroMQ data plane's client against fake ranks made of raw sockets (no torch, fast): the
protocol, steps in flight, liveness through stalls of this process or the whole host, a standby
data plane, junk on the port, and a bounded shutdown. The engine over real rank processes:
tests/service/test_launcher.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from support.fake_rank import FakeRank, decode_step

from nanoplane import process
from nanoplane.controlplane import dataplane_client
from nanoplane.controlplane.dataplane_client import DataPlaneUnavailable, RemoteDataPlane
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode


@pytest.mark.parametrize("device, expected", [("cuda:0", 2), ("cpu", 1)])
def test_steps_in_flight_follow_what_the_ranks_run_on(device, expected):
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=5)
    try:
        assert client.steps_in_flight == 1  # nothing attached yet
        fake = FakeRank(client.address, launch_id=12, device=device)
        client.start(timeout=5)
        assert client.steps_in_flight == expected
        fake.close()
    finally:
        client.close()


def test_close_is_bounded_when_a_rank_just_left(monkeypatch):
    """libzmq can hang in term for good after a send to a peer that is disconnecting (here: the Shutdown
    that close sends to a rank that has just closed its sockets); about one close in five did so in
    this loop before close bounded its wait."""
    monkeypatch.setattr(process, "TERM_WAIT_S", 0.3)
    for _ in range(15):
        client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=5)
        fake = FakeRank(client.address, launch_id=13)
        client.start(timeout=5)
        fake.close()
        closing = threading.Thread(target=client.close, daemon=True)
        closing.start()
        closing.join(5.0)  # the watcher's join and one bounded term wait, with room for a slow machine
        assert not closing.is_alive(), "close hung"


def test_protocol_with_fake_ranks():
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=5)
    pool = ThreadPoolExecutor(1)
    try:
        fake = FakeRank(client.address, launch_id=11)
        infos = client.start(timeout=5)
        assert [i.epoch for i in infos] == [fake.epoch] and client.ready
        running = pool.submit(client.execute, decode_step(0, fake.epoch))
        got = codec.decode(fake.data.recv_multipart())
        assert got.step_id == 0 and got.slots.tolist() == [2]
        fake.answer(0, [5], epoch=fake.epoch - 1)  # a stale epoch's result is ignored
        fake.answer(7, [6])  # so is another step's
        fake.answer(0, [7])
        assert running.result(5).sampled_token_ids.tolist() == [7]

        client.submit(decode_step(1, fake.epoch))  # overlap: step 2 goes out before step 1 is back
        client.submit(decode_step(2, fake.epoch))
        assert [codec.decode(fake.data.recv_multipart()).step_id for _ in range(2)] == [1, 2]
        fake.answer(2, [22])
        fake.answer(1, [11])
        assert client.collect(1).sampled_token_ids.tolist() == [11]
        assert client.collect(2).sampled_token_ids.tolist() == [22]
        with pytest.raises(ValueError, match="not submitted"):
            client.collect(2)

        junk = zmq.Socket(zmq.Context.instance(), zmq.DEALER)  # a foreign peer cannot disturb it
        junk.connect(client.address)
        junk.send_multipart([b"GET / HTTP/1.1"])
        junk.send_multipart([b"NP\x07\x02", b"from the future"])
        running = pool.submit(client.execute, decode_step(3, fake.epoch))
        assert codec.decode(fake.data.recv_multipart()).step_id == 3
        fake.answer(3, [8])
        assert running.result(5).sampled_token_ids.tolist() == [8]
        junk.close(0)

        fake.beating = False  # the rank hangs: no heartbeat, no result
        start = time.monotonic()
        with pytest.raises(DataPlaneUnavailable, match="no heartbeat"):
            client.execute(decode_step(4, fake.epoch))
        assert time.monotonic() - start < 1.0 + 0.5 and not client.ready
        with pytest.raises(DataPlaneUnavailable):
            client.execute(decode_step(5, fake.epoch))
        fake.close()

        fresh = FakeRank(client.address, launch_id=12)  # a restarted data plane re-attaches
        assert fresh.epoch > fake.epoch
        assert [i.epoch for i in client.start(timeout=5)] == [fresh.epoch]
        running = pool.submit(client.execute, decode_step(0, fresh.epoch))
        codec.decode(fresh.data.recv_multipart())
        fresh.answer(0, [9])
        assert running.result(5).sampled_token_ids.tolist() == [9]

        late = zmq.Socket(zmq.Context.instance(), zmq.DEALER)  # the retired launch is told to go
        late.connect(client.address)
        late.send_multipart(codec.encode_control(codec.Heartbeat(11, fake.epoch, 0)))
        assert late.poll(2000)
        assert codec.decode(late.recv_multipart()).exit_code == ExitCode.RESTART
        late.close(0)
        client.close()
        assert fresh.data.poll(2000) and codec.decode(fresh.data.recv_multipart()) == codec.Shutdown(
            ExitCode.STOPPED, "the control plane stopped")
        fresh.close()
    finally:
        pool.shutdown(cancel_futures=True)
        client.close()


def test_a_stall_of_the_control_plane_is_not_taken_for_the_ranks_silence():
    """This process stops for longer than the heartbeat timeout (SIGSTOP, swap) while it waits for a
    result: the rank's heartbeats queued meanwhile count before its silence is judged."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=10)
    try:
        fake = FakeRank(client.address, launch_id=21)
        client.start(timeout=5)
        handle, stalled = client._handle, []

        def stall_once(ident, frames, now):  # the first message collect() reads, on the main thread
            if not stalled and threading.current_thread() is threading.main_thread():
                stalled.append(True)
                time.sleep(2.0)
            handle(ident, frames, now)

        client._handle = stall_once
        client.submit(decode_step(0, fake.epoch))
        assert codec.decode(fake.data.recv_multipart()).step_id == 0
        threading.Timer(2.5, fake.answer, args=(0, [3])).start()
        assert client.collect(0).sampled_token_ids.tolist() == [3] and stalled and client.ready
        fake.close()
    finally:
        client.close(stop_data_plane=False)


def test_a_stall_of_the_whole_host_is_not_taken_for_the_ranks_silence():
    """Every process stops at once (a frozen container, a suspended VM), or this one stops before
    ZeroMQ's I/O thread has moved the rank's beats into the socket: when the liveness checks run
    again, the rank has said nothing for longer than the timeout. The gap in the checks themselves
    shows that the silence is the stall's: the rank gets a fresh window, and a rank that stays silent
    is still caught."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=10)
    try:
        fake = FakeRank(client.address, launch_id=22)
        client.start(timeout=5)
        fake.paused = True
        with client._lock:  # neither the watcher nor a collect judges liveness meanwhile
            time.sleep(2.0)
        fake.paused = False
        time.sleep(0.5)
        assert client.ready
        client.submit(decode_step(0, fake.epoch))
        assert codec.decode(fake.data.recv_multipart()).step_id == 0
        fake.answer(0, [3])
        assert client.collect(0).sampled_token_ids.tolist() == [3]
        fake.paused = True  # now only the rank is silent
        time.sleep(1.6)
        assert not client.ready
        fake.close()
    finally:
        client.close(stop_data_plane=False)


def test_after_a_stall_the_rank_that_fell_silent_first_is_named():
    """A stall of this process does not count against the ranks, but it must not erase who went
    quiet first: rank 1 dies, its launcher stops rank 0 a moment later, then this process stalls."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=2, heartbeat_timeout=1.0, step_timeout=10)
    try:
        ranks = [FakeRank(client.address, launch_id=23, rank=r, world_size=2) for r in (0, 1)]
        client.start(timeout=5)
        ranks[1].paused = True
        time.sleep(0.3)
        ranks[0].paused = True
        with client._lock:
            time.sleep(1.5)
        time.sleep(1.5)
        assert not client.ready
        assert "rank 1 " in client._failure, client._failure
        for fake in ranks:
            fake.close()
    finally:
        client.close(stop_data_plane=False)


def test_a_standby_data_plane_says_so_then_takes_over(caplog):
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1, heartbeat_timeout=1.0, step_timeout=5)
    first = second = None
    try:
        with caplog.at_level(logging.INFO, logger="nanoplane.dataplane_client"):
            first = FakeRank(client.address, launch_id=21)
            client.start(timeout=5)
            second = FakeRank(client.address, launch_id=22)
            deadline = time.monotonic() + 5
            while not any("stands by" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.05)  # the client's watcher thread reads the READY
        said = [r.getMessage() for r in caplog.records if "stands by" in r.getMessage()]
        assert said == [f"data plane of epoch {second.epoch} is ready and stands by: epoch {first.epoch} is "
                        "attached; the standby takes over when the engine next restarts its data plane"]
        assert [i.epoch for i in client.start(timeout=5)] == [second.epoch]  # the next restart takes it
    finally:
        client.close()
        for fake in (first, second):
            if fake is not None:
                fake.close()


@pytest.fixture
def idle_client():
    """A control plane with no data plane, and a raw peer connected to its port."""
    client = RemoteDataPlane("tcp://127.0.0.1:*", world_size=1)
    peer = zmq.Socket(zmq.Context.instance(), zmq.DEALER)
    peer.connect(client.address)
    yield client, peer
    peer.close(0)
    client.close(stop_data_plane=False)


def test_malformed_messages_are_logged_at_most_once_a_second(idle_client, caplog):
    client, junk = idle_client
    for _ in range(500):
        junk.send_multipart([b"GET / HTTP/1.1"])
    time.sleep(0.5)  # the watcher thread reads them while idle
    lines = [r for r in caplog.records if r.name == "nanoplane.dataplane_client" and r.levelname == "WARNING"]
    # The first is logged at once; the rest are counted into the next line, a second later.
    assert len(lines) == 1, [r.getMessage() for r in lines][:3]


def test_retired_launches_are_remembered_up_to_a_bound(idle_client, monkeypatch):
    monkeypatch.setattr(dataplane_client, "RETIRED_KEPT", 4)
    client, peer = idle_client

    def hello(launch_id: int, world_size: int) -> int:
        peer.send_multipart(codec.encode_control(codec.Hello(launch_id, 0, world_size, os.getpid())))
        assert peer.poll(2000)
        reply = codec.decode(peer.recv_multipart())
        assert isinstance(reply, codec.Shutdown)
        return reply.exit_code

    # Launches of the wrong size, each retired as it says hello (a made-up flood looks the same).
    assert all(hello(launch_id, 2) == ExitCode.CONFIG for launch_id in range(100, 110))
    assert list(client._retired) == [106, 107, 108, 109]
    assert hello(109, 1) == ExitCode.RESTART  # a recent one is still told to go, whatever it says now


def test_a_flood_on_the_port_is_drained_in_batches(idle_client, monkeypatch):
    monkeypatch.setattr(dataplane_client, "PUMP_MAX", 5)
    client, junk = idle_client
    with client._lock:  # the watcher thread cannot drain them meanwhile
        for _ in range(50):
            junk.send_multipart([b"GET / HTTP/1.1"])
        time.sleep(0.5)
        client._pump(0)
        # 45 are still queued: the drain gave the lock back instead of reading on while more came.
        assert client._sock.poll(0)
