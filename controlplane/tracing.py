"""OpenTelemetry tracing of Generate calls (the optional extra `nanoplane[tracing]`), on when
--otlp-traces-endpoint names an OTLP/gRPC collector.

Each Generate call of either protocol (nanoplane.v1, VllmEngine) that reaches the engine becomes a span
"nanoplane.generate", the child of the W3C `traceparent` in the call's gRPC metadata (a root without
one), with child spans "nanoplane.queue" (arrival in the engine to first admission), "nanoplane.prefill"
(to the first token) and "nanoplane.decode" (to the last). The times are the ones the serving side
already has: when each output reaches it, and the queue time the engine hands over with the first
token. Every span is made, with those times, once the request has ended: the engine thread does no
OpenTelemetry work, and nothing of `opentelemetry` is imported while tracing is off.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nanoplane.controlplane.front import Output
from nanoplane.controlplane.sampling_params import SamplingParams

SPAN = "nanoplane.generate"
PHASES = ("nanoplane.queue", "nanoplane.prefill", "nanoplane.decode")
_EXTRA = "pip install 'nanoplane[tracing]'"


class Tracing:
    """The tracer provider and its OTLP exporter; `request(context)` per Generate call; `shutdown()` flushes."""

    def __init__(self, endpoint: str, model: str, service_name: str = "nanoplane"):
        """`endpoint`: an OTLP/gRPC collector (http://host:4317: plaintext); the SDK's OTEL_* variables
        (headers, certificates, timeout, sampler, resource) apply as usual. ValueError without the extra."""
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry ({_EXTRA}): {exc}") from None
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # neither names it
            resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("nanoplane")
        self.propagator = TraceContextTextMapPropagator()
        self.model = model  # the served model's name (gen_ai.request.model)

    def request(self, context: Any) -> RequestTrace:
        """The trace of one Generate call, its clock started now; `context`: the call's grpc.aio context."""
        return RequestTrace(self, dict(context.invocation_metadata() or ()))

    def shutdown(self) -> None:
        """Export what is still batched, then stop the exporter."""
        self.provider.shutdown()


class RequestTrace:
    """One request's times and figures, collected as its outputs arrive; the spans are made at `end`."""

    __slots__ = ("_tracing", "_metadata", "_arrived", "_submitted", "_first", "_queue_s", "_attributes",
                 "_reasons", "_prompt", "_completion", "_cached")

    def __init__(self, tracing: Tracing, metadata: dict):
        self._tracing, self._metadata = tracing, metadata
        self._arrived = self._submitted = time.time_ns()
        self._first: int | None = None
        self._queue_s: float | None = None
        self._attributes: dict[str, Any] = {}
        self._reasons: dict[int, str] = {}  # sample index -> its finish reason
        self._prompt = self._cached = 0
        self._completion: dict[int, int] = {}

    def submitted(self, request_id: str, params: SamplingParams) -> None:
        """The request goes to the engine now, with these parameters."""
        self._submitted = time.time_ns()
        self._attributes = {
            "gen_ai.operation.name": "text_completion", "gen_ai.request.model": self._tracing.model,
            "gen_ai.response.id": request_id, "nanoplane.request_id": request_id,
            "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
            "gen_ai.request.choice.count": params.n}
        if params.seed is not None:
            self._attributes["gen_ai.request.seed"] = params.seed

    def output(self, out: Output, stopped: bool = False) -> None:
        """An output about to be sent (RequestMetrics.output's signature); `stopped`: a stop string ended it."""
        if self._first is None and out.token_ids:
            self._first = time.time_ns()
        if out.queue_seconds is not None and self._queue_s is None:
            self._queue_s = out.queue_seconds
        self._prompt, self._cached = out.num_prompt_tokens, out.num_cached_tokens
        self._completion[out.index] = out.num_completion_tokens
        if stopped or out.finished:
            self._reasons[out.index] = "stop" if stopped or out.finish_reason is None else out.finish_reason.value

    def end(self, error: BaseException | None = None) -> None:
        """The request is over (`error`: why it failed, or was cancelled): make and export its spans."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        end = time.time_ns()
        tracing = self._tracing
        parent = tracing.propagator.extract(self._metadata)
        attributes = {**self._attributes, "gen_ai.usage.input_tokens": self._prompt,
                      "gen_ai.usage.output_tokens": sum(self._completion.values()),
                      "nanoplane.usage.cached_input_tokens": self._cached,
                      "gen_ai.response.finish_reasons": [self._reasons[i] for i in sorted(self._reasons)]}
        span = tracing.tracer.start_span(SPAN, parent, SpanKind.SERVER, attributes, start_time=self._arrived)
        if error is not None:  # GeneratorExit: the stream was closed under the request (the client went away)
            reason = "cancelled" if isinstance(error, GeneratorExit | asyncio.CancelledError) else str(error)
            span.set_status(Status(StatusCode.ERROR, reason or type(error).__name__))
        first, submitted = self._first, self._submitted
        if first is not None:  # no token came (failed, cancelled, expired in the queue): no phases known
            admitted = first if self._queue_s is None else min(first, submitted + int(self._queue_s * 1e9))
            inside = set_span_in_context(span)
            for name, start, stop in zip(PHASES, (submitted, admitted, first), (admitted, first, end), strict=True):
                tracing.tracer.start_span(name, inside, start_time=start).end(end_time=stop)
            span.add_event("first_token", timestamp=first)
        span.end(end_time=end)


class _NoTrace:
    """A request's trace with tracing off: nothing to do (and nothing imported)."""

    def submitted(self, request_id: str, params: SamplingParams) -> None:
        pass

    def output(self, out: Output, stopped: bool = False) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass


NO_TRACE = _NoTrace()
