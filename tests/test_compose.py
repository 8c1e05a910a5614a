"""docker-compose.yml and the Dockerfiles against the real CLI, without a Docker engine.

Every command a container runs (compose `command`/`entrypoint` over the Dockerfile's ENTRYPOINT/CMD,
and each health check) must parse with `controlplane.cli.build_parser()` under that service's
`environment:`; every NANOPLANE_* variable must name a flag of that command and take effect; the two
planes must agree with each other; the images must be buildable from what the context holds, and the
control-plane image must install no torch. Last, the compose configuration runs on this host: the
control plane with only what its image installs, a CPU data plane attached, health checks and a client.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import json
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
import yaml  # PyYAML and packaging: dependencies of transformers
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from controlplane.cli import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = {"controlplane": ROOT / "docker" / "controlplane.Dockerfile",
               "dataplane": ROOT / "docker" / "dataplane.Dockerfile"}
CP_REQUIREMENTS = ROOT / "docker" / "requirements-controlplane.txt"
OURS = {"proto", "controlplane", "dataplane", "models", "kernels", "clients"}
MODEL_MOUNT = "/models"


# --- compose: load and interpolate as `docker compose` does --------------------------------------

_VAR = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt}, $VAR and $$.

    A variable that is unset and has no default fails: the file must work with no variable set."""

    def sub(m: re.Match) -> str:
        if m["dollar"]:
            return "$"
        expr = m["plain"] or m["braced"]
        b = _BRACED.fullmatch(expr)
        if not b:
            raise ValueError(f"unsupported interpolation ${{{expr}}} in {text!r}")
        name, op, arg = b["name"], b["op"], b["arg"]
        value = env.get(name)
        unset = value is None if op in ("-", "?", "+") else not value
        if op in (":-", "-"):
            return arg if unset else value
        if op in (":+", "+"):
            return "" if unset else arg
        if unset:  # no default: plain ${VAR}, or ${VAR:?err}
            raise ValueError(f"{text!r} needs ${name} set: give it a default (${{{name}:-...}})")
        return value

    return _VAR.sub(sub, text)


def expand(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [expand(x, env) for x in node]
    if isinstance(node, dict):
        return {k: expand(v, env) for k, v in node.items()}
    return node


def load_compose(env: dict[str, str] | None = None) -> dict:
    """The compose file with `${...}` expanded against `env` only (not this shell's variables)."""
    with open(COMPOSE) as f:
        doc = yaml.safe_load(f)  # SafeLoader resolves `<<: *anchor` merges, as compose does
    return expand(doc, env or {})


def service(name: str, env: dict[str, str] | None = None) -> dict:
    services = load_compose(env).get("services") or {}
    assert name in services, f"docker-compose.yml has no service {name!r} (has {sorted(services)})"
    return services[name]


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    out = {}
    for key, value in env.items():
        assert value is not None, f"environment {key} takes its value from the host shell: set it here"
        out[str(key)] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def words(value) -> list[str]:
    """A compose command/entrypoint: a list as is, a string split as compose splits it (no shell)."""
    if value is None:
        return []
    return [str(w) for w in value] if isinstance(value, list) else shlex.split(value)


# --- Dockerfiles ---------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        instr, _, rest = current.strip().partition(" ")
        out.append((instr.upper(), rest.strip()))
        current = ""
    assert not current, f"{path.name} ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    if args.startswith("["):
        return json.loads(args)
    return ["/bin/sh", "-c", args]


def dockerfile_one(path: Path, instr: str) -> str | None:
    """The last `instr` of the final stage (later ones override earlier ones)."""
    found = None
    for name, args in dockerfile_instructions(path):
        if name == "FROM":
            found = None
        elif name == instr:
            found = args
    return found


def dockerfile_healthcheck(path: Path) -> list[str] | None:
    args = dockerfile_one(path, "HEALTHCHECK")
    if args is None or args.upper() == "NONE":
        return None
    m = re.match(r"((?:--\S+\s+)*)CMD\s+(.*)", args, re.S)
    assert m, f"{path.name}: HEALTHCHECK without CMD: {args!r}"
    return exec_form(m[2].strip())


def healthcheck_argv(test) -> list[str]:
    """A compose healthcheck `test` as the argv it runs (up to any shell operator)."""
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    kind, rest = test[0], [str(w) for w in test[1:]]
    assert kind in ("CMD", "CMD-SHELL"), f"healthcheck test {test!r}"
    if kind == "CMD-SHELL":
        rest = shlex.split(" ".join(rest))
        for i, w in enumerate(rest):
            if w in ("||", "&&", "|", ";"):
                return rest[:i]
    return rest


def effective_argv(name: str, svc: dict) -> list[str]:
    """What the container runs: compose's entrypoint/command over the image's ENTRYPOINT/CMD.

    As in Docker, a compose `entrypoint` also drops the image's CMD."""
    dockerfile = DOCKERFILES[name]
    entrypoint_args, cmd_args = dockerfile_one(dockerfile, "ENTRYPOINT"), dockerfile_one(dockerfile, "CMD")
    if "entrypoint" in svc:
        entrypoint, default_cmd = words(svc["entrypoint"]), []
    else:
        entrypoint = exec_form(entrypoint_args) if entrypoint_args else []
        default_cmd = exec_form(cmd_args) if cmd_args else []
    command = words(svc["command"]) if "command" in svc else default_cmd
    return entrypoint + command


# --- the real CLI --------------------------------------------------------------------------------


@contextlib.contextmanager
def only_environment(env: dict[str, str]):
    """os.environ with no NANOPLANE_* variable but those in env (the CLI reads defaults from it)."""
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith("NANOPLANE_")]:
            del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse(argv: list[str], env: dict[str, str], where: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse a container's argv with the CLI, under that container's environment; fail with argparse's
    own message when it refuses."""
    assert argv[:1] == ["nanoplane"], f"{where} runs {argv!r}, not the nanoplane command"
    from controlplane.cli import build_parser

    err, problem = io.StringIO(), None
    with only_environment(env), contextlib.redirect_stderr(err):
        try:
            parser = build_parser()
            ns = parser.parse_args(argv[1:])
        except (ValueError, TypeError) as e:  # a variable the CLI cannot convert (NANOPLANE_PORT=abc)
            problem = f"the CLI rejects the environment {env}: {e!r}"
        except SystemExit as e:
            problem = f"`{shlex.join(argv)}` is refused by the CLI (exit {e.code}) under {env}:\n{err.getvalue()}"
    if problem:
        pytest.fail(f"{where}: {problem}")
    return parser, ns


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise AssertionError("the CLI has no subcommands")


def run_service(name: str, env: dict[str, str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    svc = service(name, env)
    parser, ns = parse(effective_argv(name, svc), environment(svc), f"service {name}")
    return parser, ns


def host_port(address: str) -> tuple[str, int]:
    m = re.fullmatch(r"(?:tcp://)?\[?([^\]]*)\]?:(\d+)", address)
    assert m, f"not a host:port address: {address!r}"
    return m[1], int(m[2])


def size_bytes(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", str(size).strip().lower())
    assert m, f"not a size: {size!r}"
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))


# --- the commands ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_service_command_parses_under_its_environment(name):
    svc = service(name)
    build = svc.get("build") or {}
    assert (ROOT / build.get("context", ".")).is_dir()
    assert (ROOT / build.get("context", ".") / build.get("dockerfile", "")).resolve() == DOCKERFILES[name], \
        f"service {name} is not built from {DOCKERFILES[name].relative_to(ROOT)}"
    _, ns = run_service(name)
    assert ns.command == name, f"service {name} runs `nanoplane {ns.command}`"


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_every_nanoplane_variable_is_a_flag_that_takes_effect(name):
    svc = service(name)
    parser, ns = run_service(name)
    flags = {}
    for action in subparser(parser, ns.command)._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                flags["NANOPLANE_" + option[2:].replace("-", "_").upper()] = action
    problems = []
    for key, value in environment(svc).items():
        if not key.startswith("NANOPLANE_"):
            continue
        action = flags.get(key)
        if action is None:
            problems.append(f"{key} names no flag of `nanoplane {ns.command}` (a typo, or the other plane's flag?)")
            continue
        if action.nargs == 0:  # a switch
            expected = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            expected = action.type(value) if action.type else value
        if action.choices and expected not in action.choices:
            problems.append(f"{key}={value} is not one of {list(action.choices)}")
        got = getattr(ns, action.dest)
        if got != expected:
            problems.append(f"{key}={value} did not reach {action.option_strings[0]} (parsed {got!r})")
    assert not problems, f"service {name}:\n" + "\n".join(problems)


def test_controlplane_healthchecks_ask_its_own_grpc_port():
    svc = service("controlplane")
    _, cp = run_service("controlplane")
    assert "healthcheck" in svc and not svc["healthcheck"].get("disable"), "the control plane needs a healthcheck"
    checks = {"docker-compose.yml": healthcheck_argv(svc["healthcheck"]["test"]),
              "controlplane.Dockerfile": dockerfile_healthcheck(DOCKERFILES["controlplane"])}
    for where, argv in checks.items():
        assert argv, f"{where} has no HEALTHCHECK for the control plane"
        _, ns = parse(argv, environment(svc), f"{where} healthcheck")
        assert ns.command == "health", f"{where} healthcheck runs `nanoplane {ns.command}`"
        host, port = host_port(ns.server)
        assert host in ("127.0.0.1", "localhost", "::1"), f"{where} healthcheck asks {host}, not this container"
        assert port == cp.port, f"{where} healthcheck asks port {port}; the control plane serves on {cp.port}"


def test_controlplane_publishes_its_grpc_port_on_all_interfaces():
    svc = service("controlplane")
    _, cp = run_service("controlplane")
    assert cp.host in ("0.0.0.0", "::", "[::]"), f"gRPC bound to {cp.host}: unreachable through a published port"
    published = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            published.append(int(p["target"]))
        else:
            published.append(int(str(p).split("/")[0].rsplit(":", 1)[-1]))
    assert cp.port in published, f"the gRPC port {cp.port} is not published (ports: {svc.get('ports')})"


def test_dataplane_connects_where_the_controlplane_binds():
    _, cp = run_service("controlplane")
    _, dp = run_service("dataplane")
    bind_host, bind_port = host_port(cp.bind)
    assert cp.bind.startswith("tcp://"), f"the control plane binds {cp.bind}: another container needs tcp://"
    assert bind_host in ("0.0.0.0", "*", "::"), f"the control plane binds {bind_host} only: other containers " \
                                                "cannot connect"
    host, port = host_port(dp.control)
    cp_svc = service("controlplane")
    names = {"controlplane", cp_svc.get("hostname"), cp_svc.get("container_name")}
    assert host in names, f"the data plane connects to {host}, not the control plane's service name"
    assert port == bind_port, f"the data plane connects to port {port}; the control plane binds {bind_port}"
    exposed = {int(str(p).split("/")[0]) for p in cp_svc.get("expose") or []}
    assert port in exposed, f"the control plane's compose service does not expose ZeroMQ port {port}"


def gpu_reservations(svc: dict) -> list[dict]:
    try:
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
    except (KeyError, TypeError):
        devices = []
    gpus = [d for d in devices if "gpu" in (d.get("capabilities") or [])]
    assert gpus, "the data plane has no deploy.resources.reservations.devices with capabilities [gpu]: no GPU"
    return gpus


@pytest.mark.parametrize("tp", [None, "2"])
def test_both_planes_agree_on_model_and_tensor_parallel_size(tp):
    env = {} if tp is None else {"NANOPLANE_TP": tp}
    _, cp = run_service("controlplane", env)
    _, dp = run_service("dataplane", env)
    assert cp.model == dp.model, f"control plane serves {cp.model}, data plane loads {dp.model}"
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        assert getattr(cp, name) == getattr(dp, name), f"the planes disagree on {name}"
    assert cp.tensor_parallel_size == dp.world_size, \
        f"the control plane waits for {cp.tensor_parallel_size} ranks, the data plane starts {dp.world_size}"
    if tp is not None:
        assert dp.world_size == int(tp), "NANOPLANE_TP does not set the tensor-parallel size"
    counts = [d.get("count") for d in gpu_reservations(service("dataplane", env))]
    assert counts and (counts[0] == "all" or int(counts[0]) == dp.world_size), \
        f"{dp.world_size} ranks but a reservation of {counts} GPUs"


def test_dataplane_reserves_gpus_and_shared_memory():
    svc = service("dataplane")
    _, dp = run_service("dataplane")
    assert dp.device.startswith("cuda"), f"the data plane runs on {dp.device}"
    gpus = [d for d in gpu_reservations(svc) if d.get("driver") == "nvidia"]
    assert gpus, "the data plane's GPU reservation is not for the nvidia driver"
    assert gpus[0].get("count") == "all" or "device_ids" in gpus[0] or int(gpus[0].get("count", 0)) >= 1
    # Docker's default /dev/shm is 64 MB: NCCL between the ranks fails with it.
    assert svc.get("ipc") == "host" or size_bytes(svc.get("shm_size", "64m")) >= 1 << 30, \
        f"shm_size {svc.get('shm_size')!r} is too small for NCCL (and no ipc: host)"


def model_mount(svc: dict) -> tuple[str, bool] | None:
    """(host source, read-only) of the volume mounted at MODEL_MOUNT, short or long syntax."""
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            if v.get("target") == MODEL_MOUNT:
                return str(v.get("source")), bool(v.get("read_only"))
        else:
            parts = str(v).split(":")
            if len(parts) > 1 and parts[1] == MODEL_MOUNT:
                return parts[0], len(parts) > 2 and "ro" in parts[2].split(",")
    return None


@pytest.mark.parametrize("name", ["controlplane", "dataplane"])
def test_both_mount_the_model_read_only(name):
    _, ns = run_service(name)
    mount = model_mount(service(name))
    assert mount, f"service {name} does not mount the model folder at {MODEL_MOUNT}"
    source, read_only = mount
    assert read_only, f"service {name} mounts the model read-write"
    assert source == "./models-cache", f"the model folder defaults to {source!r}"
    moved = model_mount(service(name, {"NANOPLANE_MODEL_DIR": "/srv/models"}))
    assert moved and moved[0] == "/srv/models", "NANOPLANE_MODEL_DIR does not move the model folder"
    assert ns.model.startswith(MODEL_MOUNT + "/") or ns.model == MODEL_MOUNT, \
        f"service {name} loads {ns.model}, outside the mounted {MODEL_MOUNT}"


def test_restart_and_startup_order():
    cp, dp = service("controlplane"), service("dataplane")
    # The launcher exits 0 when the control plane stops it on purpose (say, while restarting): a data
    # plane restarted only on failure would then stay down for good.
    for name, svc in (("controlplane", cp), ("dataplane", dp)):
        assert svc.get("restart") in ("always", "unless-stopped"), f"{name} restart: {svc.get('restart')!r}"
    depends = dp.get("depends_on") or {}
    if isinstance(depends, list):
        depends = {d: {"condition": "service_started"} for d in depends}
    assert "controlplane" in depends, "the data plane does not start after the control plane"
    # The control plane is healthy only once a data plane is attached: waiting for that deadlocks.
    assert depends["controlplane"].get("condition", "service_started") != "service_healthy", \
        "the data plane waits for a healthy control plane, which waits for a data plane: neither starts"


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
    src.mkdir()
    site.mkdir()
    for package in {Path(s).parts[0] for s in _copy_sources(DOCKERFILES["controlplane"])} & OURS:
        (src / package).symlink_to(ROOT / package)
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
    image installs on the path (no torch, no models/ or kernels/); the data plane runs here (with
    torch, on the CPU). Each gets its service's compose environment, changed only where this host
    differs: the model, loopback addresses, free ports, the CPU. Then the health check fails while no
    data plane is attached, passes once one is, a client streams an answer, and stopping the control
    plane stops the data plane with exit 0 (what `restart: unless-stopped` relies on)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NANOPLANE_", "PYTHON"))}
    image = dict(base, PYTHONPATH=_image_like_path(tmp_path))
    image_python = [sys.executable, "-S", "-m", "controlplane.cli"]  # -S: not this environment's packages
    model = str(tiny_models["qwen3"])

    code = ("import sys\n"
            "import controlplane.cli, controlplane.serve, controlplane.server, controlplane.remote, clients.client\n"
            "controlplane.cli.build_parser()\n"
            "from controlplane.tokenizer import Tokenizer\n"
            f"tok = Tokenizer({model!r})\n"
            "assert tok.decode(tok.encode('the quick brown fox')) == 'the quick brown fox'\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'models', 'kernels'))\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=image, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"the control-plane image cannot run its commands:\n{out.stderr[-3000:]}"

    port, zmq_port = free_port(), free_port()
    cp_argv = effective_argv("controlplane", service("controlplane"))
    dp_argv = effective_argv("dataplane", service("dataplane"))
    cp_env = {**image, **environment(service("controlplane")), "NANOPLANE_MODEL": model,
              "NANOPLANE_HOST": "127.0.0.1", "NANOPLANE_PORT": str(port), "NANOPLANE_BIND": f"tcp://127.0.0.1:{zmq_port}"}
    dp_env = {**base, **environment(service("dataplane")), "NANOPLANE_MODEL": model, "NANOPLANE_DEVICE": "cpu",
              "NANOPLANE_CONTROL": f"tcp://127.0.0.1:{zmq_port}"}

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
        dp = subprocess.Popen([sys.executable, "-m", "controlplane.cli"] + dp_argv[1:], cwd=ROOT, env=dp_env,
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
    if name == "dataplane":  # the whole project (the control plane's image takes what it loads, above)
        include = project["tool"]["setuptools"]["packages"]["find"]["include"]
        packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
                    and any(fnmatch.fnmatch(p.name, pat) for pat in include)}
        assert packages <= copied, f"{path.name} does not copy {sorted(packages - copied)}"


def test_model_folder_stays_out_of_the_build_context():
    for big in ("models-cache/Qwen3-0.6B/model.safetensors", ".venv/bin/python", ".git/HEAD", "tests/conftest.py"):
        assert dockerignored(big), f".dockerignore sends {big} to the builder"
