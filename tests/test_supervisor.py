"""`nanoplane serve`'s data-plane supervisor: it restarts a data plane that fails or asks for a restart,
and leaves one that the control plane stopped on purpose (exit 0, as at shutdown) stopped."""

from __future__ import annotations

import sys
import time

from controlplane.serve import DataPlaneSupervisor


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
