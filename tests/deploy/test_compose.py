"""docker-compose.yml against the real CLI, without a Docker engine.

Every command a container runs (compose `command`/`entrypoint` over the Dockerfile's ENTRYPOINT/CMD,
and each health check) must parse with `nanoplane.cli.build_parser()` under that service's
`environment:`; every NANOPLANE_* variable must name a flag of that command and take effect; the two
planes must agree with each other on model, addresses and GPUs. The images themselves:
tests/deploy/test_docker_images.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth
from support.docker_config import (
    DOCKERFILES,
    MODEL_MOUNT,
    ROOT,
    dockerfile_healthcheck,
    effective_argv,
    environment,
    healthcheck_argv,
    host_port,
    mount_secrets,
    parse,
    run_service,
    service,
    size_bytes,
    subparser,
)

from nanoplane.plane_keys import PlaneKeys, write_keys

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


@pytest.mark.parametrize("port", [None, "6000"])
@pytest.mark.parametrize("name", ["controlplane", "controlplane-2"])
def test_controlplane_healthchecks_ask_its_own_grpc_port(name, port):
    """Both health checks follow the port the container's NANOPLANE_PORT configures, also when changed."""
    svc = service(name)
    env = environment(svc) | ({"NANOPLANE_PORT": port} if port else {})
    _, cp = parse(effective_argv(name, svc), env, f"service {name}")
    assert "healthcheck" in svc and not svc["healthcheck"].get("disable"), "the control plane needs a healthcheck"
    checks = {"docker-compose.yml": healthcheck_argv(svc["healthcheck"]["test"], env),
              "controlplane.Dockerfile": dockerfile_healthcheck(DOCKERFILES["controlplane"], env)}
    for where, argv in checks.items():
        assert argv, f"{where} has no HEALTHCHECK for the control plane"
        _, ns = parse(argv, env, f"{where} healthcheck")
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



def test_each_plane_gets_only_its_own_keys_as_secrets(tmp_path):
    """The plane link is keyed in compose (tcp:// would refuse to start otherwise), and the secrets put
    exactly the files each side reads from its --plane-keys folder there, from one `nanoplane keys` run."""
    keys = tmp_path / "keys"
    write_keys(keys)
    loaded = {}
    for name in ("controlplane", "dataplane"):
        _, ns = run_service(name)
        assert ns.plane_keys and not ns.insecure_plane, f"service {name}: a tcp:// plane link without keys"
        into = tmp_path / name
        mounted = mount_secrets(name, keys, into)
        assert all(target.startswith(ns.plane_keys.rstrip("/") + "/") for target in mounted), \
            f"service {name} mounts secrets outside its --plane-keys {ns.plane_keys}: {sorted(mounted)}"
        folder = into / ns.plane_keys.lstrip("/")
        loaded[name] = PlaneKeys.control_plane(folder) if name == "controlplane" else PlaneKeys.data_plane(folder)
        secrets = {p.name for p in mounted.values() if p.name.endswith(".key_secret")}
        assert secrets == {f"{name}.key_secret"}, f"service {name} gets the secret keys {sorted(secrets)}"
    cp, dp = loaded["controlplane"], loaded["dataplane"]
    assert dp.server_public == cp.public, "the data plane holds another control plane's public key"
    accepted = [zmq.auth.load_certificate(p)[0] for p in Path(cp.authorized).glob("*.key")]
    assert dp.public in accepted, "the control plane does not accept the data plane's key"
