"""Python client for nanoplane's public API (nanoplane.v1.Generation over gRPC).

    with Client("localhost:50051") as c:
        for chunk in c.generate("Hello", temperature=0, max_tokens=16):
            print(chunk.text, end="", flush=True)
        c.generate_text(messages=[{"role": "user", "content": "Hi"}])
        c.generate_batch(["a", "b"], max_tokens=32)   # concurrent, with a progress bar

`AsyncClient` has the same methods as coroutines / async iterators. Sampling keyword arguments are
the fields of `nanoplane.v1.SamplingParams` (temperature, top_p, top_k, min_p, max_tokens, seed,
stop, stop_token_ids, ignore_eos, ...). Server errors surface as `grpc.RpcError` (sync) or
`grpc.aio.AioRpcError` (async) with the status code and the server's message. Leaving a stream
early cancels the call, and the server frees the request's resources.

A server with TLS: `Client(address, tls_ca="ca.pem")` (the CA that signed its certificate), plus
`tls_cert=` / `tls_key=` for mTLS; with bearer tokens: `auth_token="..."` (see docs/operations.md).
Each of tls_ca, tls_cert and tls_key is a file path or the PEM bytes themselves.

This package speaks gRPC like a client in any other language would: it imports `proto` and grpc
only, never the server's code. `pip install nanoplane-client` (clients/pyproject.toml) installs it
alone, without torch, as `nanoplane_client`: `from nanoplane_client import Client`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Relative: this folder is `nanoplane.clients` in the server's distribution and `nanoplane_client.clients`
# in the client's (clients/pyproject.toml), each with the generated modules at `..proto.nanoplane.v1`.
from ..proto.nanoplane.v1 import generation_pb2 as pb
from ..proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc

# Health's readiness service: SERVING while requests can run (liveness, service "": the process works).
READINESS = pb.DESCRIPTOR.services_by_name["Generation"].full_name

Prompt = str | Sequence[int] | Sequence[dict]  # text, token ids, or chat messages
Pem = str | Path | bytes  # a file's path, or PEM bytes
SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class Chunk:
    """One streamed message: what the request gained since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "eos", "length" or "abort" on a sample's last chunk
    usage: Usage | None = None  # on the first chunk (prompt counts) and the last (final counts)
    index: int = 0  # the sample (of the request's n) the chunk belongs to


@dataclass(slots=True)
class Completion:
    """A whole request's output, as `generate_batch` returns it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage


def _messages(messages: Sequence[dict]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def build_request(prompt: Prompt | None = None, *, messages: Sequence[dict] | None = None, request_id: str = "",
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a text / token-id / messages prompt and sampling keyword arguments."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt or messages")
    req = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if messages is not None or (prompt and not isinstance(prompt, str) and isinstance(prompt[0], dict)):
        req.messages.CopyFrom(_messages(messages if messages is not None else prompt))
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _tokenize_request(text: str | None, messages: Sequence[dict] | None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise TypeError("give exactly one of text or messages")
    return pb.TokenizeRequest(text=text) if text is not None else pb.TokenizeRequest(messages=_messages(messages))


def _chunk(r: pb.GenerateResponse) -> Chunk:
    usage = Usage(r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_prompt_tokens) \
        if r.HasField("usage") else None
    return Chunk(r.request_id, list(r.token_ids), r.text, FINISH_REASONS.get(r.finish_reason), usage, r.index)


class BatchProgress:
    """A tqdm bar over requests done, with Prefill and Decode tok/s estimated from chunk arrival.

    The server sends a request's first chunk right after the step that finished its prompt, with
    usage attached, so the uncached prompt tokens (prompt_tokens - cached_prompt_tokens) count as
    prefilled at that moment; every token in a later chunk counts as decoded when it arrives.
    Prefill tok/s = prefilled tokens / (latest first-chunk arrival - batch start); Decode tok/s =
    decoded tokens / (now - earliest first-chunk arrival). With continuous batching both kinds of
    work share the same wall time, so each figure is a lower bound on the engine's rate for that
    kind of work, and network delays smear arrival times by about one step.
    """

    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True)
        self.lock = threading.Lock()
        self.start = time.perf_counter()
        self.first_arrival = self.last_first_arrival = 0.0
        self.prefilled = self.decoded = 0

    def on_chunk(self, chunk: Chunk, first: bool) -> None:
        now = time.perf_counter()
        with self.lock:
            if first:
                self.first_arrival = self.first_arrival or now
                self.last_first_arrival = now
                if chunk.usage is not None:
                    self.prefilled += chunk.usage.prompt_tokens - chunk.usage.cached_prompt_tokens
            else:
                self.decoded += len(chunk.token_ids)
            if self.bar is None:
                return
            if chunk.finish_reason is not None:
                self.bar.update(1)
            prefill = self.prefilled / max(self.last_first_arrival - self.start, 1e-9)
            decode = self.decoded / max(now - self.first_arrival, 1e-9) if self.decoded else 0.0
            self.bar.set_postfix(Prefill=f"{int(prefill)}tok/s", Decode=f"{int(decode)}tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _pem(value: Pem | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {str(value)!r}: {e.strerror or e}") from None


def channel_credentials(tls_ca: Pem | None = None, tls_cert: Pem | None = None,
                        tls_key: Pem | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials (None: plaintext): trust `tls_ca` (else the system's CAs), and present
    tls_cert/tls_key as this client's identity when given (mTLS). ValueError on an unreadable file."""
    if tls_ca is None and tls_cert is None and tls_key is None:
        return None
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("a client certificate needs its key: give tls_cert and tls_key (--tls-cert, --tls-key) "
                         "together")
    return grpc.ssl_channel_credentials(_pem(tls_ca, "CA certificate"), _pem(tls_key, "TLS key"),
                                        _pem(tls_cert, "TLS certificate"))


def read_token_file(path: str | Path) -> str:
    """The bearer token in a file: its first line that is neither blank nor a # comment."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the token file {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    token = next((line.strip() for line in lines if line.strip() and not line.strip().startswith("#")), None)
    if token is None:
        raise ValueError(f"the token file {str(path)!r} holds no token")
    return token


def _auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else None


def _split_prompt(prompt: Prompt) -> dict:
    if not isinstance(prompt, str) and prompt and isinstance(prompt[0], dict):
        return {"messages": prompt}
    return {"prompt": prompt}


class Client:
    """Blocking client. Thread-safe: one channel, many concurrent calls."""

    def __init__(self, address: str, options: Sequence[tuple[str, object]] | None = None, *,
                 tls_ca: Pem | None = None, tls_cert: Pem | None = None, tls_key: Pem | None = None,
                 auth_token: str | None = None):
        credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.channel = (grpc.secure_channel(address, credentials, options=options) if credentials
                        else grpc.insecure_channel(address, options=options))
        self.metadata = _auth_metadata(auth_token)  # sent with every call
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, prompt: Prompt | None = None, *, messages: Sequence[dict] | None = None,
                 request_id: str = "", timeout: float | None = None, **sampling) -> Iterator[Chunk]:
        """Stream one request's chunks; `timeout` is the call's deadline in seconds."""
        call = self.stub.Generate(build_request(prompt, messages=messages, request_id=request_id, **sampling),
                                  timeout=timeout, metadata=self.metadata)
        try:
            for response in call:
                yield _chunk(response)
        finally:
            call.cancel()  # no-op after a normal end; otherwise the server aborts the request

    def generate_text(self, prompt: Prompt | None = None, **kwargs) -> str:
        return "".join(chunk.text for chunk in self.generate(prompt, **kwargs))

    def generate_batch(self, prompts: Sequence[Prompt], *, max_concurrency: int = 64, use_tqdm: bool = True,
                       timeout: float | None = None, **sampling) -> list[Completion]:
        """Run prompts concurrently (at most max_concurrency streams); results in input order."""
        progress = BatchProgress(len(prompts), use_tqdm)

        def run(prompt: Prompt) -> Completion:
            done = Completion()
            for i, chunk in enumerate(self.generate(**_split_prompt(prompt), timeout=timeout, **sampling)):
                done.add(chunk)
                progress.on_chunk(chunk, first=i == 0)
            return done

        try:
            with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(prompts)))) as pool:
                return list(pool.map(run, prompts))
        finally:
            progress.close()

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None) -> list[int]:
        return list(self.stub.Tokenize(_tokenize_request(text, messages), metadata=self.metadata).token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def server_status(self) -> pb.ServerStatus:
        return self.stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=self.metadata)

    def health(self, service: str = READINESS, timeout: float | None = None) -> str:
        """"SERVING" while the server can run requests, "NOT_SERVING" while its data plane is down or it
        drains; `service=""`: liveness, SERVING while the process works.
        `timeout`: seconds before the call fails with DEADLINE_EXCEEDED (None: the channel's own)."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                                          metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout: float, still_starting: Callable[[], bool] | None = None,
                           poll_s: float = 0.3) -> None:
        """Block until health says SERVING. TimeoutError after `timeout` s; RuntimeError as soon as
        `still_starting()` turns false (e.g. the server process died)."""
        deadline = time.monotonic() + timeout
        while True:
            if still_starting is not None and not still_starting():
                raise RuntimeError("the server stopped before it was ready")
            try:
                # Each call gets what is left of the timeout: a server that accepts the connection
                # but does not answer (stopped, wedged) must not hold this past its deadline.
                if self.health(timeout=max(deadline - time.monotonic(), 0.05)) == "SERVING":
                    return
            except grpc.RpcError:  # not listening yet, or no answer in time
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not SERVING within {timeout:.0f} s")
            time.sleep(poll_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, address: str, options: Sequence[tuple[str, object]] | None = None, *,
                 tls_ca: Pem | None = None, tls_cert: Pem | None = None, tls_key: Pem | None = None,
                 auth_token: str | None = None):
        credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.channel = (grpc.aio.secure_channel(address, credentials, options=options) if credentials
                        else grpc.aio.insecure_channel(address, options=options))
        self.metadata = _auth_metadata(auth_token)  # sent with every call
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def generate(self, prompt: Prompt | None = None, *, messages: Sequence[dict] | None = None,
                       request_id: str = "", timeout: float | None = None, **sampling) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, messages=messages, request_id=request_id, **sampling),
                                  timeout=timeout, metadata=self.metadata)
        try:
            async for response in call:
                yield _chunk(response)
        finally:
            call.cancel()

    async def generate_text(self, prompt: Prompt | None = None, **kwargs) -> str:
        return "".join([chunk.text async for chunk in self.generate(prompt, **kwargs)])

    async def generate_batch(self, prompts: Sequence[Prompt], *, max_concurrency: int = 64, use_tqdm: bool = True,
                             timeout: float | None = None, **sampling) -> list[Completion]:
        progress = BatchProgress(len(prompts), use_tqdm)
        limit = asyncio.Semaphore(max(1, max_concurrency))

        async def run(prompt: Prompt) -> Completion:
            done = Completion()
            async with limit:
                first = True
                async for chunk in self.generate(**_split_prompt(prompt), timeout=timeout, **sampling):
                    done.add(chunk)
                    progress.on_chunk(chunk, first)
                    first = False
            return done

        try:
            return list(await asyncio.gather(*(run(p) for p in prompts)))
        finally:
            progress.close()

    async def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None) -> list[int]:
        return list((await self.stub.Tokenize(_tokenize_request(text, messages), metadata=self.metadata)).token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    async def server_status(self) -> pb.ServerStatus:
        return await self.stub.GetServerStatus(pb.GetServerStatusRequest(), metadata=self.metadata)

    async def health(self, service: str = READINESS) -> str:
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                metadata=self.metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
