"""The images' versions are pinned (docker/constraints.txt, written by docker/pin_versions.py): what pip
resolves for the control plane's requirements under the constraints is pinned to the version, every pin
satisfies pyproject.toml, and each Dockerfile installs with them. Resolving asks the package registry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from support.docker_config import CP_REQUIREMENTS, DOCKERFILES, ROOT, dockerfile_instructions

CONSTRAINTS = ROOT / "docker" / "constraints.txt"


def pins() -> dict[str, Version]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{CONSTRAINTS.name}: {line} is not an exact pin"
            out[canonicalize_name(req.name)] = Version(spec.version)
    return out


def test_every_pin_satisfies_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins()
    for dep in project["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        if name in ("torch",):
            continue  # the data plane's TORCH_VERSION
        assert name in pinned, f"{CONSTRAINTS.name} does not pin {req.name}: run docker/pin_versions.py"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} breaks {req}"


def test_every_dockerfile_installs_with_the_constraints():
    for path in DOCKERFILES.values():
        runs = [args for instr, args in dockerfile_instructions(path) if instr == "RUN"]
        installs = [cmd for run in runs for cmd in re.split(r"&&|;", run) if re.search(r"\bpip install\b", cmd)]
        for cmd in installs:
            if "--no-deps" in cmd or "torch==" in cmd:
                continue  # the project itself; torch by TORCH_VERSION
            assert "-c /tmp/constraints.txt" in cmd, f"{path.name} installs without the pins: {cmd.strip()}"
        copies = " ".join(args for instr, args in dockerfile_instructions(path) if instr == "COPY")
        assert "docker/constraints.txt" in copies, f"{path.name} does not copy docker/constraints.txt"


def test_the_control_plane_resolves_to_pinned_versions_only(tmp_path):
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report",
                    str(report), "-c", str(CONSTRAINTS), "-r", str(CP_REQUIREMENTS)], check=True, timeout=600)
    pinned = pins()
    resolved = {canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
                for i in json.loads(report.read_text())["install"]}
    loose = sorted(set(resolved) - set(pinned))
    assert not loose, f"the image would install {loose} at whatever version: run docker/pin_versions.py"
    assert all(resolved[n] == pinned[n] for n in resolved)
