"""The images built by a real Docker engine: the control-plane image runs its commands without torch, and
started with no model mounted it stays up, says what is missing once and reports unhealthy, rather than
exiting into its restart policy's loop. Needs a running Docker engine and the Python base image present
locally (no registry is assumed): NANOPLANE_TEST_PYTHON_IMAGE names another local Python 3.11+ image.
The build installs the pinned packages, so the builder needs the package registry."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
from support.docker_config import DOCKERFILES, ROOT

BASE = os.environ.get("NANOPLANE_TEST_PYTHON_IMAGE", "python:3.12-slim-bookworm")


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def controlplane_image() -> str:
    if shutil.which("docker") is None:
        pytest.skip("no docker command on this machine")
    if docker("info", check=False).returncode != 0:
        pytest.skip("no Docker engine is running (docker info fails)")
    if docker("image", "inspect", BASE, check=False).returncode != 0:
        pulled = docker("pull", BASE, timeout=300, check=False)
        if pulled.returncode != 0:
            pytest.skip(f"the base image {BASE} is not present locally and cannot be pulled (no registry): "
                        "load it, or set NANOPLANE_TEST_PYTHON_IMAGE to a local Python 3.11+ image")
    tag = f"nanoplane-controlplane:test-{uuid.uuid4().hex[:8]}"
    built = subprocess.run(["docker", "build", "-f", str(DOCKERFILES["controlplane"]), "--build-arg",
                            f"PYTHON_IMAGE={BASE}", "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, f"docker build failed:\n{built.stderr[-4000:]}"
    yield tag
    docker("image", "rm", "-f", tag, check=False)


def test_the_image_has_no_torch_and_no_torch_notice(controlplane_image):
    out = docker("run", "--rm", controlplane_image, "health", "--help")
    assert out.returncode == 0 and "PyTorch was not found" not in out.stderr + out.stdout
    probe = docker("run", "--rm", "--entrypoint", "python", controlplane_image, "-c",
                   "import importlib.util as u, nanoplane.controlplane.tokenizer; print(u.find_spec('torch'))")
    assert probe.stdout.strip() == "None" and "PyTorch was not found" not in probe.stderr, probe


def test_without_a_model_it_waits_and_says_so_once(controlplane_image):
    name = f"nanoplane-nomodel-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "-e", "NANOPLANE_MODEL=/models/absent", controlplane_image)
    try:
        time.sleep(8)
        state = docker("inspect", "-f", "{{.State.Status}} {{.RestartCount}}", name).stdout.split()
        assert state == ["running", "0"], f"the container is {state}: it should wait, not exit"
        logs = docker("logs", name)
        text = logs.stdout + logs.stderr
        assert text.count("no model at /models/absent") == 1 and "NANOPLANE_MODEL_DIR" in text, text
        assert "Traceback" not in text
    finally:
        docker("rm", "-f", name, check=False)
