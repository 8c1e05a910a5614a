"""What docker-compose.yml and the Dockerfiles say, read as Docker reads them, without a Docker engine:
compose's variable interpolation, a Dockerfile's instructions, the argv a container runs, and that
argv parsed by the real CLI under the container's environment. Shared by tests/deploy/test_compose.py and
tests/deploy/test_docker_images.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of transformers

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = {"controlplane": ROOT / "docker" / "controlplane.Dockerfile",
               "dataplane": ROOT / "docker" / "dataplane.Dockerfile",
               "smg": ROOT / "docker" / "smg.Dockerfile"}
CP_REQUIREMENTS = ROOT / "docker" / "requirements-controlplane.txt"
OURS = {"nanoplane", "proto", "controlplane", "dataplane", "models", "kernels", "clients"}
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


def dockerfile_env(path: Path) -> dict[str, str]:
    """The environment the final stage's ENV instructions give a container (KEY=value forms)."""
    env: dict[str, str] = {}
    for name, args in dockerfile_instructions(path):
        if name == "FROM":
            env = {}
        elif name == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(args))
    return env


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


def shell_argv(command: str, env: dict[str, str]) -> list[str]:
    """What `sh -c command` runs first under `env`: its ${VAR:-default} / $VAR expanded, up to any operator."""
    argv = shlex.split(interpolate(command, env))
    for i, w in enumerate(argv):
        if w in ("||", "&&", "|", ";"):
            return argv[:i]
    return argv


def dockerfile_healthcheck(path: Path, env: dict[str, str] | None = None) -> list[str] | None:
    """The HEALTHCHECK's argv; a shell form's variables expanded from `env` (the container's)."""
    args = dockerfile_one(path, "HEALTHCHECK")
    if args is None or args.upper() == "NONE":
        return None
    m = re.match(r"((?:--\S+\s+)*)CMD\s+(.*)", args, re.S)
    assert m, f"{path.name}: HEALTHCHECK without CMD: {args!r}"
    argv = exec_form(m[2].strip())
    return shell_argv(argv[2], env or {}) if argv[:2] == ["/bin/sh", "-c"] else argv


def healthcheck_argv(test, env: dict[str, str] | None = None) -> list[str]:
    """A compose healthcheck `test` as the argv it runs (up to any shell operator); a CMD-SHELL's variables
    expanded from `env`, the container's environment (compose has already turned `$$` into `$`)."""
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    kind, rest = test[0], [str(w) for w in test[1:]]
    assert kind in ("CMD", "CMD-SHELL"), f"healthcheck test {test!r}"
    if kind == "CMD-SHELL":
        return shell_argv(" ".join(rest), env or {})
    return rest


def dockerfile_of(name: str, svc: dict) -> Path:
    """The Dockerfile of a service's image: its own `build`, or that of the service that builds its `image`
    (a replica runs the image another service builds)."""
    if name in DOCKERFILES:
        return DOCKERFILES[name]
    builders = {s.get("image"): s for s in (load_compose().get("services") or {}).values() if s.get("build")}
    assert svc.get("image") in builders, f"service {name} neither builds nor reuses a built image: {svc.get('image')}"
    build = builders[svc["image"]]["build"]
    return (ROOT / build.get("context", ".") / build["dockerfile"]).resolve()


def effective_argv(name: str, svc: dict) -> list[str]:
    """What the container runs: compose's entrypoint/command over the image's ENTRYPOINT/CMD.

    As in Docker, a compose `entrypoint` also drops the image's CMD."""
    dockerfile = dockerfile_of(name, svc)
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
    from nanoplane.cli import build_parser

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


# --- compose secrets -------------------------------------------------------------------------------


def mount_secrets(name: str, keys_dir: Path, into: Path, env: dict[str, str] | None = None) -> dict[str, Path]:
    """Copy the secrets service `name` mounts, as compose would mount them (each source file at its target),
    into `into` + target, with NANOPLANE_PLANE_KEYS_DIR set to `keys_dir`; return target -> copy."""
    doc = load_compose({**(env or {}), "NANOPLANE_PLANE_KEYS_DIR": str(keys_dir)})
    defined = doc.get("secrets") or {}
    out = {}
    for entry in doc["services"][name].get("secrets") or []:
        source = entry if isinstance(entry, str) else entry["source"]
        target = f"/run/secrets/{source}" if isinstance(entry, str) else entry.get("target", f"/run/secrets/{source}")
        if not target.startswith("/"):
            target = f"/run/secrets/{target}"
        assert source in defined and "file" in defined[source], f"service {name}: secret {source} has no file"
        copy = into / target.lstrip("/")
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(Path(defined[source]["file"]).read_bytes())
        out[target] = copy
    return out
