"""The control plane's `DataPlaneClient` over ZeroMQ: data-plane ranks in other processes or containers.

The control plane binds one ROUTER socket (it is the stable endpoint; data planes come and go) and
every rank connects two DEALERs to it (see dataplane/worker.py): a liveness socket for HELLO and
heartbeats, and a data socket for READY, descriptors and results. A launcher run is one *launch*
(a random launch id shared by its ranks); the first HELLO of a launch assigns it the next epoch.
`start()` attaches the newest launch whose world_size ranks all reported READY.

Failure never hangs the engine: a rank without a heartbeat for `heartbeat_timeout`, a step without a
result for `step_timeout`, an unreachable rank or a fatal error turns into `DataPlaneUnavailable`
from `execute` (and `ready` turns false). The failed launch is told to shut down with a restart exit
code, so its supervisor restarts it; that new launch starts with empty slots and step 0. The engine
must therefore abort the requests in flight when it catches `DataPlaneUnavailable`, call `start()`
again and continue with fresh step ids and the new epoch. Messages of retired launches are ignored
and their ranks are told to shut down.

Only the attached launch's own sockets are heard: the ROUTER identities a launch's ranks said HELLO
(liveness) and READY (data) from, and the one its launcher said HELLO from as rank -1. Anything else
from another peer, a fatal RESULT included, is dropped and logged once per peer. With `keys`, the
socket is a CURVE server that accepts only the authorised data-plane keys (nanoplane/plane_keys.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import zmq

from nanoplane.controlplane.errors import (
    DataPlaneUnavailable,  # one "data plane gone" error; the API maps it to UNAVAILABLE
)
from nanoplane.controlplane.launches import Launch, Rank
from nanoplane.controlplane.plane_port import PlanePort
from nanoplane.liveness import Liveness
from nanoplane.plane_keys import PlaneKeys
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult
from nanoplane.settings import read_tuning

log = logging.getLogger("nanoplane.dataplane_client")


# Retired launch ids remembered, newest last: a retired launch's ranks may say hello again until their
# control timeout ends them, and are told to go. Older ones are long gone, and without keys (ipc,
# --insecure-plane) anyone can reach the port: a flood of made-up launches must not grow the set without bound.
RETIRED_KEPT = 1024
# Messages handled per drain while holding the lock. A peer flooding the port (without keys anyone can)
# would otherwise keep a drain going, and the engine waiting for the lock, as long as the flood lasts.
# ZeroMQ's ROUTER takes turns between peers, so the ranks' beats and results still get read.
PUMP_MAX = 1000
# Peers whose dropped messages were logged (once each); forgotten in bulk past this many.
DROPPED_PEERS_KEPT = 1024
LAUNCHER_RANK = -1  # the rank a launcher says HELLO as: its socket only tells of ranks that exited


class RemoteDataPlane:
    def __init__(self, address: str, world_size: int | None = None, *, heartbeat_timeout: float = 2.5,
                 step_timeout: float | None = None, start_timeout: float = 600.0, pending_timeout: float = 60.0,
                 keys: PlaneKeys | None = None):
        """Bind `address` (tcp://host:port, tcp://host:* or ipc:///path); `world_size` None accepts any;
        `keys`: CURVE, accepting only the data planes whose public keys are in keys.authorized."""
        self.world_size = world_size
        if step_timeout is None:  # a rank that beats but never answers (a hung GPU) is caught only by this
            step_timeout = read_tuning().step_timeout
        self.heartbeat_timeout, self.step_timeout = heartbeat_timeout, step_timeout
        self.start_timeout, self.pending_timeout = start_timeout, pending_timeout
        self._port = PlanePort(address, keys)
        self._sock, self.address = self._port.sock, self._port.address
        self._lock = threading.Lock()  # the socket and all state below belong to whoever holds it
        self._launches: dict[int, Launch] = {}
        self._retired: dict[int, None] = {}  # an ordered set: see RETIRED_KEPT
        self._launchers: dict[int, bytes] = {}  # launch id -> its launcher's socket, RETIRED_KEPT newest
        self._attached: Launch | None = None
        self._failure = "no data plane attached yet"
        self._pending: dict[int, StepResult | None] = {}  # submitted step id -> rank 0's result once in
        self._next_epoch = 1
        # The ranks' last words, judged every ~0.1 s (_check): a stall of this process is not held against them.
        self._liveness = Liveness()
        self._ignored, self._ignored_logged_at = 0, 0.0  # malformed messages not logged yet, and when we last did
        self._dropped_peers: set[bytes] = set()  # peers not of the attached launch whose messages were logged
        self._closed = False
        self.descriptor_bytes = 0  # encoded step descriptors sent to one rank, in all (metrics)
        # Keeps answering heartbeats and checking ranks while the engine is idle; execute and start
        # do the same work themselves while they hold the lock.
        self._watcher = threading.Thread(target=self._watch, name="nanoplane-remote-watch", daemon=True)
        self._watcher.start()

    @property
    def ready(self) -> bool:
        return self._attached is not None

    @property
    def steps_in_flight(self) -> int:
        """The engine's steps in flight when its config leaves them open (read after `start`).

        Two for ranks on GPUs: a result's way back to the next descriptor crosses processes here (rank,
        ZeroMQ, the engine process, ZeroMQ, the rank's own launch), and at a few rows that path can
        outlast the GPU's step. One for CPU ranks, which
        compute a step while launching it: a second step ahead would gain nothing and cost a wasted step
        after every stop."""
        a = self._attached
        on_gpus = a is not None and all(r.info is not None and r.info.device.startswith("cuda")
                                        for r in a.ranks.values())
        return 2 if on_gpus else 1

    @property
    def epoch(self) -> int:
        return self._attached.epoch if self._attached else -1

    @property
    def rank_pids(self) -> dict[int, int]:
        a = self._attached
        return {r.rank: r.pid for r in a.ranks.values()} if a else {}

    def heartbeat_ages(self) -> list[float]:
        """Seconds since each attached rank's latest heartbeat, by rank (the metrics); empty when none."""
        a, now = self._attached, time.monotonic()
        return [self._liveness.silent(a.ranks[i], now) for i in sorted(a.ranks)] if a else []

    def start(self, timeout: float | None = None) -> list[PlaneInfo]:
        """Attach a fresh data plane (one launched after any attached before) and return its handshakes.

        A healthy attached data plane is retired first, so the one returned always starts empty at
        step 0 of a new epoch."""
        limit = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            if self._attached is not None:
                self._retire(self._attached, ExitCode.RESTART, "the control plane restarts the data plane")
                self._attached = None
            while True:
                now = time.monotonic()
                self._check(now)
                complete = [launch for launch in self._launches.values() if launch.complete()]
                if complete:
                    return self._attach(max(complete, key=lambda launch: launch.epoch))
                if now >= deadline:
                    raise DataPlaneUnavailable(f"no data plane attached at {self.address} within {limit:.0f}s; "
                                               f"waiting: {self._describe_pending()}")
                self._pump(min(deadline - now, 0.1))

    def execute(self, desc: StepDescriptor) -> StepResult:
        """Send the step to every rank and wait for rank 0's result; DataPlaneUnavailable on failure."""
        self.submit(desc)
        return self.collect(desc.step_id)

    def submit(self, desc: StepDescriptor) -> None:
        """Send a step without waiting, so the engine can queue step N+1 while step N runs (overlap)."""
        frames = codec.encode_descriptor(desc)
        self.descriptor_bytes += sum(memoryview(f).nbytes for f in frames)
        with self._lock:
            launch = self._require()
            for r in launch.ranks.values():
                try:
                    self._sock.send_multipart([r.data_ident, *frames], zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as e:  # EHOSTUNREACH (gone) or EAGAIN (not reading)
                    self._fail(f"rank {r.rank} (pid {r.pid}) is unreachable: {e}")
                    raise DataPlaneUnavailable(self._failure) from None
            self._pending[desc.step_id] = None

    def collect(self, step_id: int) -> StepResult:
        """Wait for rank 0's result of a submitted step; at most step_timeout from now."""
        with self._lock:
            now = time.monotonic()
            deadline, next_check = now + self.step_timeout, now + 0.1
            while True:
                self._require()
                if self._pending.get(step_id) is not None:
                    return self._pending.pop(step_id)
                if step_id not in self._pending:
                    raise ValueError(f"step {step_id} was not submitted, or was collected already")
                try:
                    frames = self._sock.recv_multipart()
                    self._handle(frames[0], frames[1:], time.monotonic())
                except zmq.Again:
                    pass
                now = time.monotonic()
                if now >= next_check:
                    self._refresh()
                    next_check = now + 0.1
                if now >= deadline:
                    self._fail(f"step {step_id} got no result within {self.step_timeout:.0f}s")

    def close(self, stop_data_plane: bool = True, exit_code: int = ExitCode.STOPPED) -> None:
        """Release the socket; with stop_data_plane the ranks are told to exit with exit_code (0: no restart).

        Without it they are left alone and exit by their control_timeout, as after a control-plane crash."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if stop_data_plane:
                for launch in list(self._launches.values()):
                    self._retire(launch, exit_code, "the control plane stopped" if exit_code == ExitCode.STOPPED
                                 else "the control plane went away; restart to re-attach")
            self._attached = None
            self._failure = "the data-plane client is closed"
            self._sock.close(linger=1000 if stop_data_plane else 0)
        self._watcher.join(timeout=5)
        self._port.release()

    # Everything below runs with self._lock held.

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.1)
            if self._lock.acquire(blocking=False):
                try:
                    if not self._closed:
                        self._refresh()
                finally:
                    self._lock.release()

    def _refresh(self) -> None:
        """Read what is queued (PUMP_MAX at most, in turns between peers), then judge the ranks' liveness.
        In that order: after a stall of this process (SIGSTOP, swap, a long GC) the ranks' heartbeats wait
        in the socket, and their age is ours."""
        self._pump(0)
        self._check(time.monotonic())

    def _pump(self, timeout_s: float) -> None:
        """Handle the messages that arrive within timeout_s (and those already queued), PUMP_MAX at most."""
        if not self._sock.poll(max(timeout_s, 0) * 1000):
            return
        for _ in range(PUMP_MAX):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames[0], frames[1:], time.monotonic())

    def _send(self, ident: bytes, msg) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a departed peer: the liveness checks deal with it
            self._sock.send_multipart([ident, *codec.encode_control(msg)], zmq.NOBLOCK)

    def _handle(self, ident: bytes, frames: list[bytes], now: float) -> None:
        try:
            msg = codec.decode(frames)
        except codec.ProtocolError as e:
            # Rate-limited: anything that can reach the port can send these, thousands a second.
            self._ignored += 1
            if now - self._ignored_logged_at >= 1.0:
                log.warning("ignored %d malformed message(s) in %.0fs; the latest from peer %s: %s", self._ignored,
                            now - self._ignored_logged_at if self._ignored_logged_at else 0, ident.hex(), e)
                self._ignored, self._ignored_logged_at = 0, now
            return
        if isinstance(msg, codec.Result):  # first: the hot path
            launch, step_id = self._attached, msg.result.step_id
            if launch is None or msg.epoch != launch.epoch:
                return  # a retired data plane's late answer
            if ident == launch.ranks[0].data_ident and not msg.fatal:
                if self._pending.get(step_id, 0) is None:
                    self._pending[step_id] = msg.result
            elif not any(ident == r.data_ident for r in launch.ranks.values()):
                self._drop(ident, msg)  # whatever it says: a forged fatal result would end every stream
            elif msg.fatal:
                self._fail(msg.result.error)
        elif isinstance(msg, codec.Hello):
            self._hello(ident, msg, now)
        elif isinstance(msg, codec.Heartbeat):
            launch = self._launches.get(msg.launch_id)
            r = launch.ranks.get(msg.rank) if launch is not None and launch.epoch == msg.epoch else None
            if r is None:
                self._send(ident, codec.Shutdown(ExitCode.RESTART, "unknown data plane (it was replaced, or the "
                                                               "control plane restarted)"))
            elif ident != r.beat_ident:
                self._drop(ident, msg)
            else:
                self._liveness.heard(r, now)
                self._send(ident, codec.Heartbeat(msg.launch_id, msg.epoch, -1))
        elif isinstance(msg, codec.RankExited):
            launch = self._launches.get(msg.launch_id)
            if ident != self._launchers.get(msg.launch_id):
                self._drop(ident, msg)
            elif launch is None:
                pass  # a retired launch, or one whose ranks never said hello
            elif launch is self._attached:
                self._fail(f"rank {msg.rank} exited with code {msg.exit_code} (its launcher says)")
            else:
                self._retire(launch, ExitCode.RESTART, f"rank {msg.rank} exited before the data plane attached")
        elif isinstance(msg, codec.Ready):
            launch = self._launches.get(msg.launch_id)
            r = launch.ranks.get(msg.info.rank) if launch is not None else None
            if r is None or msg.info.epoch != launch.epoch or msg.info.world_size != launch.world_size:
                log.warning("ignored READY of an unknown or inconsistent rank: %s", msg.info)
            elif ident != r.data_ident and (r.data_ident or launch.sent(ident)):
                self._drop(ident, msg)  # a rank's data socket is the one it first said READY from
            else:
                r.data_ident, r.info = ident, msg.info
                self._liveness.heard(r, now)
                attached = self._attached
                if launch.complete() and attached is not None and attached is not launch:
                    # Said once, when its last rank reports: an operator would otherwise see a ready
                    # data plane that never gets a step.
                    log.info("data plane of epoch %d is ready and stands by: epoch %d is attached; the standby "
                             "takes over when the engine next restarts its data plane", launch.epoch, attached.epoch)
        else:
            log.warning("ignored an unexpected %s from peer %s", type(msg).__name__, ident.hex())

    def _drop(self, ident: bytes, msg: codec.Message) -> None:
        """A message that claims a launch's rank but comes from another socket: never acted on."""
        if ident in self._dropped_peers:
            return
        if len(self._dropped_peers) >= DROPPED_PEERS_KEPT:
            self._dropped_peers.clear()
        self._dropped_peers.add(ident)
        log.warning("dropped a %s from peer %s, which is not a socket of the launch it names (logged once a peer)",
                    type(msg).__name__, ident.hex())

    def _hello(self, ident: bytes, msg: codec.Hello, now: float) -> None:
        if msg.rank == LAUNCHER_RANK:  # before its ranks start: it makes no launch, only names its socket
            known = self._launchers.setdefault(msg.launch_id, ident)  # the first word; a forger's later changes nothing
            if known != ident:
                self._drop(ident, msg)
            elif len(self._launchers) > RETIRED_KEPT:
                del self._launchers[next(iter(self._launchers))]
            return
        if msg.launch_id in self._retired:
            self._send(ident, codec.Shutdown(ExitCode.RESTART, "this data plane was retired; restart it to re-attach"))
            return
        launch = self._launches.get(msg.launch_id)
        if launch is None:
            launch = self._launches[msg.launch_id] = Launch(msg.launch_id, self._next_epoch, msg.world_size)
            self._next_epoch += 1
        expected = self.world_size or launch.world_size
        if msg.world_size != expected or not 0 <= msg.rank < msg.world_size:
            self._retire(launch, ExitCode.CONFIG, f"rank {msg.rank} of a world of {msg.world_size}: this control plane "
                                              f"runs tensor-parallel size {expected}")
            self._send(ident, codec.Shutdown(ExitCode.CONFIG, f"tensor-parallel size {expected} expected"))
            return
        r = launch.ranks.get(msg.rank)
        if r is None:
            r = launch.ranks[msg.rank] = Rank(msg.rank, msg.pid, ident)
        elif ident != r.beat_ident:
            self._drop(ident, msg)
            return
        self._liveness.heard(r, now)
        self._send(ident, codec.Welcome(msg.launch_id, launch.epoch))

    def _check(self, now: float) -> None:
        if stall := self._liveness.judge(now):
            # Each rank's silence moves on by the stall, so the rank that fell silent first (the one
            # that died) is still the one named.
            log.warning("this process did not run for %.1fs (stopped or starved): the ranks' silence "
                        "of that time is not held against them", stall)
        launch = self._attached
        if launch is not None:
            # the first to fall silent is the news
            r = max(launch.ranks.values(), key=lambda r: self._liveness.silent(r, now))
            if (silent := self._liveness.silent(r, now)) > self.heartbeat_timeout:
                self._fail(f"rank {r.rank} (pid {r.pid}) sent no heartbeat for {silent:.1f}s")
        for pending in list(self._launches.values()):
            if pending is not self._attached and any(self._liveness.silent(r, now) > self.pending_timeout
                                                     for r in pending.ranks.values()):
                self._retire(pending, ExitCode.RESTART, "a rank of this data plane went silent before it attached")

    def _require(self) -> Launch:
        if self._attached is None:
            raise DataPlaneUnavailable(self._failure)
        return self._attached

    def _fail(self, reason: str) -> None:
        launch = self._attached
        if launch is None:
            return
        self._failure = f"data plane of epoch {launch.epoch} failed: {reason}"
        log.error("%s", self._failure)
        self._retire(launch, ExitCode.RESTART, reason)
        self._attached = None
        self._pending.clear()

    def _retire(self, launch: Launch, exit_code: int, reason: str) -> None:
        self._launches.pop(launch.launch_id, None)
        self._retired[launch.launch_id] = None
        if len(self._retired) > RETIRED_KEPT:
            del self._retired[next(iter(self._retired))]
        for r in launch.ranks.values():
            self._liveness.forget(r)
            self._send(r.beat_ident, codec.Shutdown(exit_code, reason))
            if r.data_ident:
                self._send(r.data_ident, codec.Shutdown(exit_code, reason))

    def _attach(self, launch: Launch) -> list[PlaneInfo]:
        for other in list(self._launches.values()):
            if other.epoch < launch.epoch:
                self._retire(other, ExitCode.RESTART, "a newer data plane attached")
        self._attached = launch
        self._failure = ""
        self._pending.clear()
        infos = [launch.ranks[i].info for i in range(launch.world_size)]
        log.info("attached data plane of epoch %d: %d rank(s), %d KV blocks", launch.epoch, launch.world_size,
                 min(i.num_kv_blocks for i in infos))
        return infos

    def _describe_pending(self) -> str:
        parts = [f"epoch {launch.epoch}: {sum(r.info is not None for r in launch.ranks.values())} of "
                 f"{launch.world_size} ranks ready" for launch in self._launches.values()]
        return "; ".join(parts) or "no rank has said hello"
