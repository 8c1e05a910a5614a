"""Folders for the serving processes' ZeroMQ ipc sockets, and the sweep of those a killed process left.

`nanoplane serve` binds its sockets in a fresh folder under the temp dir and removes it on exit; a
SIGKILL (the OOM killer, `docker kill`) skips that, and the folders pile up. Each folder made here
holds an `owner` file naming its process and that process's pid namespace, so the next start
removes the folders whose owner is gone. It never removes a folder without that file, one whose
owner still runs, or one made in another pid namespace (a container sharing /tmp with this one,
whose pids mean nothing here).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

OWNER = "owner"
PREFIX = "nanoplane-"


def make(kind: str = "") -> str:
    """A new folder `nanoplane-<kind>…` in the temp dir, owned by this process; stale ones go first."""
    sweep()
    path = tempfile.mkdtemp(prefix=PREFIX + kind)
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(f"{os.getpid()} {_pid_namespace()}\n")
    return path


def sweep(root: str | None = None) -> list[str]:
    """Remove the `nanoplane-*` folders under root (the temp dir) whose owner process is gone."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    here = _pid_namespace()
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER)) as f:
                pid_text, namespace = f.read().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours to judge: another user's, an older version's, or being written
        if namespace != here or _alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        log.info("removed %d socket folder(s) left by killed nanoplane processes: %s", len(removed),
                 ", ".join(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"  # no /proc: pids are compared as they are
