"""OpenTelemetry tracing (controlplane/tracing.py): `nanoplane serve --otlp-traces-endpoint` exports each
request's spans to an OTLP/gRPC collector (one in this process, built from opentelemetry-proto's
TraceService), as the child of the traceparent a client of either protocol sent; tracing off imports
nothing of OpenTelemetry."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from support.tiny_models import make_tiny_model

from nanoplane.demo import serve_in_background
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb
from nanoplane.proto.nanoplane.v1 import generation_pb2_grpc as pb_grpc

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

ROOT = Path(__file__).resolve().parents[2]
PROMPT, MAX_TOKENS = [5, 6, 7], 4
PHASES = ("nanoplane.queue", "nanoplane.prefill", "nanoplane.decode")
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span it is sent, with its resource's attributes."""

    def __init__(self):
        self.spans: list = []
        self.resources: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                self.resources.append(attributes(resource_spans.resource))
                for scope in resource_spans.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes, count: int, timeout: float = 30.0) -> list:
        """The spans of trace_id, once `count` have arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{len(found)} of {count} spans of trace {trace_id.hex()} arrived")


def value(any_value):
    kind = any_value.WhichOneof("value")
    inner = getattr(any_value, kind)
    return [value(v) for v in inner.values] if kind == "array_value" else inner


def attributes(item) -> dict:
    return {kv.key: value(kv.value) for kv in item.attributes}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tracing") / "tiny", arch="qwen3", seed=5))


def traceparent() -> tuple[bytes, bytes, tuple[tuple[str, str]]]:
    trace_id, span_id = random.getrandbits(128).to_bytes(16, "big"), random.getrandbits(64).to_bytes(8, "big")
    return trace_id, span_id, (("traceparent", f"00-{trace_id.hex()}-{span_id.hex()}-01"),)


def check_request_spans(spans: list, trace_id: bytes, parent_span_id: bytes, request_id: str) -> dict:
    """The request's span and its three phases: linked, ordered, with their attributes; returns its attributes."""
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(["nanoplane.generate", *PHASES]), sorted(by_name)
    request = by_name["nanoplane.generate"]
    assert request.parent_span_id == parent_span_id and request.kind == SERVER_KIND
    assert request.status.code != 2, request.status.message  # STATUS_CODE_ERROR
    for name in PHASES:
        assert by_name[name].trace_id == trace_id and by_name[name].parent_span_id == request.span_id
    queue, prefill, decode = (by_name[name] for name in PHASES)
    assert request.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano <= prefill.end_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano < decode.end_time_unix_nano
    assert decode.end_time_unix_nano == request.end_time_unix_nano
    assert [e.name for e in request.events] == ["first_token"]
    assert request.events[0].time_unix_nano == decode.start_time_unix_nano
    found = attributes(request)
    assert found["gen_ai.response.id"] == found["nanoplane.request_id"] == request_id
    assert found["gen_ai.request.model"] == "tiny"
    assert found["gen_ai.request.max_tokens"] == MAX_TOKENS and found["gen_ai.request.choice.count"] == 1
    assert found["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert found["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert found["gen_ai.response.finish_reasons"] == ["length"]
    return found


@pytest.mark.parametrize("engine_process", ["1", "0"], ids=["engine-process", "in-process"])
def test_both_protocols_export_spans_under_the_callers_traceparent(model, engine_process):
    collector = Collector()
    env = {**os.environ, "NANOPLANE_ENGINE_PROCESS": engine_process, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env.pop("OTEL_SERVICE_NAME", None)
    service = "nanoplane" if engine_process == "0" else "nanoplane-under-test"  # the default, or the SDK's variable
    if engine_process == "1":
        env["OTEL_SERVICE_NAME"] = service
    try:
        with serve_in_background(["--model", model, "--device", "cpu", "--otlp-traces-endpoint",
                                  f"http://127.0.0.1:{collector.port}"], 120, cwd=ROOT, env=env) as (address, _), \
                grpc.insecure_channel(address) as channel:
            nano_trace, nano_parent, metadata = traceparent()
            request = pb.GenerateRequest(request_id="traced-nano", token_ids=pb.TokenIds(ids=PROMPT),
                                         sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True, seed=7))
            assert len(list(pb_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=60))) >= 1
            vllm_trace, vllm_parent, metadata = traceparent()
            sampling = vpb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          skip_special_tokens=True)
            request = vpb.GenerateRequest(request_id="traced-vllm", stream=True, sampling_params=sampling,
                                          tokenized=vpb.TokenizedInput(input_ids=PROMPT))
            assert list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, metadata=metadata, timeout=60))
            untraced = pb.GenerateRequest(request_id="untraced", token_ids=pb.TokenIds(ids=PROMPT),
                                          sampling=pb.SamplingParams(max_tokens=1))
            list(pb_grpc.GenerationStub(channel).Generate(untraced, timeout=60))
            nano = check_request_spans(collector.trace(nano_trace, 4), nano_trace, nano_parent, "traced-nano")
            assert nano["gen_ai.request.temperature"] == pytest.approx(0.5)
            assert nano["gen_ai.request.top_p"] == pytest.approx(0.9) and nano["gen_ai.request.seed"] == 7
            vllm = check_request_spans(collector.trace(vllm_trace, 4), vllm_trace, vllm_parent, "traced-vllm")
            assert vllm["gen_ai.request.temperature"] == 0.0
            cancelled_trace, _, metadata = traceparent()
            long = pb.GenerateRequest(request_id="cancelled", token_ids=pb.TokenIds(ids=PROMPT),
                                      sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True))
            call = pb_grpc.GenerationStub(channel).Generate(long, metadata=metadata, timeout=60)
            next(call)
            call.cancel()
            spans = {s.name: s for s in collector.trace(cancelled_trace, 4)}
            assert spans["nanoplane.generate"].status.code == 2  # STATUS_CODE_ERROR
            assert spans["nanoplane.generate"].status.message == "cancelled"
            assert attributes(spans["nanoplane.generate"])["gen_ai.response.finish_reasons"] == []
            # Without a traceparent the request's span is a root of a trace of its own.
            deadline = time.monotonic() + 30
            while not (roots := [s for s in list(collector.spans)
                                 if attributes(s).get("nanoplane.request_id") == "untraced"]):
                assert time.monotonic() < deadline, "the untraced request's span never arrived"
                time.sleep(0.05)
            assert roots[0].parent_span_id == b"" and roots[0].trace_id not in (nano_trace, vllm_trace)
    finally:
        collector.server.stop(0)
    assert collector.resources and all(r["service.name"] == service for r in collector.resources)


def test_tracing_off_imports_nothing_of_opentelemetry(model):
    """A server without --otlp-traces-endpoint serves requests of both protocols and never imports it."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import grpc
import nanoplane.cli, nanoplane.controlplane.service
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb, vllm_engine_pb2_grpc
from support.grpc_server import ServerThread
from nanoplane.clients import Client
nanoplane.cli.build_parser()
server = ServerThread({model!r})
try:
    with Client(server.address) as client:
        assert len(list(client.generate([5, 6, 7], max_tokens=3, ignore_eos=True))) >= 1
    with grpc.insecure_channel(server.address) as channel:
        request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
                                      sampling_params=vpb.SamplingParams(max_tokens=3, skip_special_tokens=True))
        list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, metadata=(("traceparent",
             "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)))
finally:
    server.stop()
loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'opentelemetry')
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_an_endpoint_without_the_extra_is_refused_before_anything_starts(model, tmp_path):
    """Without OpenTelemetry installed (hidden here), the flag stops the command with the install line."""
    (tmp_path / "opentelemetry").mkdir()  # a package that shadows the real one and holds nothing
    (tmp_path / "opentelemetry" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "nanoplane", "controlplane", "--model", model, "--port", "0",
                           "--bind", f"ipc://{tmp_path}/plane.sock", "--otlp-traces-endpoint", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr
    assert "nanoplane[tracing]" in done.stderr and "hidden by the test" in done.stderr
