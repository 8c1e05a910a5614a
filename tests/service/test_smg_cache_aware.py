"""Two `nanoplane serve` replicas behind the Shepherd Model Gateway (PyPI `smg`) with `--policy
cache_aware`: the gateway subscribes to each replica's KV-cache events (SubscribeKvEvents of
vllm.grpc.engine.VllmEngine) and sends requests that share a long prefix to the replica that holds
it. Which replica served a request is read from both replicas' prefix-cache counters on /metrics."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoplane.demo import serve_in_background
from nanoplane.process import free_port, stop_process
from tests.support.tiny_models import make_tiny_model

HAVE_SMG = importlib.util.find_spec("smg") is not None
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paged", "attention", "keeps", "cache",
         "in", "blocks", "continuous", "batching", "serves", "many", "requests", "at", "once")


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples over its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class Replica:
    def __init__(self, address: str, metrics_port: int):
        self.address, self.metrics = address, f"http://127.0.0.1:{metrics_port}/metrics"

    def queries(self) -> float:
        """Prompt tokens it looked up in its prefix cache: each request it admitted adds its prompt."""
        return counter(get(self.metrics), "vllm:prefix_cache_queries_total")

    def hits(self) -> float:
        return counter(get(self.metrics), "vllm:prefix_cache_hits_total")


@contextlib.contextmanager
def replica(model: Path) -> Iterator[Replica]:
    port = free_port()
    flags = ["--model", str(model), "--device", "cpu", "--metrics-port", str(port)]
    with serve_in_background(flags, 180) as (address, _):
        yield Replica(address, port)


@contextlib.contextmanager
def gateway(model: Path, replicas: list[Replica]) -> Iterator[tuple[str, str]]:
    """smg in front of the replicas; yields (its OpenAI base URL, its /metrics URL) once it lists the model."""
    port, metrics = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "smg", "launch", "--backend", "vllm", "--policy", "cache_aware",
                             "--worker-urls", *[f"grpc://{r.address}" for r in replicas],
                             "--model-path", str(model), "--tokenizer-path", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/metrics"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"smg exited with code {proc.returncode}"
            with contextlib.suppress(OSError, urllib.error.URLError):
                if model.name in get(base + "/v1/models") and counter(
                        get(metrics_url), "smg_kv_event_batches_total") >= len(replicas):  # each stream's snapshot
                    break
            assert time.monotonic() < deadline, "the gateway never listed the model with both KV-event streams"
            time.sleep(0.2)
        yield base, metrics_url
    finally:
        stop_process(proc)


def complete(base: str, model: str, prompt: str) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


@pytest.mark.skipif(not HAVE_SMG, reason="the smg gateway is not installed (pip install smg)")
def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", arch="qwen3", seed=5)
    with replica(model) as a, replica(model) as b, gateway(model, [a, b]) as (base, smg_metrics):
        rng = random.Random(0)
        prefixes = {k: " ".join(rng.choice(WORDS) for _ in range(120)) for k in ("p", "q")}
        served: dict[str, set[int]] = {"p": set(), "q": set()}
        for i, k in enumerate(("p", "q") * 4):
            before = [r.queries() for r in (a, b)]
            answer = complete(base, model.name, prefixes[k] + f" question {rng.randint(0, 999)}")
            prompt_tokens = answer["usage"]["prompt_tokens"]
            deadline = time.monotonic() + 10  # the replicas' counters move every engine_loop.STATS_INTERVAL_S
            while not (grew := [j for j, r in enumerate((a, b)) if r.queries() - before[j] >= prompt_tokens]):
                assert time.monotonic() < deadline, "neither replica counted the request"
                time.sleep(0.1)
            served[k].update(grew)
            if i >= 2:  # from its second request on, a prefix is served from the cache that holds it
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128, answer["usage"]
        assert len(served["p"]) == 1 and len(served["q"]) == 1, f"a prefix was split over replicas: {served}"
        assert a.hits() + b.hits() >= 6 * 128  # three repeats of each prefix, 8+ full blocks each
        text = get(smg_metrics)
        assert counter(text, "smg_kv_event_blocks_total") >= 16  # both prefixes' blocks came as events
        # The gateway chose by its KV-event index, not by its own guess of the replicas' caches.
        assert counter(text, "smg_cache_aware_policy_branch_total") >= 6
        assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('smg_cache_aware_policy_branch_total{branch="event_hit"}')) >= 6
