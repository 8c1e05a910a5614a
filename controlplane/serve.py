"""Run the control plane as a service, alone (`nanoplane controlplane`) or with a supervised data plane
on the same host (`nanoplane serve`).

The control plane binds the ZeroMQ endpoint (it is the stable side; data planes come and go), builds
the engine once the data plane has reported ready, and serves gRPC until SIGINT/SIGTERM. When the
data plane fails, open streams end with UNAVAILABLE, health goes NOT_SERVING, and the engine
re-attaches to the next data plane that connects (`serve` restarts its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from controlplane import runtime_dir
from controlplane.config import EngineConfig
from controlplane.dataplane_client import RemoteDataPlane
from controlplane.engine_process import build_process_server, engine_process_enabled
from controlplane.server import build_server

log = logging.getLogger("nanoplane.serve")
# The engine thread and the gRPC event loop share one GIL. With Python's default 5 ms switch
# interval, a step result that arrives while the event loop is busy streaming tokens can wait up to
# 5 ms before the engine thread may schedule the next step, and the GPU idles meanwhile.
# NANOPLANE_GIL_SWITCH_MS overrides it (measurements; 5 is Python's default).
GIL_SWITCH_MS = 0.5


def set_gil_switch_interval() -> None:
    """The control plane's GIL switch interval: GIL_SWITCH_MS, or NANOPLANE_GIL_SWITCH_MS if set."""
    sys.setswitchinterval(float(os.environ.get("NANOPLANE_GIL_SWITCH_MS", GIL_SWITCH_MS)) / 1000)


def freeze_startup_objects() -> None:
    """Start-up's objects (gRPC, protobuf, the tokenizer, the server) go to Python's permanent
    generation: they live as long as the process, and a full collection that walks them all stops
    the event loop, and every stream with it, meanwhile."""
    gc.collect()
    gc.freeze()


async def _serve(config: EngineConfig, data_plane: RemoteDataPlane | str, address: str,
                 ready: threading.Event | None = None,
                 on_data_plane_ready: Callable[[bool], None] | None = None) -> None:
    """`data_plane`: the socket ranks attach to (NANOPLANE_ENGINE_PROCESS=0), or the address that the
    engine process binds for them (the default). `on_data_plane_ready(ready)`: readiness changes."""
    set_gil_switch_interval()
    # The API answers at once (health NOT_SERVING) and the engine attaches the data plane when it is
    # ready, and again after a failure: a new engine (new epoch, step 0, empty prefix cache).
    if isinstance(data_plane, str):
        server, plane_address = build_process_server(config, data_plane, address), data_plane
    else:
        server, plane_address = build_server(config, data_plane, address, attach_now=False), data_plane.address
    if on_data_plane_ready is not None:
        server.engine.add_ready_listener(on_data_plane_ready)
    port = await server.start()
    log.info("gRPC API on %s (port %d), data plane at %s%s", address, port, plane_address,
             " (engine process)" if isinstance(data_plane, str) else "")
    print(f"nanoplane: serving {Path(config.model).name} on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    freeze_startup_objects()
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not in the main thread
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down")
    await server.stop(grace=5.0)
    waiter.cancel()
    stopper.cancel()


def run_controlplane(config: EngineConfig, bind: str, address: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s controlplane %(levelname)s %(message)s")
    if engine_process_enabled():
        log.info("waiting for a data plane to connect to %s (engine process)", bind)
        asyncio.run(_serve(config, bind, address))
        return 0
    data_plane = RemoteDataPlane(bind, world_size=config.tensor_parallel_size)
    log.info("waiting for a data plane to connect to %s", data_plane.address)
    try:
        asyncio.run(_serve(config, data_plane, address))
    finally:
        data_plane.close()
    return 0


# A data plane that the control plane has lost (its ranks stopped answering) normally exits by
# itself; one still running this long after (a stopped or hung rank cannot read the control plane's
# Shutdown) is stopped, so that a new one can start instead of the outage lasting as long as the hang.
LOST_GRACE_S = 15.0


class DataPlaneSupervisor:
    """Keeps a `nanoplane dataplane` process running: restarts it when it fails or asks for a restart
    (75), until stopped. Exit code 0 means the control plane stopped it on purpose, which it does as
    it shuts down, just before this supervisor is stopped: restarting it then would only start a data
    plane (and load a model) to kill it. `on_ready` (an engine ready listener) tells it when the
    control plane loses the data plane; one lost for `lost_grace_s` but still running is stopped and
    restarted."""

    def __init__(self, argv: list[str], min_restart_interval_s: float = 2.0, lost_grace_s: float = LOST_GRACE_S):
        self.argv = argv
        self.min_restart_interval_s = min_restart_interval_s
        self.lost_grace_s = lost_grace_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._served: subprocess.Popen | None = None  # the process whose data plane was last ready
        self._lost_since: float | None = None  # when the control plane lost _served's data plane
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dataplane-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_ready(self, ready: bool) -> None:
        """The control plane's readiness of the data plane changed (called from the engine's thread)."""
        if ready:
            self._served, self._lost_since = self.proc, None
        elif self._served is not None and self._served is self.proc:
            self._lost_since = time.monotonic()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            self.proc = subprocess.Popen(self.argv)
            code, stopped_here = self._wait(self.proc)
            if self._stopping.is_set():
                return
            if code == 0 and not stopped_here:
                log.info("the data plane stopped on purpose (exit 0); not restarting it")
                return
            self.restarts += 1
            log.warning("data plane exited with %s; restarting it (restart %d)", code, self.restarts)
            # Do not spin on a data plane that dies at once (a bad flag, no GPU): back off.
            self._stopping.wait(max(0.0, self.min_restart_interval_s - (time.monotonic() - started)))

    def _wait(self, proc: subprocess.Popen) -> tuple[int, bool]:
        """proc's exit code, and whether this supervisor stopped it because its data plane was lost."""
        while True:
            try:
                return proc.wait(0.5), False
            except subprocess.TimeoutExpired:
                lost = self._lost_since
                if (lost is None or self._served is not proc or self._stopping.is_set()
                        or time.monotonic() - lost < self.lost_grace_s):
                    continue
                log.error("the control plane lost the data plane (pid %d) %.0fs ago and it is still running; "
                          "stopping it", proc.pid, time.monotonic() - lost)
                self._lost_since = None
                _end(proc)
                return proc.wait(), True

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _end(proc, timeout)
        self._thread.join(timeout)


def _end(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (the launcher stops its ranks, killing the ones that do not stop), then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def dataplane_argv(config: EngineConfig, control: str) -> list[str]:
    """The data-plane launcher command for this config (engine flags mapped to the launcher's)."""
    argv = [sys.executable, "-m", "dataplane.launcher", "--model", config.model, "--control", control,
            "--tensor-parallel-size", str(config.tensor_parallel_size), "--device", config.device,
            "--dtype", config.dtype, "--max-num-seqs", str(config.max_num_seqs),
            "--max-num-batched-tokens", str(config.max_num_batched_tokens),
            "--max-model-len", str(config.max_model_len), "--kvcache-block-size", str(config.kvcache_block_size),
            "--num-kvcache-blocks", str(config.num_kvcache_blocks),
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            "--cpu-kvcache-gib", str(config.cpu_kvcache_gib), "--attention-backend", config.attention_backend,
            "--seed", str(config.seed)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def run_serve(config: EngineConfig, address: str, bind: str | None = None) -> int:
    """Both planes on this host: the control plane here, the data plane in a supervised child."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    tmp = runtime_dir.make()
    bind = bind or f"ipc://{tmp}/plane.sock"
    # With the engine in its own process, that process binds the data plane's socket.
    data_plane = None if engine_process_enabled() else RemoteDataPlane(bind, world_size=config.tensor_parallel_size)
    supervisor = DataPlaneSupervisor(dataplane_argv(config, data_plane.address if data_plane else bind))
    supervisor.start()
    try:
        asyncio.run(_serve(config, data_plane or bind, address, on_data_plane_ready=supervisor.on_ready))
    finally:
        supervisor.stop()
        if data_plane is not None:
            data_plane.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
