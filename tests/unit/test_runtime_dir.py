"""The serving processes' socket folders: the next start removes those whose owner was killed."""

from __future__ import annotations

import os
import subprocess
import sys

from nanoplane.controlplane import runtime_dir


def _folder(root, name: str, owner: str | None) -> str:
    path = os.path.join(root, name)
    os.mkdir(path)
    open(os.path.join(path, "commands.sock"), "w").close()
    if owner is not None:
        with open(os.path.join(path, runtime_dir.OWNER), "w") as f:
            f.write(owner)
    return path


def test_only_folders_of_dead_owners_in_this_pid_namespace_are_removed(tmp_path):
    here = runtime_dir._pid_namespace()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    killed = _folder(tmp_path, "nanoplane-engine-a", f"{dead.pid} {here}")
    killed_serve = _folder(tmp_path, "nanoplane-b", f"{dead.pid} {here}")
    running = _folder(tmp_path, "nanoplane-engine-c", f"{os.getpid()} {here}")
    elsewhere = _folder(tmp_path, "nanoplane-d", f"{dead.pid} pid:[1]")  # another container's pids
    unowned = _folder(tmp_path, "nanoplane-e", None)  # an older version's, or not written yet
    garbled = _folder(tmp_path, "nanoplane-f", "not a pid")
    other = _folder(tmp_path, "someone-else", f"{dead.pid} {here}")
    assert sorted(runtime_dir.sweep(str(tmp_path))) == sorted([killed, killed_serve])
    assert not os.path.exists(killed) and not os.path.exists(killed_serve)
    for kept in (running, elsewhere, unowned, garbled, other):
        assert os.path.isdir(kept), kept


def test_make_writes_the_owner_and_sweeps_first(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_dir.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = _folder(tmp_path, "nanoplane-engine-old", f"{dead.pid} {runtime_dir._pid_namespace()}")
    path = runtime_dir.make("engine-")
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("nanoplane-engine-")
    with open(os.path.join(path, runtime_dir.OWNER)) as f:
        assert f.read().split() == [str(os.getpid()), runtime_dir._pid_namespace()]
    assert not os.path.exists(stale)
    assert runtime_dir.sweep(str(tmp_path)) == []  # its own folder stays while it runs
