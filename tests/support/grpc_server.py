"""A gRPC server on a tiny model in a thread of the test process, and the waits the gRPC tests share
(tests/service/test_grpc_api.py: the API as clients use it; tests/service/test_grpc_failures.py: what goes wrong).

The server runs either engine front: in-process (the engine loop on a thread here, the data plane in
this process too) or engine-process (the default layout: the engine loop in its own process, and a
data plane launched as `nanoplane serve` launches it, attached to that process over ZeroMQ)."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from nanoplane.clients import Client
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.front_inproc import InProcessFront
from nanoplane.controlplane.metrics import Metrics
from nanoplane.controlplane.service import build_process_server, build_server
from nanoplane.controlplane.supervisor import DataPlaneSupervisor
from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.local import LocalDataPlane
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.settings import dataplane_argv

PROMPTS = ["héllo wörld ☃ 東京 🙂", "the quick brown fox", "paged attention keeps"]
MAX_LEN, BLOCKS, SEQS = 256, 256, 64
FRONTS = ["in-process", "engine-process"]


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

    def __init__(self, model: str, flaky: bool = False, front: str = "in-process", security=None,
                 metrics: bool = False, **engine_options):
        """`flaky` (in-process only): a FlakyDataPlane, and a recover hook that counts restarts.
        `security`: the port's ServerSecurity (TLS, tokens), in-process only.
        `metrics`: keep a Metrics registry and serve it on 127.0.0.1:`metrics_port`.
        `engine_options`: EngineConfig fields to set (max_num_seqs below SEQS, queue bounds)."""
        self.metrics = Metrics("tiny") if metrics else None
        cfg = EngineConfig(model, **{"device": "cpu", "max_model_len": MAX_LEN, "num_kvcache_blocks": BLOCKS,
                                     "max_num_seqs": SEQS, **engine_options})
        self.restarts = 0
        self.supervisor: DataPlaneSupervisor | None = None  # the engine process's data plane, as serve keeps it
        self._dir: tempfile.TemporaryDirectory | None = None
        if front == "engine-process":
            assert not flaky, "a FlakyDataPlane lives in this process; the engine process has its own client"
            self._dir = tempfile.TemporaryDirectory(prefix="nanoplane-test-")
            plane_address = f"ipc://{self._dir.name}/plane.sock"
            self.server = build_process_server(cfg, plane_address, recover_interval_s=0.05, metrics=self.metrics)
            self.supervisor = DataPlaneSupervisor(dataplane_argv(cfg, plane_address), min_restart_interval_s=0.5)
            self.server.front.add_ready_listener(self.supervisor.on_ready)
        else:
            plane = LocalDataPlane(DataPlaneConfig(model=model, device="cpu", max_num_seqs=SEQS, max_model_len=MAX_LEN,
                                                   block_size=cfg.kvcache_block_size, num_kvcache_blocks=BLOCKS))
            self.plane = FlakyDataPlane(plane) if flaky else plane
            self.server = build_server(cfg, self.plane, recover=self.restart if flaky else None,
                                       recover_interval_s=0.05, security=security, metrics=self.metrics)
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
        self.metrics_port = self.metrics.serve("127.0.0.1", 0) if self.metrics is not None else 0
        if self.supervisor is not None:
            self.supervisor.start()
            deadline = time.monotonic() + 120
            while not self.server.front.data_plane_ready:
                assert time.monotonic() < deadline, "the data plane never attached"
                time.sleep(0.05)

    @property
    def in_process(self) -> bool:
        return isinstance(self.server.front, InProcessFront)

    def restart(self, old: Engine) -> Engine | None:
        """The recover hook: once the plane works again, a new engine over a restarted rank 0 (fresh
        model runner, step 0), as a transport re-attaching to a restarted launch would give."""
        if self.plane.fail:
            return None
        self.restarts += 1
        return Engine(old.config, old.data_plane, tuple(old.scheduler.eos_token_ids))

    def stop(self, grace: float = 1.0) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        finally:
            if self.supervisor is not None:  # its data plane was told to exit 0 by the engine process's stop
                self.supervisor.stop()
            if self._dir is not None:
                self._dir.cleanup()
            if self.metrics is not None:
                self.metrics.close()


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


def wait_health(client: Client, want: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while client.health() != want:
        assert time.monotonic() < deadline, f"health never became {want}"
        time.sleep(0.02)


@contextmanager
def serving(model: str, flaky: bool = False, front: str = "in-process",
            **engine_options) -> Iterator[tuple[ServerThread, Client]]:
    """A server of its own and a client of it, for a test that breaks or slows what it serves."""
    s = ServerThread(model, flaky, front, **engine_options)
    try:
        with Client(s.address) as client:
            yield s, client
    finally:
        s.stop()
