"""nanoplane/process.py (the plumbing both planes share) and the exit codes of the plane contract."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest

from nanoplane import process
from nanoplane.dataplane.launcher import _exit_code
from nanoplane.process import free_port, freeze_startup_objects, stop_process, terminate
from nanoplane.proto.exit_codes import ExitCode, killed_by


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"import signal, sys, time\n{code}\nprint('up', flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"  # its signal handling is in place
    return proc


def test_stop_process_terminates_then_kills():
    polite = child("")
    stop_process(polite, grace_s=10)
    assert polite.returncode == -signal.SIGTERM
    deaf = child("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    start = time.monotonic()
    stop_process(deaf, grace_s=0.5)
    assert deaf.returncode == -signal.SIGKILL and time.monotonic() - start >= 0.5


class Context:
    """A ZeroMQ context stand-in whose term() returns only once `released` is set."""

    def __init__(self):
        self.released = threading.Event()

    def term(self) -> None:
        self.released.wait()


def test_terminate_gives_up_on_a_hung_context(monkeypatch, caplog):
    monkeypatch.setattr(process, "TERM_WAIT_S", 0.2)
    hung, fine = Context(), Context()
    fine.released.set()
    with caplog.at_level(logging.WARNING, logger="nanoplane.process"):
        terminate(fine, "fine")
        assert not caplog.records
        start = time.monotonic()
        terminate(hung, "hung")
        assert time.monotonic() - start < 5
    assert [r.getMessage() for r in caplog.records] == [
        "ZeroMQ did not release the hung sockets within 0s; left to the process's exit"]
    hung.released.set()


class Node:
    pass


def frozen_cycle() -> weakref.ref:
    """An unreachable reference cycle sitting in the permanent generation, where no collection looks."""
    node = Node()
    node.me = node
    ref = weakref.ref(node)
    del node
    gc.freeze()
    return ref


def test_freeze_startup_objects_keeps_what_was_frozen_unless_thawed_first():
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the cycle's making and its freezing
    try:
        gc.collect()
        ref = frozen_cycle()
        freeze_startup_objects()
        assert ref() is not None and gc.get_freeze_count() > 0
        freeze_startup_objects(thaw_first=True)  # an engine process after a re-attach
        assert ref() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("raw, expected", [(0, ExitCode.STOPPED), (None, None), (75, ExitCode.RESTART),
                                           (-signal.SIGKILL, 128 + signal.SIGKILL)])
def test_a_rank_exit_is_reported_as_a_shell_reports_it(raw, expected):
    assert _exit_code(raw) == expected
    assert killed_by(signal.SIGTERM) == 128 + signal.SIGTERM
