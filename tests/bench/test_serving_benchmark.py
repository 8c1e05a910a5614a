"""benchmarks/serving.py end to end on the CPU at toy scale: it starts `nanoplane serve` on a tiny
generated model, runs every workload through the gRPC API, and its figures add up."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict

from conftest import ROOT
from support.tiny_models import VOCAB

from benchmarks import serving_workloads as wl
from benchmarks.serving import TOY_SHAPES

RATE, NUM_REQUESTS, LONG_PROMPTS = 2.0, 6, 2


def check_figures(row: dict) -> None:
    for name in ("ttft", "itl", "e2e"):
        unit = "s" if name == "e2e" else "ms"
        p50, p99 = row[f"{name}_p50_{unit}"], row[f"{name}_p99_{unit}"]
        assert 0 <= p50 <= p99 and math.isfinite(p99), (name, row)
    assert row["ttft_p99_ms"] <= row["e2e_p99_s"] * 1e3  # the first token comes before the last
    assert row["itl_p99_ms"] <= row["max_gap_ms"]  # a message of k tokens spreads its wait over k gaps
    assert row["output_tok_s"] > 0 and row["elapsed_s"] > 0
    assert 0 <= row["goodput"] <= row["completed"] / row["elapsed_s"] + 1e-9
    assert 0 <= row["cached_prompt_tokens"] <= row["prompt_tokens"]
    assert not row["errors"]


def test_serving_benchmark_on_the_cpu(tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--toy", "--model-dir", str(tmp_path / "tiny"),
         "--rates", str(RATE), "--num-requests", str(NUM_REQUESTS), "--long-prompts", str(LONG_PROMPTS),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["workloads"]
    assert list(results) == list(wl.WORKLOADS)
    sizes = TOY_SHAPES

    for name, make in (("chat", wl.chat), ("shared-prefix", wl.shared_prefix)):
        [row] = results[name]
        sent = make(RATE, NUM_REQUESTS, 0, VOCAB, sizes)  # the very requests the benchmark sent (seed 0)
        assert row["rate"] == RATE and row["requests"] == row["completed"] == NUM_REQUESTS and row["stopped"] == 0
        assert row["output_tokens"] == row["asked_tokens"] == sum(r.max_tokens for r in sent)
        assert row["prompt_tokens"] == sum(len(r.prompt) for r in sent)
        check_figures(row)
    # A system prompt sent again half a second after it was first sent is in the prefix cache by then.
    first_sent: dict[tuple, float] = {}
    repeats = defaultdict(int)
    for r in wl.shared_prefix(RATE, NUM_REQUESTS, 0, VOCAB, sizes):
        system = tuple(r.prompt[:sizes.tokens(sizes.system_prompt)])
        repeats[system] += system in first_sent and r.at - first_sent[system] >= 0.5
        first_sent.setdefault(system, r.at)
    block = 16  # the CPU's KV block
    expected = sum(repeats.values()) * (sizes.tokens(sizes.system_prompt) // block * block)
    assert expected > 0  # the seeded requests do repeat a system prompt
    assert results["shared-prefix"][0]["cached_prompt_tokens"] >= expected
    assert results["chat"][0]["cached_prompt_tokens"] == 0  # random prompts share no block

    streams, longs = results["long"]
    assert longs["label"] == "long prompts" and longs["requests"] == longs["completed"] == LONG_PROMPTS
    assert longs["output_tokens"] == LONG_PROMPTS * sizes.tokens(sizes.long_output)
    assert longs["prompt_tokens"] == LONG_PROMPTS * sizes.tokens(sizes.long_prompt)
    assert streams["label"] == "4 streams" and streams["requests"] >= 4
    assert streams["completed"] + streams["stopped"] == streams["requests"]  # every stream request ran until stopped
    check_figures(streams)
    check_figures({**longs, "itl_p50_ms": 0.0, "itl_p99_ms": 0.0})  # one output token each: no gaps

    # The tables come last, one per workload, in order.
    tail = proc.stdout[proc.stdout.index("\nchat:\n"):]
    assert tail.index("\nshared-prefix:\n") < tail.index("\nlong:\n")
    assert tail.count("| rate (req/s) |") == 3 and tail.count("highest rate with p99 TTFT under 1 s") == 2
    assert tail.rstrip().endswith("|") and "| 0.5 | long prompts |" in tail
