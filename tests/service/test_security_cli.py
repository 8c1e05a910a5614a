"""The commands' TLS and token flags, in real processes: `nanoplane serve` with TLS and a token file,
`nanoplane health` and `nanoplane generate --server` as clients of it, SIGHUP, and a bad configuration
refused at start with one line and exit 2. The server's side in depth: test_grpc_security.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.certificates import Authority

from nanoplane.clients.client import Client
from nanoplane.process import free_port, stop_process

ROOT = Path(__file__).resolve().parents[2]
TOKEN, NEW_TOKEN = "first-token", "second-token"


def nanoplane(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoplane", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority(folder, "ca")
    return dict(ca=ca, server=ca.issue("server", server=True), client=ca.issue("client", server=False))


@pytest.mark.parametrize("command", ["serve", "controlplane"])
def test_a_bad_configuration_stops_the_command_with_one_line(pki, tmp_path, command):
    server, ca = pki["server"], pki["ca"]
    (tmp_path / "unreadable").mkdir()  # a folder: unreadable as a file even for root
    cases = [
        (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(server.key)], "cannot read the TLS"),
        (["--tls-cert", str(server.cert), "--tls-key", str(pki["client"].key)], "not a certificate and its"),
        (["--tls-client-ca", str(ca.cert)], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(tmp_path / "nope")],
         "cannot read the client CA"),
        (["--auth-token-file", str(tmp_path / "unreadable")], "token file"),
    ]
    for flags, words in cases:
        done = nanoplane(command, "--port", str(free_port()), *flags)
        assert done.returncode == 2, (flags, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nanoplane: error: ") and words in lines[0], (flags, lines)


def test_serve_with_tls_and_tokens_and_its_clients(tiny_models, pki, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    (tmp_path / "client-token").write_text(f"# mine\n{TOKEN}\n")
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = pki["server"]
    proc = subprocess.Popen([sys.executable, "-m", "nanoplane", "serve", "--model", str(tiny_models["qwen3"]),
                             "--device", "cpu", "--port", str(port), "--tls-cert", str(server.cert),
                             "--tls-key", str(server.key), "--auth-token-file", str(tokens)], cwd=ROOT)
    trusted = ["--server", address, "--tls-ca", str(pki["ca"].cert)]
    try:
        with Client(address, tls_ca=pki["ca"].cert) as c:
            c.wait_until_serving(120, still_starting=lambda: proc.poll() is None)
        health = nanoplane("health", *trusted)  # no token: health stays open for probes
        assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
        plain = nanoplane("health", "--server", address, "--timeout", "5")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr

        ask = ["generate", *trusted, "--raw", "--max-tokens", "4", "the quick brown fox"]
        done = nanoplane(*ask, "--auth-token-file", str(tmp_path / "client-token"))
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        done = nanoplane(*ask)
        assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr and "bearer token" in done.stderr
        done = nanoplane(*ask, "--auth-token", NEW_TOKEN)
        assert done.returncode == 1 and "not accepted" in done.stderr

        tokens.write_text(f"{NEW_TOKEN}\n")
        proc.send_signal(signal.SIGHUP)  # re-read now; without a handler SIGHUP would end the server
        done = nanoplane(*ask, "--auth-token", NEW_TOKEN)
        assert done.returncode == 0, done.stderr
        assert proc.poll() is None
    finally:
        stop_process(proc)
