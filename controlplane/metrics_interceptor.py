"""The gRPC calls' status codes, counted by method for the metrics (controlplane/metrics.py).

Outermost of the server's interceptors, so that it sees the status that errors.py's interceptor (or a
handler's own `context.abort`) gave the call. A method the server does not have is answered
UNIMPLEMENTED by gRPC itself, before any interceptor's handler: it is not counted (its name would be
whatever a client sent, an unbounded label).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import Counter


def _code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status the call ends with: the one set on the context, else what gRPC makes of how it ended."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name  # the client left (or the server is stopping)
    code = context.code()
    if code is not None:
        return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode(code).name
    return grpc.StatusCode.UNKNOWN.name if exc is not None else grpc.StatusCode.OK.name


class StatusCodeInterceptor(grpc.aio.ServerInterceptor):
    """Counts each call once it ends, in `counter` labelled (method, code)."""

    def __init__(self, counter: Counter):
        self.counter = counter

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method, common = handler_call_details.method, dict(request_deserializer=handler.request_deserializer,
                                                           response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **common)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._wrap(method, handler.unary_stream), **common)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._wrap(method, handler.stream_stream), **common)
        return handler  # client streaming: none on this server

    def _count(self, method: str, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        self.counter.labels(method, _code(context, exc)).inc()

    def _unary(self, method: str, behaviour: Callable) -> Callable:
        async def unary(request, context: grpc.aio.ServicerContext):
            try:
                response = await behaviour(request, context)
            except BaseException as exc:
                self._count(method, context, None if isinstance(exc, grpc.aio.AbortError) else exc)
                raise
            self._count(method, context, None)
            return response

        return unary

    def _wrap(self, method: str, behaviour: Callable) -> Callable:
        """A streaming handler: an async generator, or a coroutine that writes with context.write()."""
        if not inspect.isasyncgenfunction(behaviour):
            return self._unary(method, behaviour)

        async def stream(request, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async for response in behaviour(request, context):
                    yield response
            except BaseException as exc:
                self._count(method, context, None if isinstance(exc, grpc.aio.AbortError) else exc)
                raise
            self._count(method, context, None)

        return stream
