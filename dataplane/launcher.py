"""Start the data plane: one process per tensor-parallel rank, attached to a control plane.

    python -m dataplane.launcher --model DIR --control tcp://HOST:PORT --tensor-parallel-size N

(`nanoplane dataplane ...` in the project CLI, through `add_arguments` and `launch`.) The ranks share
a random launch id, so the control plane groups them into one epoch. If any rank dies the launcher
kills the others and exits with a non-zero code: a partial tensor-parallel group is useless, and a
supervisor (systemd, Kubernetes) restarting the whole launcher is the recovery path. Exit code 0
means the control plane stopped the data plane on purpose. The launcher has a socket of its own to the
control plane (HELLO as rank -1 before the ranks start), on which it says which rank exited and how the
moment it sees one go: the control plane ends the streams at once instead of after a heartbeat timeout.

This module does not import torch; each rank imports it in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import signal
import sys
from multiprocessing.connection import wait

import zmq

from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.worker import WorkerOptions, plane_socket, run_rank
from nanoplane.plane_keys import plane_security
from nanoplane.process import configure_logging, free_port
from nanoplane.proto import codec
from nanoplane.proto.exit_codes import ExitCode, killed_by
from nanoplane.settings import add_options

# rank and epoch are not flags: the launcher numbers the ranks, the control plane assigns the epoch.
_NOT_FLAGS = {"model", "rank", "world_size", "epoch"}
STOP_GRACE_S = 5.0
NOTICE_LINGER_MS = 1000  # how long the launcher's last word (a rank exited) may take to leave

log = logging.getLogger("nanoplane.launcher")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `nanoplane dataplane`, as nanoplane.settings defines them; each DataPlaneConfig field
    that is a flag has its field name as the flag's dest."""
    add_options(parser, "dataplane")


def _exit_code(code: int | None) -> int | None:
    """A rank's exit code as a shell reports it (multiprocessing says -N for killed by signal N); None while
    it still runs, so a rank that outlived the grace period counts as crashed, not stopped."""
    if code is None:
        return None
    if code == 0:
        return ExitCode.STOPPED
    return killed_by(-code) if code < 0 else code


def launch(args: argparse.Namespace) -> int:
    """Run the ranks until they stop; return the exit code for the launcher."""
    configure_logging("launcher")
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(DataPlaneConfig) if f.name not in _NOT_FLAGS}
    fields.update(model=args.model, world_size=args.world_size)
    if args.world_size > 1 and not fields["dist_init"]:
        fields["dist_init"] = f"tcp://127.0.0.1:{free_port()}"
    keys = plane_security(args.control, args.plane_keys, args.insecure_plane, "data plane")
    opts = WorkerOptions(args.control, secrets.randbits(63), args.heartbeat_interval, args.control_timeout,
                         parent_pid=os.getpid(), keys=keys)
    with _Notifier(opts, args.world_size) as notifier:
        return _run(opts, fields, args, notifier)


class _Notifier:
    """The launcher's own socket to the control plane: it names itself (HELLO as rank -1), then tells of
    a rank that exited, so that the control plane need not wait for the rank's heartbeats to stop."""

    def __init__(self, opts: WorkerOptions, world_size: int):
        self.launch_id = opts.launch_id
        self.ctx = zmq.Context()
        self.sock = plane_socket(self.ctx, opts)
        self.sock.linger = NOTICE_LINGER_MS
        self.sock.connect(opts.control)
        # Queued until connected; sent before any rank exists, so it comes before any rank's word.
        self.sock.send_multipart(codec.encode_control(codec.Hello(opts.launch_id, -1, world_size, os.getpid())))
        self.told = False

    def rank_exited(self, rank: int, code: int) -> None:
        if self.told:  # the first exit is the news; the others are the launcher's own doing
            return
        self.told = True
        try:
            self.sock.send_multipart(codec.encode_control(codec.RankExited(self.launch_id, rank, code)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not tell the control plane that rank %d exited: %s", rank, e)

    def __enter__(self) -> _Notifier:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()  # lingers up to NOTICE_LINGER_MS for the notice
        self.ctx.term()


def _run(opts: WorkerOptions, fields: dict, args: argparse.Namespace, notifier: _Notifier) -> int:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(DataPlaneConfig(**fields, rank=r), opts), name=f"nanoplane-rank{r}",
                         daemon=True) for r in range(args.world_size)]

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("starting %d rank(s) of %s for control plane %s (launch %x)", len(procs), args.model,
             args.control, opts.launch_id)
    try:
        for p in procs:
            p.start()
        return _supervise(procs, notifier)
    except KeyboardInterrupt as e:
        # Stopping already: a second signal (Ctrl-C, then a supervisor's SIGTERM) must not cut _stop
        # short with a traceback and leave ranks behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.info("stopping the data plane (%s)", e)
        _stop(procs)
        notifier.rank_exited(0, _exit_code(procs[0].exitcode) or ExitCode.CRASHED)
        return killed_by(signal.SIGTERM if str(e) == "SIGTERM" else signal.SIGINT)


def _supervise(procs: list[mp.Process], notifier: _Notifier) -> int:
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        for p in [p for p in running if not p.is_alive()]:
            running.remove(p)
            if p.exitcode != 0:
                log.error("%s exited with %s: stopping the other ranks", p.name, p.exitcode)
                notifier.rank_exited(procs.index(p), _exit_code(p.exitcode) or ExitCode.CRASHED)
                _stop(running)
                return _exit_code(p.exitcode) or ExitCode.CRASHED
        if running and len(running) < len(procs):
            # One rank left cleanly (the control plane stopped us); the others got the same word.
            wait([p.sentinel for p in running], timeout=STOP_GRACE_S)
            codes = [_exit_code(p.exitcode) for p in running]
            _stop(running)
            if any(c is None for c in codes):
                return ExitCode.CRASHED
            return next((c for c in codes if c), ExitCode.STOPPED)
    return ExitCode.STOPPED


def _stop(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:  # a signal arrived before this one was started
            continue
        p.join(STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoplane dataplane", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return launch(parser.parse_args(argv))
    except ValueError as e:  # e.g. a tcp:// link without keys: one line, as `nanoplane dataplane` says it
        print(f"nanoplane: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
