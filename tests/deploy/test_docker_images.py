"""The Dockerfiles and what they build, without a Docker engine.

Each image's ENTRYPOINT/CMD parses with the real CLI; the control-plane image installs no torch and
its requirements follow pyproject.toml; every COPY source is in the build context (.dockerignore
included) and holds what installing the project needs. Last, the compose configuration runs on this
host: the control plane with only what its image installs, a CPU data plane attached, health checks
and a client.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # packaging: a dependency of transformers
from packaging.utils import canonicalize_name
from support.docker_config import (
    CP_REQUIREMENTS,
    DOCKERFILES,
    OURS,
    ROOT,
    dockerfile_env,
    dockerfile_instructions,
    dockerfile_one,
    effective_argv,
    environment,
    exec_form,
    host_port,
    mount_secrets,
    parse,
    service,
)

from nanoplane.plane_keys import write_keys
from nanoplane.process import free_port

# --- the Dockerfiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_dockerfile_entrypoint_and_cmd(name):
    path = DOCKERFILES[name]
    assert exec_form(dockerfile_one(path, "ENTRYPOINT") or "[]") == ["nanoplane"], f"{path.name} ENTRYPOINT"
    assert exec_form(dockerfile_one(path, "CMD") or "[]") == [name], f"{path.name} CMD"
    user = dockerfile_one(path, "USER")
    assert user and user.split(":")[0] not in ("root", "0"), f"{path.name} runs as root"
    # The image alone (no compose): the CMD must parse; the data plane needs its two required flags.
    env = {"NANOPLANE_MODEL": "/models/m", "NANOPLANE_CONTROL": "tcp://controlplane:5555"} \
        if name == "dataplane" else {}
    argv = exec_form(dockerfile_one(path, "ENTRYPOINT")) + exec_form(dockerfile_one(path, "CMD"))
    _, ns = parse(argv, env, path.name)
    if name == "controlplane":
        exposed = {int(p.split("/")[0]) for p in dockerfile_one(path, "EXPOSE").split()}
        assert {ns.port, host_port(ns.bind)[1]} <= exposed, f"{path.name} EXPOSEs {exposed}"


def run_lines(path: Path) -> list[str]:
    return [args for name, args in dockerfile_instructions(path) if name == "RUN"]


def pip_installs(path: Path) -> list[str]:
    return [cmd for line in run_lines(path) for cmd in re.split(r"&&|;", line) if re.search(r"\bpip3? install\b", cmd)]


def test_controlplane_image_installs_no_torch():
    path = DOCKERFILES["controlplane"]
    heavy = re.compile(r"\b(torch|triton|nvidia-[\w-]+|cuda[\w-]*)\b", re.I)
    for cmd in pip_installs(path):
        assert not heavy.search(cmd), f"{path.name} installs {cmd.strip()!r}"
        if re.search(r"\s\.(\[|\s|$)", cmd + " "):  # the project itself: its dependencies list torch
            assert "--no-deps" in cmd, f"{path.name} installs the project with its dependencies (torch): {cmd!r}"
    requirements = [Requirement(x) for x in _requirement_lines(CP_REQUIREMENTS)]
    names = {canonicalize_name(r.name) for r in requirements}
    assert not names & {"torch", "triton", "safetensors"}, f"{CP_REQUIREMENTS.name} lists {names}"
    assert any(CP_REQUIREMENTS.name in line for line in run_lines(path)), f"{path.name} never installs " \
                                                                          f"{CP_REQUIREMENTS.name}"


def test_dataplane_image_installs_torch():
    installs = " ".join(pip_installs(DOCKERFILES["dataplane"]))
    assert re.search(r"\btorch\b", installs), "the data-plane Dockerfile installs no torch"


def _requirement_lines(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def test_controlplane_requirements_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = {canonicalize_name(Requirement(d).name): Requirement(d) for d in project["dependencies"]}
    for line in _requirement_lines(CP_REQUIREMENTS):
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in ours, f"{CP_REQUIREMENTS.name} lists {req.name}, which pyproject.toml does not"
        assert req.specifier == ours[name].specifier, \
            f"{CP_REQUIREMENTS.name} asks {req}, pyproject.toml {ours[name]}: keep them in step"


def _dependency_closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution pip installs for these requirements (as installed in this environment)."""
    seen, todo = set(), [(r, frozenset(r.extras)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((sub, frozenset(sub.extras)))
    return {name for name, _ in seen}


def _image_like_path(tmp: Path) -> str:
    """A PYTHONPATH holding what the control-plane image holds: the packages its Dockerfile COPYs and
    the distributions its requirements pull in (linked from this environment), nothing else."""
    src, site = tmp / "src", tmp / "site"
    site.mkdir()
    copied = {Path(s).parts[0] for s in _copy_sources(DOCKERFILES["controlplane"])} & OURS
    assert "nanoplane" in copied, "the control-plane image does not copy nanoplane/"
    (src / "nanoplane").mkdir(parents=True)  # laid out as installed: every folder under nanoplane/
    for module in (ROOT / "nanoplane").iterdir():
        (src / "nanoplane" / module.name).symlink_to(module)
    for package in copied - {"nanoplane"}:
        (src / "nanoplane" / package).symlink_to(ROOT / package)
    # The image pip-installs the project, so its metadata is there (importlib.metadata.version("nanoplane")).
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (site / f"nanoplane-{version}.dist-info").mkdir()
    (site / f"nanoplane-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: nanoplane\nVersion: {version}\n")
    wanted = _dependency_closure([Requirement(x) for x in _requirement_lines(CP_REQUIREMENTS)])
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        base = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if ".." not in Path(f).parts}:
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    return os.pathsep.join([str(src), str(site)])


def _stop(proc: subprocess.Popen) -> str:
    """Its output after SIGTERM (SIGKILL after 30 s)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


def test_controlplane_image_runs_the_compose_configuration(tiny_models, tmp_path):
    """The compose topology on this host. The control plane runs under `python -S` with only what its
    image installs on the path (no torch; models/ and kernels/ never loaded); the data plane runs here (with
    torch, on the CPU). Each gets its service's compose environment, changed only where this host
    differs: the model, loopback addresses, free ports, the CPU. Then the health check fails while no
    data plane is attached, passes once one is, a client streams an answer, and stopping the control
    plane stops the data plane with exit 0 (what `restart: unless-stopped` relies on)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NANOPLANE_", "PYTHON"))}
    # The image's own ENV too (TRANSFORMERS_NO_ADVISORY_WARNINGS, NANOPLANE_MODEL_WAIT).
    image = dict(base, PYTHONPATH=_image_like_path(tmp_path), **dockerfile_env(DOCKERFILES["controlplane"]))
    image_python = [sys.executable, "-S", "-m", "nanoplane"]  # -S: not this environment's packages
    model = str(tiny_models["qwen3"])

    code = ("import sys\n"
            "import nanoplane.cli, nanoplane.controlplane.service, nanoplane.controlplane.grpc_server\n"
            "import nanoplane.controlplane.dataplane_client, nanoplane.clients.client\n"
            "nanoplane.cli.build_parser()\n"
            "from nanoplane.controlplane.tokenizer import Tokenizer\n"
            f"tok = Tokenizer({model!r})\n"
            "assert tok.decode(tok.encode('the quick brown fox')) == 'the quick brown fox'\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')\n"
            "               or m.split('.')[:2] in (['nanoplane', 'models'], ['nanoplane', 'kernels']))\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=image, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"the control-plane image cannot run its commands:\n{out.stderr[-3000:]}"
    assert "PyTorch was not found" not in out.stderr, "transformers' torch notice is back in the control plane's log"

    port, zmq_port = free_port(), free_port()
    cp_argv = effective_argv("controlplane", service("controlplane"))
    dp_argv = effective_argv("dataplane", service("dataplane"))
    write_keys(tmp_path / "plane-keys")  # each plane gets its secrets, at their targets under a folder of its own
    keys = {name: tmp_path / name / environment(service(name))["NANOPLANE_PLANE_KEYS"].lstrip("/")
            for name in ("controlplane", "dataplane")}
    for name in keys:
        mount_secrets(name, tmp_path / "plane-keys", tmp_path / name)
    cp_env = {**image, **environment(service("controlplane")), "NANOPLANE_MODEL": model,
              "NANOPLANE_HOST": "127.0.0.1", "NANOPLANE_PORT": str(port), "NANOPLANE_BIND": f"tcp://127.0.0.1:{zmq_port}",
              "NANOPLANE_PLANE_KEYS": str(keys["controlplane"])}
    dp_env = {**base, **environment(service("dataplane")), "NANOPLANE_MODEL": model, "NANOPLANE_DEVICE": "cpu",
              "NANOPLANE_CONTROL": f"tcp://127.0.0.1:{zmq_port}", "NANOPLANE_PLANE_KEYS": str(keys["dataplane"])}

    def health() -> tuple[int, str]:
        r = subprocess.run(image_python + ["health", "--server", f"127.0.0.1:{port}"], cwd=tmp_path, env=image,
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout.strip()

    procs = []
    try:
        cp = subprocess.Popen(image_python + cp_argv[1:], cwd=tmp_path, env=cp_env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        procs.append(cp)
        assert health()[0] == 1, "healthy with no data plane attached"
        dp = subprocess.Popen([sys.executable, "-m", "nanoplane"] + dp_argv[1:], cwd=ROOT, env=dp_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(dp)
        deadline, answer = time.monotonic() + 240, health()
        while answer[0] != 0 and time.monotonic() < deadline and cp.poll() is None and dp.poll() is None:
            time.sleep(0.5)
            answer = health()
        assert answer == (0, "SERVING"), f"health check answered {answer} (control plane exit {cp.poll()}, " \
                                         f"data plane exit {dp.poll()})"
        gen = subprocess.run(image_python + ["generate", "--server", f"127.0.0.1:{port}", "--max-tokens", "4", "hi"],
                             cwd=tmp_path, env=image, capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, f"generate through the server failed:\n{gen.stderr[-3000:]}"

        cp_log = _stop(cp)
        assert cp.returncode == 0, f"the control plane did not stop cleanly on SIGTERM:\n{cp_log[-3000:]}"
        assert "PyTorch was not found" not in cp_log, "the control plane's log says PyTorch was not found"
        try:
            dp_log = dp.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            dp_log = _stop(dp)
        assert dp.returncode == 0, f"the data plane exited {dp.returncode} when the control plane stopped:\n" \
                                   f"{dp_log[-3000:]}"
    finally:
        for proc in procs:
            _stop(proc)


# --- the build context -----------------------------------------------------------------------------


def _dockerignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str) -> bool:
    """Whether the builder leaves `path` (relative to the context) out: the last matching pattern wins,
    and a pattern that matches a parent folder covers what is inside it."""
    rules = []
    ignore = ROOT / ".dockerignore"
    for line in ignore.read_text().splitlines() if ignore.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, _dockerignore_regex(pattern)))
    parts = Path(path).parts
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for negate, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def _copy_sources(path: Path) -> list[str]:
    sources = []
    for name, args in dockerfile_instructions(path):
        if name not in ("COPY", "ADD"):
            continue
        words_ = [w for w in shlex.split(args) if not w.startswith("--")]
        if any(w.startswith("--from") for w in shlex.split(args)):
            continue  # from another stage, not the context
        sources += words_[:-1]
    return sources


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_dockerfile_copies_exist_in_the_build_context(name):
    path = DOCKERFILES[name]
    sources = _copy_sources(path)
    assert sources, f"{path.name} copies nothing"
    for src in sources:
        matches = [p for p in ROOT.glob(src)] if any(c in src for c in "*?[") else [ROOT / src]
        assert matches and all(p.exists() for p in matches), f"{path.name}: COPY {src}: no such file"
        for p in matches:
            files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
            kept = [f for f in files if not dockerignored(str(f.relative_to(ROOT)))]
            assert kept, f"{path.name}: COPY {src}: .dockerignore leaves it out of the build context"
            if p.is_dir():  # the Python files of a package, all of them
                lost = [f for f in files if f.suffix == ".py" and dockerignored(str(f.relative_to(ROOT)))]
                assert not lost, f"{path.name}: .dockerignore leaves out {lost[:3]}"


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_dockerfile_copies_what_installing_the_project_needs(name):
    path = DOCKERFILES[name]
    copied = {Path(src).parts[0] for src in _copy_sources(path)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert {"pyproject.toml", project["project"]["readme"]} <= copied, f"{path.name} copies {sorted(copied)}"
    # Every folder the distribution installs (the package list maps each under `nanoplane`), or it cannot build.
    setuptools = project["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p) for p in setuptools["packages"] if p.count(".") <= 1}
    assert folders <= copied, f"{path.name} does not copy {sorted(folders - copied)}"


def test_model_folder_stays_out_of_the_build_context():
    for big in ("models-cache/Qwen3-0.6B/model.safetensors", ".venv/bin/python", ".git/HEAD", "tests/conftest.py"):
        assert dockerignored(big), f".dockerignore sends {big} to the builder"
