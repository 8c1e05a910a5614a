"""Prometheus metrics of the service: what `--metrics-port` serves at /metrics.

The serving process owns the registry and the HTTP server, whichever front runs the engine. The numbers
come from four places:

- each request, where its outputs reach the serving process (grpc_server.py's Generate, on either
  front): time to first token, inter-token latency, end-to-end latency, prompt and generation tokens,
  finish reasons. One observation per message, not per token (`RequestMetrics`);
- the engine, every engine_stats.STATS_INTERVAL_S (from its thread, or over the engine link's Stats event
  from its process): prefix-cache queries and hits, preemptions, queue times, step durations,
  descriptor bytes, the data plane's epoch and its ranks' heartbeat ages (`Metrics.record_engine`);
- the front, read when scraped: running and waiting requests, KV-cache usage, the cache's sizes;
- every gRPC call's status code (`StatusCodeInterceptor`).

The `vllm:` names, types, label names and buckets are vLLM's (vllm/v1/metrics/loggers.py), which the
llm-d inference scheduler and vLLM dashboards read: every one carries `model_name` and `engine` ("0":
one engine), and prometheus-client adds `_total` to a counter's name as vLLM's do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nanoplane.controlplane.front import EngineFront, EngineStats, Output
from nanoplane.controlplane.metrics_interceptor import StatusCodeInterceptor
from nanoplane.controlplane.sequence import FinishReason

ENGINE = "0"  # vLLM's engine index label: one engine per server here
FINISH_REASONS = ("stop", "length", "abort")  # sequence.FinishReason's values, as vLLM spells its own
# vLLM's buckets, boundary for boundary.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# Ours: a CPU step of a tiny model takes ~1 ms, a GPU decode step a few ms, a long prefill seconds.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Metrics:
    """The registry and its metrics for one served model. `attach(front)` before the front starts;
    `serve(host, port)` starts the HTTP server; `request()` per Generate call."""

    def __init__(self, model_name: str):
        # vLLM's output has no `_created` series; the setting is prometheus-client's, process-wide.
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels, values = self.registry, ("model_name", "engine"), (model_name, ENGINE)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*labels, "finished_reason"), registry=r)
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        # nanoplane's own.
        self.step_time = histogram("nanoplane_step_duration_seconds", "Engine steps that applied a data-plane "
                                   "result: the engine's call from scheduling to the result applied.", STEP_BUCKETS)
        self.descriptor_bytes = counter("nanoplane_step_descriptor_bytes",
                                        "Encoded step descriptors sent to each rank, in bytes.")
        self.epoch = Gauge("nanoplane_data_plane_epoch", "Epoch of the attached data plane (-1: none attached).",
                           labels, registry=r).labels(*values)
        self.epoch.set(-1)
        self.restarts = counter("nanoplane_data_plane_restarts", "Times a data plane attached after the first.")
        self.heartbeat_age = Gauge("nanoplane_rank_heartbeat_age_seconds", "Seconds since the rank's latest "
                                   "heartbeat, as of the engine's latest report.", (*labels, "rank"), registry=r)
        self.grpc_requests = Counter("nanoplane_grpc_requests", "gRPC calls answered, by method and status code.",
                                     ("method", "code"), registry=r)
        self.interceptor = StatusCodeInterceptor(self.grpc_requests)
        prometheus_client.ProcessCollector(registry=r)
        self._ranks: set[str] = set()
        self._attached_once = False
        self._http: Any = None

    def attach(self, front: EngineFront) -> None:
        """Listen to the front's engine stats and readiness, and read its status when scraped."""
        self.registry.register(_FrontCollector(front, self.model_name))
        front.add_stats_listener(self.record_engine)
        front.add_ready_listener(self._on_ready)

    def request(self) -> RequestMetrics:
        """The metrics of one Generate call, its clock started now."""
        return RequestMetrics(self)

    def record_engine(self, stats: EngineStats) -> None:
        """One engine report: its increments, its observations, its gauges (any thread)."""
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.preemptions.inc(stats.preemptions)
        self.descriptor_bytes.inc(stats.descriptor_bytes)
        for seconds in stats.step_seconds:
            self.step_time.observe(seconds)
        for seconds in stats.queue_seconds:
            self.queue_time.observe(seconds)
        self.epoch.set(stats.epoch)
        ranks = {str(rank): age for rank, age in enumerate(stats.heartbeat_ages)}
        for gone in self._ranks - ranks.keys():  # a smaller data plane attached: its old ranks are no more
            self.heartbeat_age.remove(self.model_name, ENGINE, gone)
        for rank, age in ranks.items():
            self.heartbeat_age.labels(self.model_name, ENGINE, rank).set(age)
        self._ranks = set(ranks)

    def _on_ready(self, ready: bool) -> None:
        if ready and self._attached_once:
            self.restarts.inc()
        self._attached_once |= ready

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: any free port) from a thread; returns the bound port."""
        self._http, _ = prometheus_client.start_http_server(port, host, self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class RequestMetrics:
    """One Generate call's latencies and tokens, observed as its outputs reach the serving process."""

    __slots__ = ("_m", "_start", "_last", "_first")

    def __init__(self, metrics: Metrics):
        self._m = metrics
        self._start = self._last = time.perf_counter()
        self._first = True

    def output(self, out: Output, stopped: bool = False) -> None:
        """An output about to be sent; `stopped`: a stop string ended the request with it."""
        m, now, n = self._m, time.perf_counter(), len(out.token_ids)
        if n:
            if self._first:
                m.ttft.observe(now - self._start)
                m.prompt_tokens.inc(out.num_prompt_tokens)
                self._first = False
            else:  # a message that caught up several tokens stands for their mean gap
                m.itl.observe((now - self._last) / n)
            m.generation_tokens.inc(n)
            self._last = now
        if stopped or out.finished:
            # vLLM counts the end-of-sequence token as "stop" too.
            reason = "stop" if stopped or out.finish_reason in (None, FinishReason.EOS) else out.finish_reason.value
            m.request_success[reason].inc()
            m.e2e.observe(now - self._start)


class _NoRequestMetrics:
    """RequestMetrics of a server without metrics: nothing to do."""

    def output(self, out: Output, stopped: bool = False) -> None:
        pass


NO_REQUEST_METRICS = _NoRequestMetrics()


class _FrontCollector(Collector):
    """The gauges a front knows at any moment, read when scraped: nothing to keep up to date."""

    def __init__(self, front: EngineFront, model_name: str):
        self.front, self.values = front, [model_name, ENGINE]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status, facts, labels = self.front.status(), self.front.facts, ["model_name", "engine"]
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", status.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", status.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 status.kv_blocks_used / status.kv_blocks_total if status.kv_blocks_total else 0.0)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(self.values, value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "engine"])
        if facts is not None:  # the sizes come from the data plane's handshake
            info.add_metric([str(facts.block_size), str(facts.kv_capacity_tokens // facts.block_size), ENGINE], 1)
        yield info
