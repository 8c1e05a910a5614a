"""The light client distribution (clients/pyproject.toml): its wheel holds the client and the generated
nanoplane.v1 modules under `nanoplane_client` and nothing of the server; installed with --no-deps into a
fresh virtualenv beside only its declared dependencies (and theirs) (no torch, no nanoplane), it talks to a real server.
Building needs hatchling and the venv needs grpcio and protobuf, from the package registry."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from support.grpc_server import ServerThread

from nanoplane.clients import Client

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("client-wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(CLIENTS)],
                   check=True, cwd=out, timeout=600)
    found, = out.glob("nanoplane_client-*.whl")
    return found


def test_the_wheel_holds_the_client_and_the_stubs_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"nanoplane_client"}, tops  # never `nanoplane`: the server's package stays its own
    code = {n for n in names if n.endswith(".py")}
    assert code == {"nanoplane_client/__init__.py", "nanoplane_client/clients/__init__.py",
                    "nanoplane_client/clients/client.py", "nanoplane_client/proto/__init__.py",
                    "nanoplane_client/proto/nanoplane/__init__.py", "nanoplane_client/proto/nanoplane/v1/__init__.py",
                    "nanoplane_client/proto/nanoplane/v1/generation_pb2.py",
                    "nanoplane_client/proto/nanoplane/v1/generation_pb2_grpc.py"}, sorted(code)
    assert "nanoplane_client/proto/nanoplane/v1/generation.proto" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    required = {Requirement(line.split(":", 1)[1]).name for line in meta.splitlines()
                if line.startswith("Requires-Dist") and "extra ==" not in line}
    assert required == {"grpcio", "grpcio-health-checking", "protobuf", "tqdm"}, required


def _pinned(name: str) -> str:
    return f"{name}=={metadata.version(name)}"  # this environment's version: the registry's cache has it


def test_installed_alone_it_streams_from_a_real_server(wheel, tiny_models, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    deps = [Requirement(d).name for d in tomllib.loads((CLIENTS / "pyproject.toml").read_text())["project"]
            ["dependencies"]]
    # The wheel without dependencies, then what it declares (with theirs): nothing else comes along.
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    subprocess.run([python, "-m", "pip", "install", "-q", *map(_pinned, deps)], check=True, timeout=600)
    server = ServerThread(str(tiny_models["qwen3"]))
    try:
        with Client(server.address) as client:  # the server distribution's copy of the same client
            want = client.generate_text("the quick brown fox", temperature=0, max_tokens=6, ignore_eos=True)
        code = f"""
import sys
from nanoplane_client import Client
from nanoplane_client.proto.nanoplane.v1 import generation_pb2 as pb
with Client({server.address!r}) as c:
    assert c.health() == "SERVING", c.health()
    print(c.generate_text("the quick brown fox", temperature=0, max_tokens=6, ignore_eos=True), end="")
    assert c.model_info().max_model_len > 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nanoplane", "numpy", "transformers"))
assert not heavy, heavy
"""
        out = subprocess.run([python, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == want and want
    missing = subprocess.run([python, "-I", "-c", "import nanoplane"], capture_output=True, timeout=60)
    assert missing.returncode != 0, "the fresh venv has the server's package: the check above proves nothing"
