"""TLS, mTLS and bearer tokens on the gRPC port: a real grpc.aio server on 127.0.0.1 (in a thread of
this process, tests/support/grpc_server.py) with certificates from throwaway CAs made here, and the
Python client. The commands' side (flags, a bad configuration's exit 2, SIGHUP): test_security_cli.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.certificates import Authority
from support.grpc_server import ServerThread, rpc_error
from support.tiny_models import make_tiny_model

from nanoplane.clients import AsyncClient, Client
from nanoplane.controlplane import security as security_module
from nanoplane.controlplane.security import ServerSecurity

PROMPT = "the quick brown fox"
TOKEN, OTHER_TOKEN = "s3cret-token-1", "s3cret-token-2"
# Each test's clients get channels (and connections) of their own: a handshake per client.
OWN = [("grpc.use_local_subchannel_pool", 1)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("sec") / "tiny", arch="qwen3", seed=5))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, other = Authority(folder, "ca"), Authority(folder, "other-ca")
    return dict(ca=ca, other=other, server=ca.issue("server", server=True), client=ca.issue("client", server=False),
                stranger=other.issue("client", server=False))


def serve(model: str, **files) -> ServerThread:
    return ServerThread(model, security=ServerSecurity.from_files(**files))


def client(server: ServerThread, **kwargs) -> Client:
    return Client(server.address, OWN, **kwargs)


def generated(c: Client) -> list[int]:
    return [t for chunk in c.generate(PROMPT, temperature=0, max_tokens=4, ignore_eos=True) for t in chunk.token_ids]


def refused(fn) -> grpc.RpcError:
    """A call that must fail the handshake: UNAVAILABLE, quickly."""
    err = rpc_error(fn)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    return err


def test_tls_works_with_the_ca_and_fails_without(model, pki):
    s = serve(model, tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key))
    try:
        with client(s, tls_ca=pki["ca"].cert) as c:
            assert c.health(timeout=10) == "SERVING"
            assert len(generated(c)) == 4
        with client(s, tls_ca=pki["ca"].cert.read_bytes()) as c:  # PEM bytes work as well as a path
            assert c.tokenize(PROMPT)
        # A certificate the server did not ask for (one container's shared variables) changes nothing.
        with client(s, tls_ca=pki["ca"].cert, tls_cert=pki["server"].cert, tls_key=pki["server"].key) as c:
            assert c.health(timeout=10) == "SERVING"
        with client(s, tls_ca=pki["other"].cert) as c:  # a CA that did not sign the server's certificate
            refused(lambda: c.health(timeout=10))
        with client(s) as c:  # plaintext against TLS
            refused(lambda: c.health(timeout=10))
    finally:
        s.stop()


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(model, pki):
    s = serve(model, tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key),
              tls_client_ca=str(pki["ca"].cert))
    try:
        with client(s, tls_ca=pki["ca"].cert, tls_cert=pki["client"].cert, tls_key=pki["client"].key) as c:
            assert c.health(timeout=10) == "SERVING"
            assert len(generated(c)) == 4
        with client(s, tls_ca=pki["ca"].cert) as c:  # no client certificate
            refused(lambda: c.health(timeout=10))
            refused(lambda: generated(c))
        with client(s, tls_ca=pki["ca"].cert, tls_cert=pki["stranger"].cert, tls_key=pki["stranger"].key) as c:
            refused(lambda: c.health(timeout=10))
    finally:
        s.stop()


@pytest.fixture(scope="module")
def token_server(model, pki, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"# the operators' tokens\n{TOKEN}\n\n")
    s = serve(model, tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key), auth_token_file=str(tokens))
    yield s, tokens
    s.stop()


def test_calls_without_the_right_token_are_unauthenticated(token_server, pki):
    s, _ = token_server
    for token, words in ((None, "needs a bearer token"), (OTHER_TOKEN, "not accepted"), ("", "needs a bearer token")):
        with client(s, tls_ca=pki["ca"].cert, auth_token=token) as c:
            for call in (lambda: generated(c), lambda: c.tokenize(PROMPT), c.model_info, c.server_status):
                err = rpc_error(call)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.details(), (token, err)
    with grpc.secure_channel(s.address, grpc.ssl_channel_credentials(pki["ca"].cert.read_bytes())) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        err = rpc_error(lambda: list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), metadata=(("authorization", "Basic abc"),))))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer <token>" in err.details()


def test_the_right_token_works_and_health_needs_none(token_server, pki):
    s, _ = token_server
    with client(s, tls_ca=pki["ca"].cert, auth_token=TOKEN) as c:
        assert len(generated(c)) == 4
        assert c.tokenize(PROMPT) and c.model_info().max_model_len > 0
    with client(s, tls_ca=pki["ca"].cert) as c:
        assert c.health(timeout=10) == "SERVING"
    with grpc.secure_channel(s.address, grpc.ssl_channel_credentials(pki["ca"].cert.read_bytes())) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 metadata=(("authorization", f"bearer {TOKEN}"),)))
        assert "nanoplane.v1.Generation" in [svc.name for svc in answers[0].list_services_response.service]


def test_the_async_client_speaks_tls_with_a_token(token_server, pki):
    s, _ = token_server

    async def run(token: str | None) -> list[int]:
        async with AsyncClient(s.address, OWN, tls_ca=pki["ca"].cert, auth_token=token) as c:
            assert await c.health() == "SERVING"
            return [t async for chunk in c.generate(PROMPT, max_tokens=4, ignore_eos=True) for t in chunk.token_ids]

    assert len(asyncio.run(run(TOKEN))) == 4
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run(None))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_changed_token_file_is_picked_up_without_a_restart(token_server, pki, monkeypatch):
    s, tokens = token_server
    monkeypatch.setattr(security_module, "TOKEN_RECHECK_S", 0.0)
    try:
        tokens.write_text(f"{OTHER_TOKEN}\n")
        os.utime(tokens, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime, whatever the clock's grain
        with client(s, tls_ca=pki["ca"].cert, auth_token=OTHER_TOKEN) as c:
            assert len(generated(c)) == 4
        with client(s, tls_ca=pki["ca"].cert, auth_token=TOKEN) as c:
            assert rpc_error(lambda: c.tokenize(PROMPT)).code() == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text("")  # an emptied file keeps the tokens read last, rather than lock everyone out
        with client(s, tls_ca=pki["ca"].cert, auth_token=OTHER_TOKEN) as c:
            assert c.tokenize(PROMPT)
    finally:
        tokens.write_text(f"{TOKEN}\n")
        s.server.security.reload()


def test_a_rotated_certificate_is_served_to_new_connections(model, pki, tmp_path: Path):
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(pki["server"].cert.read_bytes())
    key.write_bytes(pki["server"].key.read_bytes())
    s = serve(model, tls_cert=str(cert), tls_key=str(key))
    try:
        with client(s, tls_ca=pki["ca"].cert) as c:
            assert c.health(timeout=10) == "SERVING"
        rotated = Authority(tmp_path, "rotated-ca").issue("server", server=True)
        cert.write_bytes(rotated.cert.read_bytes())  # the certificate first: until its key follows, the old pair
        with client(s, tls_ca=pki["ca"].cert) as c:
            assert c.health(timeout=10) == "SERVING"
        key.write_bytes(rotated.key.read_bytes())
        with client(s, tls_ca=tmp_path / "rotated-ca.pem") as c:
            assert c.health(timeout=10) == "SERVING"
            assert len(generated(c)) == 4
        with client(s, tls_ca=pki["ca"].cert) as c:
            refused(lambda: c.health(timeout=10))
    finally:
        s.stop()


def test_bad_configurations_are_refused_in_one_line(pki, tmp_path: Path):
    server = pki["server"]
    cases = [
        (dict(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(server.key)), "cannot read the TLS certificate"),
        (dict(tls_cert=str(server.cert), tls_key=str(pki["client"].key)), "not a certificate and its private key"),
        (dict(tls_client_ca=str(pki["ca"].cert)), "--tls-client-ca needs --tls-cert"),
        (dict(tls_cert=str(server.cert)), "go together"),
        (dict(tls_cert=str(server.cert), tls_key=str(server.key), tls_client_ca=str(server.key)), "no CA certificate"),
        (dict(auth_token_file=str(tmp_path / "missing")), "cannot read the token file"),
    ]
    (tmp_path / "empty").write_text("# nothing\n")
    cases.append((dict(auth_token_file=str(tmp_path / "empty")), "holds no token"))
    for files, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            ServerSecurity.from_files(**files)
        assert "\n" not in str(err.value)
