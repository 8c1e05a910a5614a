"""The public gRPC server: nanoplane.v1.Generation, grpc.health.v1, server reflection, and any other
protocol's servicer over the same front (`services`: vllm_servicer.py's vllm.grpc.engine.VllmEngine).

Handlers raise plain exceptions (ValueError, NotImplementedError, ...); `errors.py`'s interceptor
turns them into status codes. The engine runs behind an `EngineFront` (front.py), in this process or
in its own; this module only converts between protobuf and engine types and turns token ids into text.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing

import grpc
import jinja2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoplane.controlplane.errors import DataPlaneUnavailable, ExceptionToStatusInterceptor, InvalidField
from nanoplane.controlplane.front import EngineFront
from nanoplane.controlplane.grpc_sampling import SampleStreams, sampling_from_proto
from nanoplane.controlplane.metrics import NO_REQUEST_METRICS, Metrics
from nanoplane.controlplane.reflection import enable_reflection
from nanoplane.controlplane.security import ServerSecurity
from nanoplane.controlplane.tokenizer import Tokenizer
from nanoplane.controlplane.tracing import NO_TRACE, Tracing
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256  # echoed in every message and in error details (metadata is capped at 8-16 KiB)
# Prompt text up to this many characters a token of max_model_len is encoded at once; longer text is
# counted piece by piece first (GenerationServicer._refuse_surely_longer). English runs ~4 a token.
CHEAP_CHARS_PER_TOKEN = 8
# Clients and meshes commonly send HTTP/2 keepalive pings every 10-30 s; gRPC's default policy
# answers a ping more frequent than every 5 min with GOAWAY too_many_pings, which ends every stream
# on the connection. Server pings, in turn, find peers that vanished without closing the connection.
DEFAULT_SERVER_OPTIONS: list[tuple[str, object]] = [
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a client for pinging
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
]

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN = 4 << 20, 64  # gRPC's default; room for text of max_model_len tokens


def connection_options(max_model_len: int, max_age_s: float = 0.0, age_grace_s: float = 30.0,
                       max_request_bytes: int = 0) -> list[tuple[str, object]]:
    """Server options: the largest request (0: from max_model_len; beyond it RESOURCE_EXHAUSTED) and, when
    `max_age_s`, a GOAWAY after that long so clients reconnect, possibly to another replica, their streams
    given `age_grace_s` to finish."""
    size = max_request_bytes or max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", size)]
    if max_age_s > 0:
        options += [("grpc.max_connection_age_ms", int(max_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(age_grace_s * 1000))]
    return options
# Registers another protocol's servicer on the server, given this one's; returns its full service name.
AddService = Callable[[grpc.aio.Server, "GenerationServicer"], str]
# At shutdown, the time the streams still open after the grace get to send the engine's status.
_CLOSING_S = 3.0
LIVENESS = ""  # health's liveness service: the process works (readiness: each API's own service name)
DRAINING = "the server is draining (shutting down): it takes no new requests; retry on another replica"
_UNDRAINED = ("/grpc.health.", "/grpc.reflection.")  # always answered: probes and tools during a drain


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Counts the API calls in flight (long-lived subscriptions aside: the stop ends them) and, once
    `refusing`, answers new ones UNAVAILABLE at once."""

    def __init__(self):
        self.in_flight = 0
        self.refusing = False

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNDRAINED) or "/Subscribe" in method:
            return handler
        common = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._counted_unary(handler.unary_unary), **common)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(self._counted_stream(handler.unary_stream), **common)
        return handler

    def _counted_unary(self, behaviour: Callable) -> Callable:
        async def unary(request, context: grpc.aio.ServicerContext):
            if self.refusing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            self.in_flight += 1
            try:
                return await behaviour(request, context)
            finally:
                self.in_flight -= 1
        return unary

    def _counted_stream(self, behaviour: Callable) -> Callable:
        async def stream(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
            if self.refusing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            self.in_flight += 1
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                self.in_flight -= 1
        return stream


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, front: EngineFront, tokenizer: Tokenizer, model_name: str, metrics: Metrics | None = None,
                 tracing: Tracing | None = None):
        self.front = front
        self.metrics = metrics
        self.tracing = tracing  # OpenTelemetry spans of each Generate call (tracing.py); None: off
        self.tokenizer = tokenizer
        self.model_name = model_name
        # No token covers more characters than its vocabulary entry has (byte-level entries spell
        # one character per byte), so a text longer than max_model_len times this cannot fit. Four
        # times that, for normalizers that compose characters (NFC: a letter and its accents, one).
        self._max_prompt_chars_per_token = 4 * max(map(len, tokenizer.hf.get_vocab()), default=1)

    def _refuse_surely_longer(self, text: str) -> None:
        """Refuse a text that passed the character bound but holds more than max_model_len tokens,
        counting only as far as the limit (Tokenizer.surely_longer): encoding all of it first cost
        hundreds of MB a request. Texts of up to CHEAP_CHARS_PER_TOKEN characters a token go straight
        to the encoder, as nearly every real prompt does. Runs off the event loop."""
        facts = self.front.facts
        if facts is None or len(text) <= facts.max_model_len * CHEAP_CHARS_PER_TOKEN:
            return
        if self.tokenizer.surely_longer(text, facts.max_model_len):
            raise ValueError(f"the prompt ({len(text)} characters) has more than max_model_len "
                             f"{facts.max_model_len} tokens")

    def _encode_text(self, text: str) -> list[int]:
        self._refuse_surely_longer(text)
        return self.tokenizer.encode(text)

    def _check_text_length(self, n_chars: int) -> None:
        """Refuse text that cannot fit before spending seconds of CPU tokenizing it."""
        facts = self.front.facts
        if facts is not None and n_chars > facts.max_model_len * self._max_prompt_chars_per_token:
            raise ValueError(f"the prompt ({n_chars} characters) is longer than max_model_len "
                             f"{facts.max_model_len} tokens can hold")

    async def _chat(self, messages: Sequence[pb.ChatMessage], field: str) -> tuple[str, list[int]]:
        """`field`: where the messages came from (`chat` or `messages.messages`), for error details."""
        if not messages:
            raise InvalidField(field, f"{field.split('.')[0]} is empty: give at least one message")
        facts = self.front.facts
        # A chat template spends at least a token on each message; this bound comes first so that a
        # flood of empty messages is refused before anything loops over it.
        if facts is not None and len(messages) > facts.max_model_len:
            raise InvalidField(field, f"{len(messages)} messages cannot fit max_model_len {facts.max_model_len} tokens")
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidField(f"{field}[{i}].role", f"message {i} has no role (e.g. 'user')")
        # Roles go through the template too, and nothing bounds them but this.
        self._check_text_length(sum(len(m.role) + len(m.content) for m in messages))
        try:
            # Off the event loop: tokenizing a long prompt takes seconds, and every stream waits on the loop.
            return await asyncio.to_thread(self.tokenizer.encode_chat,
                                           [{"role": m.role, "content": m.content} for m in messages],
                                           self._refuse_surely_longer)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from None

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = _chat_or_oneof(request, "prompt")
        if kind is None:
            raise InvalidField("prompt", "the request has no prompt: set one of text, token_ids, messages or chat")
        if kind == "chat":
            return (await self._chat(request.chat, "chat"))[1]
        if kind == "text":
            if not request.text:
                raise InvalidField("text", "the prompt text is empty")
            self._check_text_length(len(request.text))
            return await asyncio.to_thread(self._encode_text, request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        return (await self._chat(request.messages.messages, "messages.messages"))[1]

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        measure = self.metrics.request() if self.metrics is not None else NO_REQUEST_METRICS
        trace = self.tracing.request(context) if self.tracing is not None else NO_TRACE
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidField("request_id", f"request_id is {len(request.request_id)} characters long; at most "
                             f"{MAX_REQUEST_ID_CHARS} are allowed")
        params = sampling_from_proto(request.sampling)
        token_ids = await self._prompt_ids(request)
        request_id = request.request_id or uuid.uuid4().hex
        samples = SampleStreams(request_id, self.tokenizer, token_ids, params)
        # The call's deadline, as seconds left now; the engine drops the request if it is still queued then.
        # aclosing: leaving for any reason (client gone, error) aborts the request at once (SampleStreams.run).
        async with aclosing(samples.run(self.front, token_ids, context.time_remaining(), measure, trace)) as messages:
            async for _, response in messages:
                yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        kind = _chat_or_oneof(request, "input")
        if kind in ("messages", "chat"):
            chat = (request.chat, "chat") if kind == "chat" else (request.messages.messages, "messages.messages")
            text, ids = await self._chat(*chat)
        else:
            self._check_text_length(len(request.text))  # Tokenize answers for prompts only: the same bound
            ids = await asyncio.to_thread(self._encode_text, request.text) if request.text else []
            text = request.text
        return pb.TokenizeResponse(token_ids=ids, text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        facts = self.front.facts
        if facts is None:  # the facts come from the data plane's handshake
            raise DataPlaneUnavailable("no data plane has attached yet; retry later")
        return pb.ModelInfo(model=self.model_name, architecture=facts.architecture,
                            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size,
                            tensor_parallel_size=facts.tensor_parallel_size, kv_block_size=facts.block_size,
                            eos_token_ids=self.tokenizer.eos_token_ids,
                            has_chat_template=self.tokenizer.has_chat_template,
                            kv_capacity_tokens=facts.kv_capacity_tokens)

    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context) -> pb.ServerStatus:
        s = self.front.status()
        return pb.ServerStatus(running_requests=s.running, waiting_requests=s.waiting,
                               kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used,
                               data_plane_ready=self.front.data_plane_ready)


def _chat_or_oneof(request: pb.GenerateRequest | pb.TokenizeRequest, oneof: str) -> str | None:
    """"chat" (the wrapper-free conversation), else the oneof's field; both set is refused."""
    kind = request.WhichOneof(oneof)
    if request.chat and kind is not None:
        raise InvalidField("chat", f"chat and {kind} are both set: give the prompt once")
    return "chat" if request.chat else kind


class GenerationServer:
    """grpc.aio server around an EngineFront. `await start()`, then `await stop()`."""

    def __init__(self, front: EngineFront, tokenizer: Tokenizer, model_name: str, address: str = "127.0.0.1:0",
                 options: list[tuple[str, object]] | None = None, security: ServerSecurity | None = None,
                 metrics: Metrics | None = None, services: list[AddService] = (), tracing: Tracing | None = None):
        """`metrics`: the registry to keep up to date (controlplane/metrics.py); its HTTP server is the caller's.
        `services`: more protocols on the same port (health and reflection list them too).
        `tracing`: OpenTelemetry spans of each request (tracing.py); its shutdown is the caller's."""
        self.services = list(services)
        self.service_names = [SERVICE]
        self.front = front
        self.security = security  # TLS, mTLS and bearer tokens (security.py); None: plaintext, open
        self.metrics = metrics
        self.tracing = tracing
        if metrics is not None:
            metrics.attach(front)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.address = address
        self.options = DEFAULT_SERVER_OPTIONS + (options or [])
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.drain_interceptor = DrainInterceptor()
        self.draining = False  # readiness NOT_SERVING whatever the data plane says
        self._health_tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    async def start(self) -> int:
        """Bind, start serving and start the engine front; returns the bound port."""
        # Every service: health and reflection too answer a body that does not parse with INVALID_ARGUMENT.
        auth = self.security.interceptors() if self.security else []
        counting = [self.metrics.interceptor] if self.metrics is not None else []  # outermost: sees the final status
        server = grpc.aio.server(interceptors=[*counting, *auth, self.drain_interceptor,
                                                            ExceptionToStatusInterceptor()], options=self.options)
        servicer = GenerationServicer(self.front, self.tokenizer, self.model_name, self.metrics, self.tracing)
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        self.service_names = [SERVICE] + [add(server, servicer) for add in self.services]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection([*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
        credentials = self.security.credentials() if self.security else None
        self.port = (server.add_secure_port(self.address, credentials) if credentials
                     else server.add_insecure_port(self.address))
        if self.port == 0:
            raise OSError(f"could not bind {self.address}")
        loop = asyncio.get_running_loop()
        # Liveness is SERVING while the process works; readiness follows the data plane, so load balancers
        # stop sending requests while it is down and a liveness probe never kills a control plane waiting for it.
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.front.add_ready_listener(lambda ready: loop.call_soon_threadsafe(self._health_changed, ready))
        self.front.start()
        await self._set_health(self.front.data_plane_ready)
        await server.start()
        self.server = server
        log.info("serving %s on port %d", self.model_name, self.port)
        return self.port

    def _health_changed(self, ready: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._set_health(ready))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, ready: bool) -> None:
        serving = ready and not self.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

    async def drain(self, delay: float, timeout: float) -> bool:
        """SIGTERM's first step: readiness NOT_SERVING now (liveness stays SERVING) while calls are still
        taken for `delay` s, so meshes and load balancers deregister the replica first; then new calls get
        UNAVAILABLE and those in flight get `timeout` s to finish. True when they all did; then `stop()`."""
        self.draining = True
        await self._set_health(False)
        log.info("draining: readiness NOT_SERVING; new requests refused in %g s", delay)
        await asyncio.sleep(delay)
        self.drain_interceptor.refusing = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self.drain_interceptor.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = self.drain_interceptor.in_flight
        if left:
            log.warning("drain timeout (%g s): ending the %d requests still running", timeout, left)
        return not left

    async def stop(self, grace: float | None = 5.0) -> None:
        """Refuse new calls, give running ones `grace` seconds, then stop the engine, which ends the
        streams still open with UNAVAILABLE "the server is shutting down"."""
        await self.health.enter_graceful_shutdown()
        stopping = None
        if self.server is not None:
            # gRPC would cancel what is still running when the grace ends, with its own words (and a
            # traceback a call in the log). So the engine stops first: off the event loop, since
            # its shutdown blocks, and the handlers must still run to send the status it gives them.
            stopping = asyncio.ensure_future(self.server.stop(grace + _CLOSING_S if grace else grace))
            await asyncio.wait([stopping], timeout=grace or None)
        await asyncio.get_running_loop().run_in_executor(None, self.front.shutdown)
        if stopping is not None:
            await stopping

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()

