"""docker-compose.yml's gateway, replicas and operations settings, read as Docker reads them: the smg
services' commands parse with smg's own parser and point at the control planes' gRPC ports and model; the
"replicas" profile pairs each data plane with its own control plane behind a cache-aware gateway; every
container's log rotates, every service has resource limits, and no two services publish one host port."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from support.docker_config import (
    DOCKERFILES,
    ROOT,
    dockerfile_of,
    effective_argv,
    environment,
    host_port,
    load_compose,
    run_service,
    service,
    size_bytes,
)

smg_launch = pytest.importorskip("smg.launch_router", reason="the gateway comes from PyPI's smg (the dev extra)")

GATEWAYS = {"smg": ["controlplane"], "smg-replicas": ["controlplane", "controlplane-2"]}
PLANES = {"controlplane": "dataplane", "controlplane-2": "dataplane-2"}


def gateway_args(name: str, env: dict[str, str] | None = None):
    argv = effective_argv(name, service(name, env))
    assert argv[:2] == ["smg", "launch"], f"service {name} runs {argv[:2]}"
    return smg_launch.parse_router_args(argv[2:])


def published(svc: dict) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for p in svc.get("ports") or []:
        host, _, target = str(p).rpartition(":")
        out[int(target)] = int(host.rsplit(":", 1)[-1])
    return out


@pytest.mark.parametrize("name", sorted(GATEWAYS))
def test_the_gateway_routes_to_the_control_planes_over_vllm_grpc(name):
    args = gateway_args(name)
    assert args.backend == "vllm" and args.policy == "cache_aware", (args.backend, args.policy)
    want = []
    for plane in GATEWAYS[name]:
        _, cp = run_service(plane)
        assert args.model_path == args.tokenizer_path == cp.model, \
            f"{name} tokenizes with {args.tokenizer_path}, {plane} serves {cp.model}"
        want.append(f"grpc://{plane}:{cp.port}")
    assert args.worker_urls == want
    assert args.host == "0.0.0.0", f"{name} listens on {args.host}: unreachable through its published port"
    svc = service(name)
    assert args.port in published(svc), f"{name}'s HTTP port {args.port} is not published"
    assert str(args.prometheus_port) in map(str, svc.get("expose") or []), "its /metrics port is not exposed"
    check = " ".join(map(str, svc["healthcheck"]["test"]))
    assert re.search(rf"127\.0\.0\.1:{args.port}/v1/models", check), f"{name}'s healthcheck asks another port"
    assert any(v.endswith(":/models:ro") for v in svc["volumes"]), f"{name} does not mount the models read-only"
    assert dockerfile_of(name, svc) == DOCKERFILES["smg"]


def test_the_gateway_image_pins_the_tested_smg():
    constraints = (ROOT / "docker" / "constraints.txt").read_text()
    dev = (ROOT / "pyproject.toml").read_text()
    pinned = re.search(r'"smg==([\d.]+)"', dev)[1]
    assert f"smg=={pinned}\n" in constraints, "docker/constraints.txt does not pin the smg the tests use"
    assert "-c /tmp/constraints.txt smg" in DOCKERFILES["smg"].read_text()


@pytest.mark.parametrize("cp_name", sorted(PLANES))
def test_each_replica_pairs_its_own_planes(cp_name):
    _, cp = run_service(cp_name)
    _, dp = run_service(PLANES[cp_name])
    assert host_port(dp.control)[0] == cp_name and host_port(dp.control)[1] == host_port(cp.bind)[1], \
        f"{PLANES[cp_name]} connects to {dp.control}, not {cp_name}'s {cp.bind}"
    assert (cp.model, cp.tensor_parallel_size) == (dp.model, dp.world_size)
    secrets = {s["target"] for s in service(cp_name)["secrets"]}
    assert secrets == {s["target"] for s in service("controlplane")["secrets"]}, "the replicas are keyed alike"


def test_replicas_are_a_profile_of_their_own():
    services = load_compose()["services"]
    extra = {name for name, svc in services.items() if "replicas" in (svc.get("profiles") or [])}
    assert extra == {"controlplane-2", "dataplane-2", "smg-replicas"}, extra
    assert all(not svc.get("profiles") for name, svc in services.items() if name not in extra)
    ids = services["dataplane-2"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert ids.get("device_ids"), "the second data plane does not take GPUs of its own"


def test_no_two_services_publish_one_host_port():
    seen: dict[int, str] = {}
    for name, svc in load_compose()["services"].items():
        for host in published(svc).values():
            assert host not in seen, f"{name} and {seen[host]} both publish host port {host}"
            seen[host] = name


@pytest.mark.parametrize("name", sorted(load_compose()["services"]))
def test_every_service_rotates_its_log_and_has_limits(name):
    svc = service(name)
    logging = svc.get("logging") or {}
    assert logging.get("driver") == "json-file" and size_bytes(logging["options"]["max-size"]) <= 1 << 30 \
        and int(logging["options"]["max-file"]) >= 1, f"{name}'s log is not rotated: {logging}"
    limits = svc.get("deploy", {}).get("resources", {}).get("limits") or {}
    assert size_bytes(limits.get("memory", "0")) >= 1 << 30 and float(limits.get("cpus", 0)) >= 1, \
        f"{name} has no memory and CPU limits: {limits}"


def test_the_images_wait_for_a_missing_model_instead_of_looping():
    for name in ("controlplane", "dataplane"):
        text = DOCKERFILES[name].read_text()
        assert re.search(r"NANOPLANE_MODEL_WAIT=-1\b", text), f"{name}'s image exits when no model is mounted"
    assert "NANOPLANE_MODEL_WAIT" not in environment(service("controlplane")), "compose overrides the images' wait"


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_itself_accepts_the_file_with_every_profile(tmp_path):
    """Docker's own parser (the checks above read the YAML as compose would; this is compose)."""
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    keys = tmp_path / "keys"
    (keys / "authorized").mkdir(parents=True)
    for f in ("controlplane.key_secret", "controlplane.key", "dataplane.key_secret", "authorized/dataplane.key"):
        (keys / f).write_text("")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "NANOPLANE_PLANE_KEYS_DIR": str(keys)}
    out = subprocess.run([*command, "-f", str(ROOT / "docker-compose.yml"), "--profile", "replicas", "config"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("controlplane", "dataplane", "smg", "controlplane-2", "dataplane-2", "smg-replicas"):
        assert f"\n  {name}:\n" in out.stdout, f"compose's view lacks {name}"
