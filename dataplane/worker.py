"""One data-plane rank as a process: connect to the control plane, handshake, obey descriptors.

Two ZeroMQ DEALER sockets reach the control plane's ROUTER (the control plane binds; ranks come and
go). The liveness thread owns one: it says HELLO until the control plane WELCOMEs this launch with
an epoch, then heartbeats; it runs beside the model so that a long step or a collective blocked by a
dead peer never silences it, and it ends the process when the control plane has been silent for
`control_timeout`, when the launcher is gone, or when told to SHUTDOWN. The main thread owns the
other: it loads the model, reports READY with its PlaneInfo, then executes each descriptor. Rank 0
answers every step; other ranks execute the same descriptor and answer only a fatal error, since a
refusal (wrong epoch or step id) is the same on every rank and rank 0 already reports it.

Steps stay in flight, as in the embedded engine: the control plane sends step N+1 (and N+2, see
proto.plane.MAX_STEPS_IN_FLIGHT) before it needs step N's result, so a rank launches them while N's
GPU work runs and only then waits for N.

Exit codes (proto/exit_codes.py): STOPPED when the control plane stopped the data plane on purpose,
RESTART when it went away or dropped this data plane (a supervisor restarts the launcher, which
re-attaches with empty state), anything else for a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import zmq

from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.liveness import STALL_S, Liveness
from nanoplane.plane_keys import PlaneKeys
from nanoplane.process import configure_logging, freeze_startup_objects
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode
from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT, StepDescriptor, StepResult
from nanoplane.settings import read_tuning

EXIT_GRACE_S = 5.0  # how long the main thread gets to leave on its own before the process is ended

log = logging.getLogger("nanoplane.dataplane")


@dataclass(slots=True, frozen=True)
class WorkerOptions:
    control: str  # the control plane's address, tcp://host:port or ipc:///path
    launch_id: int  # shared by the ranks of one launcher run
    heartbeat_interval: float = 0.5
    control_timeout: float = 30.0  # exit when nothing was heard from the control plane this long
    parent_pid: int = 0  # the launcher; exit when it is gone (0: do not watch)
    keys: PlaneKeys | None = None  # CURVE: this data plane's keypair and the control plane's public key


def plane_socket(ctx: zmq.Context, opts: WorkerOptions) -> zmq.Socket:
    """A DEALER to the control plane (CURVE with opts.keys), not yet connected."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if opts.keys is not None:
        opts.keys.apply(sock)
    return sock


class _ControlLink(threading.Thread):
    """The thread that owns the liveness socket: HELLO, heartbeats, and the decision to leave."""

    def __init__(self, ctx: zmq.Context, opts: WorkerOptions, rank: int, world_size: int):
        super().__init__(name=f"nanoplane-liveness-{rank}", daemon=True)
        self.opts, self.rank, self.world_size = opts, rank, world_size
        self.sock = plane_socket(ctx, opts)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no backlog of stale beats while disconnected
        self.sock.connect(opts.control)
        self.epoch = -1
        self.welcomed = threading.Event()
        self.exit_requested = threading.Event()
        self.exit_code = ExitCode.STOPPED
        self._exit_lock = threading.Lock()  # both threads may see a SHUTDOWN; the first word counts

    def request_exit(self, code: int, reason: str) -> None:
        with self._exit_lock:
            if self.exit_requested.is_set():
                return
            self.exit_code = code
            say = log.info if code == ExitCode.STOPPED else log.warning
            say("rank %d leaving (exit %d): %s", self.rank, code, reason)
            self.exit_requested.set()

    def run(self) -> None:
        opts = self.opts
        hello = codec.encode_control(codec.Hello(opts.launch_id, self.rank, self.world_size, os.getpid()))
        # Judged once a beat: a turn this much later means this rank did not run, and that silence is ours.
        control = Liveness(stall_s=opts.heartbeat_interval + STALL_S)
        control.heard()
        while not self.exit_requested.is_set():
            control.judge()
            beat = hello
            if self.welcomed.is_set():
                beat = codec.encode_control(codec.Heartbeat(opts.launch_id, self.epoch, self.rank))
            with contextlib.suppress(zmq.Again):  # not connected (yet): control_timeout below decides
                self.sock.send_multipart(beat, zmq.NOBLOCK)
            deadline = time.monotonic() + opts.heartbeat_interval
            while (wait := deadline - time.monotonic()) > 0 and not self.exit_requested.is_set():
                if self.sock.poll(wait * 1000) and self._handle(self.sock.recv_multipart()):
                    control.heard()
            if (silent := control.silent()) > opts.control_timeout:
                self.request_exit(ExitCode.RESTART,
                                  f"no word from the control plane at {opts.control} for {silent:.1f}s")
            if opts.parent_pid and os.getppid() != opts.parent_pid:
                self.request_exit(ExitCode.RESTART, "the launcher is gone")
        # The main thread may be stuck in a collective whose peer died; do not wait for it forever.
        time.sleep(EXIT_GRACE_S)
        os._exit(self.exit_code)

    def _handle(self, frames: list[bytes]) -> bool:
        try:
            msg = codec.decode(frames)
        except codec.ProtocolError as e:
            log.warning("rank %d ignored a malformed control message: %s", self.rank, e)
            return False
        if isinstance(msg, codec.Welcome) and msg.launch_id == self.opts.launch_id:
            self.epoch = msg.epoch
            self.welcomed.set()
        elif isinstance(msg, codec.Shutdown):
            self.request_exit(msg.exit_code, f"the control plane says: {msg.reason}")
        return True


def run_rank(cfg: DataPlaneConfig, opts: WorkerOptions) -> None:
    """Process entry point of one rank; never returns (the process exits with a meaningful code)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the ranks
    configure_logging(f"rank{cfg.rank}")
    ctx = zmq.Context()
    live = _ControlLink(ctx, opts, cfg.rank, cfg.world_size)
    live.start()
    code = ExitCode.CRASHED
    try:
        code = _serve(ctx, cfg, opts, live)
    except Exception:
        log.exception("rank %d failed", cfg.rank)
    logging.shutdown()
    # Skip interpreter teardown: the liveness socket belongs to another thread and a process group
    # with a dead peer may block in its destructor.
    os._exit(code)


def _serve(ctx: zmq.Context, cfg: DataPlaneConfig, opts: WorkerOptions, live: _ControlLink) -> int:
    import torch  # here, not at import: the launcher imports this module and stays light

    if cfg.device == "auto":
        cfg = dataclasses.replace(cfg, device="cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cpu" and cfg.world_size > 1:
        torch.set_num_threads(1)  # N ranks on one host's cores: one thread each, no oversubscription
    from nanoplane.dataplane.model_runner import ModelRunner

    runner = ModelRunner(cfg)
    freeze_startup_objects()  # torch, the model, Triton's kernels and the CUDA graphs: a full GC would stall steps
    while not live.welcomed.wait(0.1):
        if live.exit_requested.is_set():
            return live.exit_code
    epoch = live.epoch
    data = plane_socket(ctx, opts)
    data.rcvtimeo = 100  # wake to notice an exit request; cheaper per step than Socket.poll
    data.connect(opts.control)
    info = dataclasses.replace(runner.info(), epoch=epoch)
    data.send_multipart(codec.encode_control(codec.Ready(opts.launch_id, info)))
    log.info("rank %d ready: epoch %d, %d KV blocks on %s", cfg.rank, epoch, runner.num_kv_blocks, runner.device)
    try:
        _StepLoop(runner, data, epoch, cfg.rank).run(live)
    finally:
        data.close()
    runner.close()
    return live.exit_code


class _Pace:
    """Where a served step's host time goes, seen from rank 0 (`NANOPLANE_RANK_PACE=N` logs it every
    N steps). With d steps in flight the control plane sends step s + d after it has step s - 1's
    result, and the GPU stays busy only if that descriptor, and its launch, are done before the steps
    launched ahead of it end. Logged: the rank's host time per launch, the control plane's turnaround
    (result s - 1 sent to descriptor s + d received; spells over a second are idleness, not turnaround,
    and are left out), the steps whose descriptor came only after the previous step's result had gone
    out, and the steps whose launch ended after the GPU had finished the step before (either way the
    GPU waited for the host). d is read off the traffic: a descriptor never comes before the result it
    waits for, and when the control plane is quick it comes before the next one."""

    IDLE_S = 1.0

    def __init__(self, rank: int, every: int):
        self.rank, self.every = rank, every
        self.launch: list[float] = []
        self.turnaround: list[float] = []
        self.dry = 0
        self.late = 0
        self.sent: dict[int, float] = {}  # step id -> when its result went out (the latest few)
        self.latest_sent = -1
        self.depth = 1  # the control plane's steps in flight, the largest seen

    def received(self, step_id: int) -> None:
        now = time.perf_counter()
        self.depth = max(self.depth, step_id - 1 - self.latest_sent)
        if (at := self.sent.get(step_id - 1 - self.depth)) is not None and now - at < self.IDLE_S:
            self.turnaround.append(now - at)
        self.dry += step_id - 1 in self.sent

    def launched(self, seconds: float, previous_done: bool) -> None:
        """`previous_done`: the step before this one had finished on the GPU when this launch ended."""
        self.launch.append(seconds)
        self.late += previous_done
        if len(self.launch) >= self.every:
            ms = lambda xs: f"{np.median(xs) * 1e3:.3f}/{np.percentile(xs, 90) * 1e3:.3f}" if xs else "n/a"  # noqa: E731
            log.info("rank %d, last %d steps: launch %s ms (median/p90), control-plane turnaround %s ms, "
                     "GPU waited for %d descriptors and %d launches", self.rank, len(self.launch),
                     ms(self.launch), ms(self.turnaround), self.dry, self.late)
            self.launch, self.turnaround, self.dry, self.late = [], [], 0, 0

    def sent_result(self, step_id: int) -> None:
        self.sent[step_id] = time.perf_counter()
        self.latest_sent = step_id
        self.sent.pop(step_id - 2 * (MAX_STEPS_IN_FLIGHT + 1), None)


class _StepLoop:
    """Obeys descriptors in order and keeps the steps the control plane sent ahead in flight.

    `steps` holds what is not answered yet, oldest first: a runner's Launched, or the StepResult of a
    descriptor refused before launch. At most MAX_STEPS_IN_FLIGHT + 1: the runner copies results into
    a ring of that many pinned buffers, and the control plane never sends more before it has the
    oldest one's result anyway.
    """

    def __init__(self, runner, data: zmq.Socket, epoch: int, rank: int):
        self.runner, self.data, self.epoch, self.rank = runner, data, epoch, rank
        self.steps: deque = deque()
        every = read_tuning().rank_pace
        self.pace = _Pace(rank, every) if every > 0 and rank == 0 else None

    def run(self, live: _ControlLink) -> None:
        while not live.exit_requested.is_set():
            # A finished result goes out first (sending costs microseconds, a launch far more); with
            # as many steps launched as may be, block on the oldest.
            if self.steps and (len(self.steps) > MAX_STEPS_IN_FLIGHT or self.oldest_done()):
                self.finish()
                continue
            # While a step runs, spin between the socket and its event: a blocking wait for either
            # would hold back the other (Event.synchronize, which this replaces, spins too).
            try:
                frames = self.data.recv_multipart(zmq.NOBLOCK if self.steps else 0, copy=False)
                msg = codec.decode(frames)
            except zmq.Again:
                continue
            except codec.ProtocolError as e:
                log.warning("rank %d ignored a malformed message: %s", self.rank, e)
                continue
            if isinstance(msg, StepDescriptor):
                if self.pace:
                    self.pace.received(msg.step_id)
                self.launch(msg)
            elif isinstance(msg, codec.Shutdown):
                live.request_exit(msg.exit_code, f"the control plane says: {msg.reason}")

    def launch(self, desc: StepDescriptor) -> None:
        if desc.epoch != self.epoch:
            self.steps.append(StepResult(desc.step_id, np.zeros(0, np.int32),
                                         error=f"rank {self.rank} refused: descriptor of epoch {desc.epoch}, "
                                               f"this data plane serves epoch {self.epoch}"))
            return
        start = time.perf_counter()
        with self.fatal(desc.step_id):
            self.steps.append(self.runner.launch(desc))
        if self.pace:
            seconds = time.perf_counter() - start
            # With a step still running the GPU was busy throughout; if it has finished, the GPU
            # sat idle for part of this launch (refusals and CPU steps carry no event: not counted).
            older = self.steps[-2] if len(self.steps) >= 2 else None
            timed = older is not None and not isinstance(older, StepResult) and older.done is not None
            self.pace.launched(seconds, timed and older.done.query())

    def oldest_done(self) -> bool:
        step = self.steps[0]
        if isinstance(step, StepResult) or step.done is None:  # a refusal, a CPU step, or no result (rank > 0)
            return True
        with self.fatal(step.step_id):
            return step.done.query()

    def finish(self) -> None:
        """Wait for the oldest step and answer it."""
        step = self.steps.popleft()
        if not isinstance(step, StepResult):
            with self.fatal(step.step_id):
                step = self.runner.wait(step)
        if self.rank == 0:
            self.data.send_multipart(codec.encode_result(step, self.epoch, self.rank), copy=False)
            if self.pace:
                self.pace.sent_result(step.step_id)
        elif step.error:
            log.warning("%s", step.error)

    @contextlib.contextmanager
    def fatal(self, step_id: int):
        try:
            yield
        except Exception as e:
            # The rank's state is unknown now: tell the control plane (any rank may), then die so
            # the launcher takes the whole data plane down for a clean restart.
            error = StepResult(step_id, np.zeros(0, np.int32), error=f"rank {self.rank} failed: {e!r}")
            self.data.send_multipart(codec.encode_result(error, self.epoch, self.rank, fatal=True), copy=False)
            raise
