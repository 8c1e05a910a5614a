"""A data plane inside this host without a network transport: rank 0 in this process, other
tensor-parallel ranks in spawned processes fed over pipes. The embedded `LLM` uses it."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import struct
from collections import deque
from multiprocessing.connection import Connection

from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.model_runner import ModelRunner
from nanoplane.process import free_port, freeze_startup_objects
from nanoplane.proto import codec
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult

_COUNT = struct.Struct("<I")


def _send(conn: Connection, frames: list) -> None:
    """A plane message over a pipe in the plane's own encoding (proto/codec.py), as over ZeroMQ: no pickle."""
    conn.send_bytes(_COUNT.pack(len(frames)))
    for frame in frames:
        conn.send_bytes(frame)


def _recv(conn: Connection) -> codec.Message:
    (count,) = _COUNT.unpack(conn.recv_bytes())
    return codec.decode([conn.recv_bytes() for _ in range(count)])


def _serve_rank(cfg: DataPlaneConfig, conn: Connection) -> None:
    runner = ModelRunner(cfg)
    freeze_startup_objects()
    _send(conn, codec.encode_control(codec.Ready(0, runner.info())))
    while True:
        desc = _recv(conn)
        if isinstance(desc, codec.Shutdown):
            break
        # Every rank holds the same state and sees the same descriptor, so a refusal is the same
        # on all ranks; rank 0 reports it.
        runner.execute(desc)
    runner.close()


class LocalDataPlane:
    # The engine thread launches each step itself, well inside a GPU step: one in flight is enough.
    steps_in_flight = 1

    def __init__(self, cfg: DataPlaneConfig):
        if cfg.world_size > 1 and not cfg.dist_init:
            cfg = dataclasses.replace(cfg, dist_init=f"tcp://127.0.0.1:{free_port()}")
        self.cfg = cfg
        self.runner: ModelRunner | None = None
        self.pending: deque = deque()  # launched steps, oldest first
        self.workers: list[tuple[mp.Process, object]] = []

    def start(self) -> list[PlaneInfo]:
        ctx = mp.get_context("spawn")
        for rank in range(1, self.cfg.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_rank, args=(dataclasses.replace(self.cfg, rank=rank), child), daemon=True)
            proc.start()
            child.close()  # so that a dead rank shows up as EOF here instead of a silent hang
            self.workers.append((proc, parent))
        try:
            self.runner = ModelRunner(dataclasses.replace(self.cfg, rank=0))
            infos = [self.runner.info()]
            for rank, (_, conn) in enumerate(self.workers, start=1):
                try:
                    infos.append(_recv(conn).info)
                except EOFError:
                    raise RuntimeError(f"tensor-parallel rank {rank} died while starting "
                                       "(see its traceback above)") from None
        except BaseException:
            self.close()
            raise
        return infos

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.submit(desc)
        return self.collect(desc.step_id)

    def submit(self, desc: StepDescriptor) -> None:
        """Queue a step; the engine schedules the next one while it runs."""
        if self.workers:
            frames = codec.encode_descriptor(desc)
            for _, conn in self.workers:
                _send(conn, frames)
        self.pending.append(self.runner.launch(desc))

    def collect(self, step_id: int) -> StepResult:
        launched = self.pending.popleft()
        if launched.step_id != step_id:
            raise RuntimeError(f"collected step {launched.step_id}, expected {step_id}")
        return self.runner.wait(launched)

    def close(self) -> None:
        for proc, conn in self.workers:
            with contextlib.suppress(BrokenPipeError, OSError):
                _send(conn, codec.encode_control(codec.Shutdown(0, "the embedded engine closes")))
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.workers = []
        if self.runner is not None:
            self.runner.close()
            self.runner = None
