"""Keeps a local data plane running for `nanoplane serve`: the launcher's command line, restarts when it
fails or asks for one, and a stop for one the control plane has lost but that still runs."""

from __future__ import annotations

import logging
import subprocess
import threading
import time

from nanoplane.process import stop_process
from nanoplane.proto.exit_codes import ExitCode

log = logging.getLogger("nanoplane.serve")

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
            if code == ExitCode.STOPPED and not stopped_here:
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
                stop_process(proc)
                return proc.wait(), True

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            stop_process(proc, timeout)
        self._thread.join(timeout)


