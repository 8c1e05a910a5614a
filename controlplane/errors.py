"""Exceptions to gRPC status codes, in one place.

Servicer code raises plain exceptions (ValueError for a bad request, NotImplementedError for a
parameter the engine does not honour, the two classes below); the interceptor turns them into a
status with the exception's message as details, and google.rpc.Status details beside it
(`grpc-status-details-bin`, read by grpcio-status and every language's status helpers): BadRequest
naming the field of an INVALID_ARGUMENT, RetryInfo on RESOURCE_EXHAUSTED and UNAVAILABLE.
Anything else is a bug: it is logged with its traceback and the client gets INTERNAL.

A request body that does not parse would otherwise fail inside grpc before any handler runs, as
UNKNOWN with an error logged per call; the interceptor parses leniently instead and answers
INVALID_ARGUMENT, which is what the caller did wrong.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from nanoplane.controlplane.scheduler import QueueFull
from nanoplane.proto.engine_link import DEADLINE, EXHAUSTED, ID_IN_USE, INTERNAL, INVALID, UNAVAILABLE

log = logging.getLogger(__name__)


class InvalidField(ValueError):
    """A bad request that one field of it is to blame for: `field` is its path in the request (`chat[0].role`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestIdInUse(Exception):
    """A request with this id is still running."""


class DataPlaneUnavailable(Exception):
    """The data plane is down or failed a step; requests cannot run until it is back."""


# What a request still running when the server stops is told (after SIGTERM: when --drain-timeout passed).
SHUTTING_DOWN = "the server is shutting down and this request did not finish in time (--drain-timeout); retry it"


class DeadlineExceeded(Exception):
    """The request's deadline passed while it waited in the queue; it was dropped before prefill."""


# A refused request's trailing metadata: gRPC clients and Envoy retry after this many ms. Fixed: a
# queue drains at the speed of whole requests, which one step's rate says little about.
RETRY_PUSHBACK_MS = 1000
PUSHBACK_METADATA = (("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),)


# Order matters: the first matching class wins.
STATUS_BY_EXCEPTION: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (RequestIdInUse, grpc.StatusCode.ALREADY_EXISTS),
    (DataPlaneUnavailable, grpc.StatusCode.UNAVAILABLE),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


class _Unparsable:
    """Stands in for a request whose bytes did not parse; the wrapped handler refuses it."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _lenient(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything a custom deserializer raises
            return _Unparsable(str(exc))

    return parse


async def _refuse_unparsable(context: grpc.aio.ServicerContext, request: _Unparsable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request body does not parse: {request.error}")


# SamplingParams' checks name the parameter first ("invalid sampling parameter top_p=2.0: ..."); the
# field it is in each service's request message.
_SAMPLING_PARAMETER = re.compile(r"invalid sampling parameter ([A-Za-z_][\w.]*)")
_SAMPLING_FIELD = {"/nanoplane.v1.Generation/": "sampling", "/vllm.grpc.engine.VllmEngine/": "sampling_params"}


def field_of(method: str, exc: BaseException) -> str | None:
    """The request field an INVALID_ARGUMENT is about, when known."""
    if isinstance(exc, InvalidField):
        return exc.field
    found = _SAMPLING_PARAMETER.match(str(exc))
    prefix = next((field for service, field in _SAMPLING_FIELD.items() if method.startswith(service)), None)
    return f"{prefix}.{found.group(1)}" if found and prefix else None


def status_details(method: str, code: grpc.StatusCode, message: str, exc: BaseException) -> tuple:
    """Trailing metadata carrying the google.rpc.Status of this error (the same code and message)."""
    details = []
    if code is grpc.StatusCode.INVALID_ARGUMENT and (field := field_of(method, exc)) is not None:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(RETRY_PUSHBACK_MS)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    status = status_pb2.Status(code=code.value[0], message=message, details=packed)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in STATUS_BY_EXCEPTION:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, details = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    pushback = PUSHBACK_METADATA if isinstance(exc, QueueFull) else ()
    await context.abort(code, details, pushback + status_details(method, code, details, exc))


def _wrap_unary(method: str, behaviour: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Unparsable):
            await _refuse_unparsable(context, request)
        try:
            return await behaviour(request, context)
        except grpc.aio.AbortError:
            raise  # the handler chose its status itself
        except Exception as exc:
            await _abort(context, method, exc)

    return unary


async def _relay(method: str, responses: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
    """A streaming handler's responses, its exceptions turned into statuses."""
    try:
        async for response in responses:
            yield response
    except grpc.aio.AbortError:
        raise  # the handler chose its status itself
    except Exception as exc:
        await _abort(context, method, exc)


def _wrap_stream(method: str, behaviour: Callable) -> Callable:
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
            if isinstance(request, _Unparsable):
                await _refuse_unparsable(context, request)
            async for response in _relay(method, behaviour(request, context), context):
                yield response

        return stream
    return _wrap_unary(method, behaviour)  # a coroutine that writes with context.write()


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers under `prefix` to status codes (see STATUS_BY_EXCEPTION).

    CancelledError and GeneratorExit are BaseExceptions and pass through untouched: a client that
    went away must reach the handler's cleanup, not be answered.
    """

    def __init__(self, prefix: str = "/"):
        self.prefix = prefix

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        common = dict(request_deserializer=_lenient(handler.request_deserializer),
                      response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(method, handler.unary_unary), **common)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(method, handler.unary_stream), **common)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(_wrap_bidi(method, handler.stream_stream), **common)
        return handler  # other kinds (client streaming): none on this server


def _wrap_bidi(method: str, behaviour: Callable) -> Callable:
    """A bidirectional stream (server reflection): an unparsable request in the stream ends it."""
    async def bidi(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async def parsed() -> AsyncIterator:
            async for request in requests:
                if isinstance(request, _Unparsable):
                    await _refuse_unparsable(context, request)
                yield request

        async for response in _relay(method, behaviour(parsed(), context), context):
            yield response

    return bidi


# Errors that cross the engine link travel as a kind and a message (proto/engine_link.py's Failure).
_KIND_BY_CLASS: tuple[tuple[type[BaseException], str], ...] = (
    (RequestIdInUse, ID_IN_USE), (DataPlaneUnavailable, UNAVAILABLE), (QueueFull, EXHAUSTED),
    (DeadlineExceeded, DEADLINE), (ValueError, INVALID))
_CLASS_BY_KIND: dict[str, type[Exception]] = {kind: cls for cls, kind in _KIND_BY_CLASS} | {INTERNAL: RuntimeError}


def failure_kind(exc: BaseException) -> str:
    """The engine link's kind for an exception; "internal" for anything unexpected."""
    return next((kind for cls, kind in _KIND_BY_CLASS if isinstance(exc, cls)), INTERNAL)


def failure_error(kind: str, message: str) -> Exception:
    """The exception to raise for a failure of this kind that arrived over the engine link."""
    return _CLASS_BY_KIND.get(kind, RuntimeError)(message)
