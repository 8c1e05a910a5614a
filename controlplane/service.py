"""The service assembled: tokenizer, engine front and gRPC server (`build_server`, `build_process_server`),
run alone (`nanoplane controlplane`) or with a supervised data plane on the same host (`nanoplane serve`).

The control plane binds the ZeroMQ endpoint (it is the stable side; data planes come and go), builds
the engine once the data plane has reported ready, and serves gRPC until SIGINT/SIGTERM. When the
data plane fails, open streams end with UNAVAILABLE, health goes NOT_SERVING, and the engine
re-attaches to the next data plane that connects (`serve` restarts its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from nanoplane.controlplane import runtime_dir
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.dataplane_client import RemoteDataPlane
from nanoplane.controlplane.engine import DataPlaneClient, Engine
from nanoplane.controlplane.front_inproc import InProcessFront
from nanoplane.controlplane.front_process import ProcessFront, engine_process_enabled
from nanoplane.controlplane.grpc_server import GenerationServer, connection_options
from nanoplane.controlplane.kv_events import buffer_size
from nanoplane.controlplane.metrics import Metrics
from nanoplane.controlplane.security import ServerSecurity
from nanoplane.controlplane.supervisor import DataPlaneSupervisor
from nanoplane.controlplane.tokenizer import Tokenizer
from nanoplane.controlplane.tracing import Tracing
from nanoplane.controlplane.vllm_servicer import vllm_service
from nanoplane.plane_keys import plane_security
from nanoplane.process import configure_logging, freeze_startup_objects
from nanoplane.settings import dataplane_argv, read_tuning

log = logging.getLogger("nanoplane.serve")
def set_gil_switch_interval() -> None:
    """A short GIL switch interval (NANOPLANE_GIL_SWITCH_MS): with Python's 5 ms, a step result that arrives
    while the event loop streams tokens waits that long for the engine thread, and the GPU idles meanwhile."""
    sys.setswitchinterval(read_tuning().gil_switch_ms / 1000)


def build_server(config: EngineConfig, data_plane: DataPlaneClient, address: str = "127.0.0.1:0",
                 model_name: str | None = None, recover: Callable[[Engine | None], Engine | None] | None = None,
                 recover_interval_s: float = 1.0, attach_now: bool = True,
                 attach_timeout_s: float = 2.0, security: ServerSecurity | None = None,
                 metrics: Metrics | None = None, tracing: Tracing | None = None,
                 options: list[tuple[str, object]] | None = None) -> GenerationServer:
    """Tokenizer + in-process engine front + server, not yet started.

    attach_now: build the Engine here, which waits for the data plane (slow); otherwise the server
    starts at once, answers NOT_SERVING, and the engine thread attaches the data plane when it comes.
    recover: see EngineLoop; by default a new Engine over the same data-plane client, each attempt
    waiting at most attach_timeout_s for ranks to report ready. metrics, tracing: see GenerationServer.
    """
    tokenizer = Tokenizer(config.model)

    def attach(old: Engine | None) -> Engine:
        return Engine(config, data_plane, tokenizer.eos_token_ids, start_timeout=attach_timeout_s)

    engine = Engine(config, data_plane, tokenizer.eos_token_ids) if attach_now else None
    name = model_name or Path(config.model).name
    front = InProcessFront(engine, recover or attach, recover_interval_s, buffer_size(config))
    return GenerationServer(front, tokenizer, name, address, options, security=security, metrics=metrics,
                            services=[vllm_service(config, name)], tracing=tracing)


def build_process_server(config: EngineConfig, data_plane_address: str, address: str = "127.0.0.1:0",
                         model_name: str | None = None, recover_interval_s: float = 1.0,
                         attach_timeout_s: float = 2.0, security: ServerSecurity | None = None,
                         metrics: Metrics | None = None, plane_keys: str = "",
                         tracing: Tracing | None = None,
                         options: list[tuple[str, object]] | None = None) -> GenerationServer:
    """build_server with the engine in its own process: the data plane attaches to the engine process
    at `data_plane_address` (which that process binds, with CURVE when `plane_keys` names a folder)."""
    tokenizer = Tokenizer(config.model)
    front = ProcessFront(config, data_plane_address, tokenizer.eos_token_ids, recover_interval_s, attach_timeout_s,
                         plane_keys)
    name = model_name or Path(config.model).name
    return GenerationServer(front, tokenizer, name, address, options, security=security, metrics=metrics,
                            services=[vllm_service(config, name)], tracing=tracing)


async def _serve(config: EngineConfig, data_plane: RemoteDataPlane | str, address: str,
                 ready: threading.Event | None = None, on_data_plane_ready: Callable[[bool], None] | None = None,
                 security: ServerSecurity | None = None, metrics_address: tuple[str, int] | None = None,
                 plane_keys: str = "", traces_endpoint: str | None = None, drain_delay: float = 5.0,
                 drain_timeout: float = 30.0, max_connection_age: float = 0.0, max_request_bytes: int = 0) -> None:
    """`data_plane`: the socket ranks attach to (NANOPLANE_ENGINE_PROCESS=0), or the address that the
    engine process binds for them (the default). `on_data_plane_ready(ready)`: readiness changes.
    `metrics_address`: (host, port) of the Prometheus endpoint; None: no metrics. `traces_endpoint`: the
    OTLP collector of the requests' spans; None: no tracing, and OpenTelemetry is never imported.
    `drain_delay`, `drain_timeout`: SIGTERM's graceful stop (GenerationServer.drain); `max_connection_age`,
    `max_request_bytes`: see connection_options."""
    set_gil_switch_interval()
    tracing = None
    if traces_endpoint:  # first too: a missing extra is refused before anything starts
        tracing = Tracing(traces_endpoint, Path(config.model).name)
        log.info("OpenTelemetry traces to %s", traces_endpoint)
    metrics = Metrics(Path(config.model).name) if metrics_address is not None else None
    if metrics is not None:  # first: a port in use is refused before anything starts
        host, wanted = metrics_address
        try:
            metrics_port = metrics.serve(host, wanted)
        except OSError as exc:
            raise ValueError(f"cannot serve the metrics on {host}:{wanted}: {exc}") from None
        log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics_port)
    # The API answers at once (health NOT_SERVING) and the engine attaches the data plane when it is
    # ready, and again after a failure: a new engine (new epoch, step 0, empty prefix cache).
    options = connection_options(config.max_model_len, max_connection_age, drain_timeout, max_request_bytes)
    if isinstance(data_plane, str):
        server = build_process_server(config, data_plane, address, security=security, metrics=metrics,
                                      plane_keys=plane_keys, tracing=tracing, options=options)
        plane_address = data_plane
    else:
        server = build_server(config, data_plane, address, attach_now=False, security=security, metrics=metrics,
                              tracing=tracing, options=options)
        plane_address = data_plane.address
    if on_data_plane_ready is not None:
        server.front.add_ready_listener(on_data_plane_ready)
    port = await server.start()
    log.info("gRPC API on %s (port %d), data plane at %s%s", address, port, plane_address,
             " (engine process)" if isinstance(data_plane, str) else "")
    print(f"nanoplane: serving {Path(config.model).name} on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    freeze_startup_objects()
    if ready is not None:
        ready.set()
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not in the main thread
            loop.add_signal_handler(sig, signals.put_nowait, sig)
    if security is not None:  # SIGHUP: re-read the token file now (certificates: at every handshake)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, security.reload)
    waiter = asyncio.create_task(server.wait_for_termination())
    first = asyncio.create_task(signals.get())
    await asyncio.wait([waiter, first], return_when=asyncio.FIRST_COMPLETED)
    grace = 0.0
    if first.done():  # the first signal drains; a second one stops at once
        log.info("%s: draining (--drain-delay %g s, --drain-timeout %g s); signal again to stop at once",
                 signal.Signals(first.result()).name, drain_delay, drain_timeout)
        draining = asyncio.create_task(server.drain(drain_delay, drain_timeout))
        second = asyncio.create_task(signals.get())
        await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
        if second.done():
            log.info("%s again: stopping at once", signal.Signals(second.result()).name)
            draining.cancel()
        else:
            second.cancel()
            grace = 0.1  # the handlers send their last messages, or the engine's status (drain timeout)
    first.cancel()
    log.info("shutting down")
    await server.stop(grace=grace)
    if metrics is not None:
        metrics.close()
    if tracing is not None:  # exports what is still batched
        await asyncio.to_thread(tracing.shutdown)
    waiter.cancel()


def run_controlplane(config: EngineConfig, bind: str, address: str, security: ServerSecurity | None = None,
                     metrics_address: tuple[str, int] | None = None, plane_keys: str | None = None,
                     insecure_plane: bool = False, traces_endpoint: str | None = None, **limits: float) -> int:
    """ValueError (before anything starts) for a tcp:// `bind` without `plane_keys` unless `insecure_plane`.
    `limits`: drain and connection limits (_serve)."""
    configure_logging("controlplane")
    keys = plane_security(bind, plane_keys, insecure_plane, "control plane")
    if engine_process_enabled():
        log.info("waiting for a data plane to connect to %s (engine process)", bind)
        asyncio.run(_serve(config, bind, address, security=security, metrics_address=metrics_address,
                           plane_keys=plane_keys or "", traces_endpoint=traces_endpoint, **limits))
        return 0
    data_plane = RemoteDataPlane(bind, world_size=config.tensor_parallel_size, keys=keys)
    log.info("waiting for a data plane to connect to %s", data_plane.address)
    try:
        asyncio.run(_serve(config, data_plane, address, security=security, metrics_address=metrics_address,
                           traces_endpoint=traces_endpoint, **limits))
    finally:
        data_plane.close()
    return 0


def run_serve(config: EngineConfig, address: str, bind: str | None = None, security: ServerSecurity | None = None,
              metrics_address: tuple[str, int] | None = None, plane_keys: str | None = None,
              insecure_plane: bool = False, traces_endpoint: str | None = None, **limits: float) -> int:
    """Both planes on this host: the control plane here, the data plane in a supervised child (stopped
    after the drain). `limits`: drain and connection limits (_serve)."""
    configure_logging("serve")
    keys = plane_security(bind or "", plane_keys, insecure_plane, "control plane")
    tmp = runtime_dir.make()
    bind = bind or f"ipc://{tmp}/plane.sock"
    # With the engine in its own process, that process binds the data plane's socket.
    data_plane = None if engine_process_enabled() else RemoteDataPlane(bind, world_size=config.tensor_parallel_size,
                                                                        keys=keys)
    # The child reads the data plane's files of the same folder.
    plane_flags = ["--plane-keys", plane_keys] if plane_keys else ["--insecure-plane"] if insecure_plane else []
    supervisor = DataPlaneSupervisor(dataplane_argv(config, data_plane.address if data_plane else bind) + plane_flags)
    supervisor.start()
    try:
        asyncio.run(_serve(config, data_plane or bind, address, on_data_plane_ready=supervisor.on_ready,
                           security=security, metrics_address=metrics_address, plane_keys=plane_keys or "",
                           traces_endpoint=traces_endpoint, **limits))
    finally:
        supervisor.stop()
        if data_plane is not None:
            data_plane.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0
