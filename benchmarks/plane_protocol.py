"""What the wire between the planes costs per step, at 256 running requests (a decode step).

    python -m benchmarks.plane_protocol [--rows 256] [--iters 20000] [--round-trips 5000]

Rows: the codec alone (encode, decode, both; pickle of the same dataclass for scale), then a
ZeroMQ ipc round trip to another process that decodes the descriptor and answers a 256-token
result: raw sockets with the codec, and the same through RemoteDataPlane.execute (lock, liveness
checks and result matching included). Times are p50 / p99 in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time

import numpy as np
import zmq

from nanoplane.controlplane.dataplane_client import RemoteDataPlane
from nanoplane.process import terminate
from nanoplane.proto import codec
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult, int32_column


def decode_step(rows: int, step_id: int = 0) -> StepDescriptor:
    """A steady decode step: every row computes one token; 1 in 16 crosses into a new block."""
    rng = np.random.default_rng(0)
    appends = (np.arange(rows) % 16 == 0).astype(np.int32)
    return StepDescriptor(step_id, 1, slots=int32_column(rng.permutation(rows)),
                          num_computed=int32_column(rng.integers(100, 1024, rows)),
                          num_scheduled=int32_column(np.ones(rows)),
                          appended_offsets=int32_column(np.concatenate(([0], np.cumsum(appends)))),
                          appended_block_ids=int32_column(rng.integers(0, 10**5, int(appends.sum()))),
                          free_slots=int32_column([3, 17]))


def timed(fn, iters: int) -> np.ndarray:
    for _ in range(min(iters // 10, 1000)):
        fn()
    out = np.empty(iters)
    clock = time.perf_counter_ns
    for i in range(iters):
        t = clock()
        fn()
        out[i] = clock() - t
    return out / 1e3


def _echo_rank(address: str, remote: bool) -> None:
    """The far side: decode each descriptor, answer as rank 0 would (without the model)."""
    ctx = zmq.Context()
    data = ctx.socket(zmq.DEALER)
    data.connect(address)
    epoch = 0
    if remote:  # the handshake RemoteDataPlane expects, and heartbeats from a thread of their own
        beat = ctx.socket(zmq.DEALER)
        beat.connect(address)
        beat.send_multipart(codec.encode_control(codec.Hello(1, 0, 1, os.getpid())))
        epoch = codec.decode(beat.recv_multipart()).epoch
        info = PlaneInfo(0, 1, epoch, 1024, 16, 256, 4096, 1000, "Echo", "cpu", "float32")
        data.send_multipart(codec.encode_control(codec.Ready(1, info)))

        def beating() -> None:
            while True:  # one beat per interval, as the real rank does: a reply must not trigger the next
                beat.send_multipart(codec.encode_control(codec.Heartbeat(1, epoch, 0)))
                time.sleep(0.2)
                while beat.poll(0):
                    if isinstance(codec.decode(beat.recv_multipart()), codec.Shutdown):
                        os._exit(0)
        threading.Thread(target=beating, daemon=True).start()
    else:
        data.send(b"hello")
    while True:
        msg = codec.decode(data.recv_multipart(copy=False))
        if isinstance(msg, codec.Shutdown):
            os._exit(0)
        sampled = msg.slots.copy()  # stands in for the sampled ids: 256 int32
        data.send_multipart(codec.encode_result(StepResult(msg.step_id, sampled), epoch, 0), copy=False)


def raw_round_trip(desc: StepDescriptor, iters: int, address: str) -> np.ndarray:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    proc = mp.get_context("spawn").Process(target=_echo_rank, args=(address, False), daemon=True)
    proc.start()
    peer = sock.recv_multipart()[0]  # the echo side's first word tells the ROUTER its identity

    def once() -> None:
        sock.send_multipart([peer, *codec.encode_descriptor(desc)], copy=False)
        codec.decode(sock.recv_multipart()[1:])

    try:
        return timed(once, iters)
    finally:
        proc.kill()
        sock.close(0)
        terminate(ctx, "round-trip")


def remote_round_trip(desc: StepDescriptor, iters: int, address: str) -> np.ndarray:
    client = RemoteDataPlane(address, world_size=1)
    proc = mp.get_context("spawn").Process(target=_echo_rank, args=(address, True), daemon=True)
    proc.start()
    try:
        epoch = client.start(timeout=30)[0].epoch
        step = 0

        def once() -> None:
            nonlocal step
            desc.step_id, desc.epoch = step, epoch
            step += 1
            client.execute(desc)

        return timed(once, iters)
    finally:
        client.close()
        proc.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--round-trips", type=int, default=5000)
    args = parser.parse_args()
    desc = decode_step(args.rows)
    frames = [bytes(memoryview(f)) for f in codec.encode_descriptor(desc)]
    pickled = pickle.dumps(desc)
    tmp = tempfile.mkdtemp(prefix="np-bench-")
    rows = [
        ("descriptor encode", timed(lambda: codec.encode_descriptor(desc), args.iters)),
        ("descriptor decode", timed(lambda: codec.decode(frames), args.iters)),
        ("descriptor encode+decode", timed(lambda: codec.decode(codec.encode_descriptor(desc)), args.iters)),
        ("pickle dumps+loads (scale)", timed(lambda: pickle.loads(pickle.dumps(desc)), args.iters)),
        ("ipc round trip, raw sockets", raw_round_trip(desc, args.round_trips, f"ipc://{tmp}/raw")),
        ("ipc round trip, RemoteDataPlane", remote_round_trip(desc, args.round_trips, f"ipc://{tmp}/remote")),
    ]
    size = sum(len(f) for f in frames)
    print(f"{args.rows}-row decode descriptor: {size} bytes in {len(frames)} frames (pickle: {len(pickled)} bytes)")
    print(f"{'':34} {'p50 µs':>9} {'p99 µs':>9}")
    for name, us in rows:
        print(f"{name:34} {np.percentile(us, 50):9.1f} {np.percentile(us, 99):9.1f}")


if __name__ == "__main__":
    main()
