"""The Prometheus endpoint on both engine fronts: /metrics parses, carries every documented name, and its
counters follow the requests that ran (tokens, finish reasons, latencies, the prefix cache, status codes)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.grpc_server import BLOCKS, FRONTS, ServerThread, rpc_error, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.demo import serve_in_background
from nanoplane.process import free_port

VLLM = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success")
OURS = ("nanoplane_step_duration_seconds", "nanoplane_step_descriptor_bytes", "nanoplane_data_plane_epoch",
        "nanoplane_data_plane_restarts", "nanoplane_rank_heartbeat_age_seconds", "nanoplane_grpc_requests")
GENERATE = "/nanoplane.v1.Generation/Generate"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("metrics") / "tiny", arch="qwen3", seed=5))


@pytest.fixture(scope="module", params=FRONTS)
def server(model, request):
    s = ServerThread(model, front=request.param, metrics=True)
    yield s
    s.stop()


def scrape(server: ServerThread) -> dict[str, list]:
    """family name -> its samples, parsed as Prometheus does."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list], sample: str, **labels: str) -> float:
    """The one sample of that name whose labels include `labels`; 0 if there is none."""
    family = next(name for name in families if sample.startswith(name))
    found = [s.value for s in families[family] if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{sample}{labels} matches {len(found)} series"
    return found[0] if found else 0.0


def wait_for(server: ServerThread, check, timeout: float = 10.0) -> dict[str, list]:
    """Scrape until check(families) holds: the engine reports every engine_stats.STATS_INTERVAL_S."""
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(server)
        if check(families):
            return families
        assert time.monotonic() < deadline, "the metrics never caught up with the requests"
        time.sleep(0.1)


def test_every_name_is_exported_with_vllms_labels(server):
    families = scrape(server)
    assert not set(VLLM + OURS) - families.keys()
    assert value(families, "vllm:num_requests_running", model_name="tiny", engine="0") == 0
    [info] = families["vllm:cache_config_info"]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": str(BLOCKS), "engine": "0"} and info.value == 1
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"]} == {"stop", "length", "abort"}
    buckets = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"] if s.name.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and len(buckets) == 23  # vLLM's 22 and +Inf
    epoch = wait_for(server, lambda f: value(f, "nanoplane_data_plane_epoch") >= 0)
    assert value(epoch, "nanoplane_data_plane_epoch") >= (1 if not server.in_process else 0)


def test_counters_follow_the_requests(server):
    before = scrape(server)
    shared = list(range(100, 140))  # two full 16-token blocks: the second request finds them cached
    runs = []  # each request's (final usage, finish reason)
    with Client(server.address) as client:
        def run(prompt: list[int], **sampling) -> list[int]:
            chunks = list(client.generate(prompt, temperature=0, **sampling))
            runs.append((chunks[-1].usage, chunks[-1].finish_reason))
            return [t for c in chunks for t in c.token_ids]

        tokens = run(shared, max_tokens=5, ignore_eos=True)
        run(shared, max_tokens=5, ignore_eos=True)
        run([7, 8, 9], max_tokens=3, ignore_eos=True)
        run(shared, max_tokens=5, stop_token_ids=[tokens[1]])  # greedy: the same tokens, ending at the second
        refused = rpc_error(lambda: list(client.generate([], max_tokens=4)))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_idle(client)
    usage, reasons = [u for u, _ in runs], [r for _, r in runs]
    assert usage[1].cached_prompt_tokens == 32 and reasons == ["length", "length", "length", "stop"]
    n = len(runs)

    def delta(families, sample, **labels):
        return value(families, sample, **labels) - value(before, sample, **labels)

    after = wait_for(server, lambda f: delta(f, "vllm:request_queue_time_seconds_count") >= n
                     and delta(f, "vllm:prefix_cache_hits_total") >= 64)
    assert delta(after, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta(after, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usage)
    assert delta(after, "vllm:request_success_total", finished_reason="length") == 3
    assert delta(after, "vllm:request_success_total", finished_reason="stop") == 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                      "vllm:request_queue_time_seconds"):
        assert delta(after, f"{histogram}_count") == n, histogram
    assert delta(after, "vllm:inter_token_latency_seconds_count") >= 1
    # Every prompt was looked up once at admission (no preemption with this much KV cache).
    assert delta(after, "vllm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usage)
    assert delta(after, "vllm:prefix_cache_hits_total") == sum(u.cached_prompt_tokens for u in usage) >= 64
    assert delta(after, "vllm:num_preemptions_total") == 0
    assert delta(after, "nanoplane_step_duration_seconds_count") >= 1
    assert delta(after, "nanoplane_grpc_requests_total", method=GENERATE, code="INVALID_ARGUMENT") == 1
    assert delta(after, "nanoplane_grpc_requests_total", method=GENERATE, code="OK") == n
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:kv_cache_usage_perc") == 0
    if not server.in_process:  # ranks over ZeroMQ: descriptors are encoded, heartbeats kept
        assert delta(after, "nanoplane_step_descriptor_bytes_total") > 0
        assert 0 <= value(after, "nanoplane_rank_heartbeat_age_seconds", rank="0") < 5


def test_nanoplane_serve_serves_the_metrics_port(model):
    """The real command: `nanoplane serve --metrics-port` (the engine in its own process, the default)."""
    port = free_port()
    with serve_in_background(["--model", model, "--device", "cpu", "--metrics-port", str(port)], 120,
                             cwd=ROOT) as (address, _):
        with Client(address) as client:
            chunks = list(client.generate([5, 6, 7], max_tokens=4, ignore_eos=True))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            families = {f.name: f.samples for f in text_string_to_metric_families(response.read().decode())}
    assert not set(VLLM + OURS) - families.keys()
    assert value(families, "vllm:generation_tokens_total", model_name="tiny") == chunks[-1].usage.completion_tokens
    assert value(families, "nanoplane_grpc_requests_total", method=GENERATE, code="OK") == 1


def test_a_metrics_port_in_use_stops_the_command_with_its_reason(model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "nanoplane", "controlplane", "--model", model, "--host",
                               "127.0.0.1", "--port", str(free_port()), "--bind", f"ipc://{tmp_path}/plane.sock",
                               "--metrics-port", str(port)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert f"nanoplane: error: cannot serve the metrics on 127.0.0.1:{port}" in done.stderr
