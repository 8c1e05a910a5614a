"""TLS, mutual TLS and bearer tokens on the gRPC port.

`ServerSecurity.from_files` checks every file at start-up (ValueError with one line that names the
file); the server then serves TLS through grpc's dynamic server credentials, whose fetcher re-reads the
certificate files on each new connection's handshake and switches to them when they changed (and
still make a valid pair), so a rotated certificate needs no restart. Bearer tokens are checked by a
grpc.aio interceptor against the token file, re-read when it changes (or on SIGHUP: `reload`).

grpc.health.v1 answers without a token: load balancers and Kubernetes probes carry none. Server
reflection needs one: it is a tool for people (grpcurl takes -H), and it lists the API to anyone.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # methods that need no token
TOKEN_RECHECK_S = 1.0  # how often the token file's state is looked at, at most


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror or e}") from None


def _check_pair(cert: str, key: str) -> None:
    """The stdlib's TLS loads the pair, as grpc's would: a key that does not match the certificate fails."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-cert {cert!r} and --tls-key {key!r} are not a certificate and its private key "
                         f"({e.reason or e})") from None


def _check_ca(path: str) -> None:
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as e:
        raise ValueError(f"--tls-client-ca {path!r} holds no CA certificate in PEM ({e.reason or e})") from None


@dataclass
class _Pem:
    cert: bytes
    key: bytes
    client_ca: bytes | None


class CertificateFiles:
    """The server's certificate, key and (mTLS) client CA, re-read when they change."""

    def __init__(self, cert: str, key: str, client_ca: str | None):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self.current = self._read()
        self._check()

    def _read(self) -> _Pem:
        return _Pem(_read(self.cert, "TLS certificate"), _read(self.key, "TLS key"),
                    _read(self.client_ca, "client CA") if self.client_ca else None)

    def _check(self) -> None:
        _check_pair(self.cert, self.key)
        if self.client_ca:
            _check_ca(self.client_ca)

    def config(self, pem: _Pem) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], pem.client_ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's certificate_configuration_fetcher, called at each handshake: a new configuration
        when the files changed and still make a valid set, else None (keep the current one)."""
        with self._lock:
            try:
                pem = self._read()
                if pem == self.current:
                    return None
                self._check()  # validates the pair (a half-written rotation waits for its other file)
            except ValueError as e:
                log.warning("keeping the current TLS certificate: %s", e)
                return None
            self.current = pem
            log.info("TLS certificate reloaded from %s", self.cert)
            return self.config(pem)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.config(self.current), self.fetch,
                                                   require_client_authentication=self.client_ca is not None)


class TokenFile:
    """Bearer tokens, one a line (blank lines and lines starting with # are skipped), re-read when the
    file changes; a file that turns unreadable or empty keeps the tokens read last."""

    def __init__(self, path: str):
        self.path = path
        self._state: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self.tokens = self._parse(_read(path, "token file"))
        self._state = self._stat()

    def _parse(self, data: bytes) -> tuple[bytes, ...]:
        lines = (line.strip() for line in data.splitlines())
        tokens = tuple(line for line in lines if line and not line.startswith(b"#"))
        if not tokens:
            raise ValueError(f"the token file {self.path!r} holds no token (one a line)")
        return tokens

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def reload(self, force: bool = False) -> None:
        with self._lock:
            state = self._stat()
            if not force and (state is None or state == self._state):
                return
            try:
                self.tokens = self._parse(_read(self.path, "token file"))
            except ValueError as e:
                log.warning("keeping the current tokens: %s", e)
                return
            self._state = state
            log.info("bearer tokens reloaded from %s (%d)", self.path, len(self.tokens))

    def accepts(self, token: bytes) -> bool:
        now = time.monotonic()
        if now - self._checked >= TOKEN_RECHECK_S:
            self._checked = now
            self.reload()
        ok = False
        for known in self.tokens:  # every one compared, in constant time: no early exit to time
            ok |= hmac.compare_digest(known, token)
        return ok


def _refusal(message: str) -> Callable:
    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refuse


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>` with a known token."""

    def __init__(self, tokens: TokenFile):
        self.tokens = tokens

    def _problem(self, metadata) -> str | None:
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return ("this server needs a bearer token: send the metadata 'authorization: Bearer <token>' "
                    "(nanoplane's client: --auth-token or --auth-token-file)")
        scheme, _, token = (values[0] if isinstance(values[0], str) else values[0].decode("latin-1")).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the authorization metadata must read 'Bearer <token>'"
        if not self.tokens.accepts(token.strip().encode()):
            return "the bearer token was not accepted"
        return None

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata)
        if problem is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED says nothing a token would hide
            return None
        refuse = _refusal(problem)
        kind = ("stream" if handler.request_streaming else "unary") + "_" + (
            "stream" if handler.response_streaming else "unary")
        return getattr(grpc, f"{kind}_rpc_method_handler")(refuse, handler.request_deserializer,
                                                           handler.response_serializer)


class ServerSecurity:
    """What the gRPC port asks of clients: TLS (with client certificates for mTLS), bearer tokens."""

    def __init__(self, certificates: CertificateFiles | None = None, tokens: TokenFile | None = None):
        self.certificates, self.tokens = certificates, tokens

    @classmethod
    def from_files(cls, tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None,
                   auth_token_file: str | None = None) -> ServerSecurity | None:
        """Checked at start-up: ValueError with one line on a missing or unreadable file, a key that
        does not match the certificate, or a flag that needs another one. None when nothing is asked."""
        if tls_client_ca and not tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked "
                             "only over TLS")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        certificates = CertificateFiles(tls_cert, tls_key, tls_client_ca) if tls_cert else None
        tokens = TokenFile(auth_token_file) if auth_token_file else None
        if tokens is not None and certificates is None:
            log.warning("bearer tokens without TLS travel in clear text: give --tls-cert and --tls-key "
                        "unless something in front of this port encrypts the traffic")
        return cls(certificates, tokens) if certificates or tokens else None

    def credentials(self) -> grpc.ServerCredentials | None:
        return self.certificates.credentials() if self.certificates else None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [BearerTokenInterceptor(self.tokens)] if self.tokens else []

    def reload(self) -> None:
        """SIGHUP: re-read the token file now (certificates are looked at on every handshake anyway)."""
        if self.tokens is not None:
            self.tokens.reload(force=True)
