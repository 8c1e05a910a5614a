"""Exit codes of the plane contract: how a data plane (launcher or rank) tells its supervisor what to do next.

A supervisor (`nanoplane serve`'s, systemd, Kubernetes) restarts on anything but STOPPED; the codes
say why, for the operator and for supervisors that tell "restart" from "failed".
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    STOPPED = 0  # the control plane stopped the data plane on purpose: do not restart it
    CRASHED = 1  # a rank failed (an exception, a dead peer): restart the whole data plane
    CONFIG = 2  # a configuration the control plane can never serve (wrong world size): a restart will not help
    RESTART = 75  # EX_TEMPFAIL: the control plane went away or retired this data plane; restart it to re-attach


# Killed by signal N exits with SIGNAL_BASE + N, as a shell reports it.
SIGNAL_BASE = 128


def killed_by(signum: int) -> int:
    """The exit code of a process ended by signal `signum`."""
    return SIGNAL_BASE + signum
