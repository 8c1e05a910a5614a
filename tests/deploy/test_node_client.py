"""clients/examples/node against a real server: installed with `npm ci` (npm's registry), it streams the
same greedy answer the Python client gets, through the wrapper-free `chat` field, and reports a failed call
by its status name. Skipped where node or npm is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support.grpc_server import ServerThread

from nanoplane.clients import Client

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "clients" / "examples" / "node"
PROTO = ROOT / "proto" / "nanoplane" / "v1" / "generation.proto"

pytestmark = pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")), reason="node and npm not installed")


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The example copied out of the checkout (so no node_modules lands in it), its packages installed."""
    folder = tmp_path_factory.mktemp("node") / "example"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("node_modules"))
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder, check=True, timeout=600)
    return folder


def _run(example: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", "generate.js", *args], cwd=example, env={"PATH": "/usr/bin:/bin",
                          "PROTO_PATH": str(PROTO)}, capture_output=True, text=True, timeout=120)


def test_the_node_example_streams_what_the_python_client_gets(example, tiny_models):
    server = ServerThread(str(tiny_models["qwen3"]))
    try:
        question = "the quick brown fox"
        with Client(server.address) as client:
            want = client.generate_text(messages=[{"role": "user", "content": question}], temperature=0,
                                        max_tokens=32)
        out = _run(example, server.address, question)
        assert out.returncode == 0, out.stderr
        assert out.stdout == want and want
        # keepCase, enums and defaults at work: snake_case names, the reason by name, zero counts present.
        assert "[FINISH_REASON_" in out.stderr and " prompt tokens, " in out.stderr, out.stderr
    finally:
        server.stop()
    down = _run(example, "127.0.0.1:9", "hi")  # nothing listens: a status name, exit 1, no stack trace
    assert down.returncode == 1 and "error UNAVAILABLE" in down.stderr, down.stderr
