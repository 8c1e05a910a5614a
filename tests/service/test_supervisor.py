"""`nanoplane serve`'s data-plane supervisor: it restarts a data plane that fails or asks for a restart,
and leaves one that the control plane stopped on purpose (exit 0, as at shutdown) stopped."""

from __future__ import annotations

import sys
import time

from nanoplane.controlplane.supervisor import DataPlaneSupervisor


def exiting_with(code: int) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


def test_a_data_plane_stopped_on_purpose_is_not_restarted():
    supervisor = DataPlaneSupervisor(exiting_with(0), min_restart_interval_s=0.01)
    supervisor.start()
    try:
        supervisor._thread.join(30)
        assert not supervisor._thread.is_alive() and supervisor.restarts == 0
    finally:
        supervisor.stop()


def test_a_failed_or_retired_data_plane_is_restarted():
    for code in (1, 75):
        supervisor = DataPlaneSupervisor(exiting_with(code), min_restart_interval_s=0.01)
        supervisor.start()
        try:
            deadline = time.monotonic() + 30
            while supervisor.restarts < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            supervisor.stop()
        assert supervisor.restarts >= 2 and not supervisor._thread.is_alive()


def wait_for(condition, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_data_plane_lost_but_still_running_is_stopped_and_restarted():
    """A hung data plane (a stopped rank cannot read the control plane's Shutdown) does not exit by
    itself: once the control plane has lost it for the grace period, the supervisor stops it and
    starts another. A data plane that is not ready yet (loading) or comes back in time is left alone."""
    hung = [sys.executable, "-c", "import time; time.sleep(600)"]
    supervisor = DataPlaneSupervisor(hung, min_restart_interval_s=0.01, lost_grace_s=1.0)
    supervisor.start()
    try:
        assert wait_for(lambda: supervisor.proc is not None)
        first = supervisor.proc
        supervisor.on_ready(False)  # never ready yet: still loading, not lost
        time.sleep(1.5)
        supervisor.on_ready(True)
        supervisor.on_ready(False)
        supervisor.on_ready(True)  # back within the grace
        time.sleep(1.5)
        assert supervisor.proc is first and first.poll() is None and supervisor.restarts == 0
        supervisor.on_ready(False)
        assert wait_for(lambda: supervisor.restarts == 1 and supervisor.proc is not first)
        assert first.poll() is not None  # stopped, and a new one runs in its place
        assert wait_for(lambda: supervisor.proc.poll() is None)
    finally:
        supervisor.stop()
    assert not supervisor._thread.is_alive()
