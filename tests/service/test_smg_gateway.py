"""The Shepherd Model Gateway (PyPI `smg`) in front of `nanoplane serve` on the embedded default model,
called with the official `openai` client: real processes, vLLM's engine gRPC protocol between them.
The protocol's RPCs one by one: tests/service/test_vllm_grpc.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.conversion import needs_conversion_deps

from nanoplane.clients import Client
from nanoplane.demo import serve_in_background
from nanoplane.models.default_model import MODEL_NAME, REQUIRED_FILES, default_model_dir
from nanoplane.process import free_port, stop_process

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("smg", reason="the gateway comes from PyPI's smg (the dev extra)")

ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
START_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("NANOPLANE_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "nanoplane"
    if not all((root / MODEL_NAME / name).is_file() for name in REQUIRED_FILES):
        needs_conversion_deps()
    return default_model_dir(root)


@contextlib.contextmanager
def gateway(worker: str, model: Path) -> Iterator[str]:
    """`smg launch` in front of the worker (no network needed); yields its OpenAI base URL once it
    lists the model and answers."""
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "smg", "launch", "--backend", "vllm", "--worker-urls",
                             f"grpc://{worker}", "--model-path", str(model), "--tokenizer-path", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(metrics_port), "--log-level", "warn"])
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"smg exited with code {proc.returncode}"
            assert time.monotonic() < deadline, "smg never listed the model"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/models", timeout=2) as answer:
                if any(m["id"] == MODEL_NAME for m in json.load(answer).get("data", [])):
                    break
            time.sleep(0.2)
        yield base
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[openai.OpenAI, Client]]:
    flags = ["--model", str(model_dir), "--device", "cpu"]
    with contextlib.ExitStack() as stack:
        address, _ = stack.enter_context(serve_in_background(flags, START_S, cwd=ROOT))
        base = stack.enter_context(gateway(address, model_dir))
        client = stack.enter_context(Client(address))
        ai = stack.enter_context(openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120))
        # The gateway admits the worker after its first health and load checks: wait for an answer.
        deadline = time.monotonic() + 60
        while True:
            try:
                ai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "the gateway never routed a request to nanoplane"
                time.sleep(0.5)
        yield ai, client


def wait_idle(client: Client, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := client.server_status()).kv_blocks_used or s.running_requests or s.waiting_requests:
        assert time.monotonic() < deadline, f"requests still hold blocks: {s}"
        time.sleep(0.05)


def test_chat_stream_answers_paris(served):
    ai, client = served
    stream = ai.chat.completions.create(model=MODEL_NAME, messages=QUESTION, stream=True, max_tokens=30,
                                        temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    wait_idle(client)


def test_completion(served):
    ai, _ = served
    done = ai.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in done.choices[0].text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens > 0


def test_json_schema_answer_validates(served):
    ai, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    done = ai.chat.completions.create(
        model=MODEL_NAME, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(done.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"


def test_logprobs_with_top_logprobs(served):
    ai, _ = served
    done = ai.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=10, temperature=0,
                                      logprobs=True, top_logprobs=3)
    entries = done.choices[0].logprobs.content
    # The end-of-sequence token counts as a completion token but gets no entry (it has no text).
    assert len(entries) == done.usage.completion_tokens - (done.choices[0].finish_reason == "stop") > 0
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and values[0] <= 0
        assert e.logprob == pytest.approx(values[0], abs=1e-4)  # greedy takes the most likely token


def test_two_samples(served):
    ai, _ = served
    done = ai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}],
                                      max_tokens=12, temperature=1.0, seed=3, n=2)
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert all(c.message.content for c in done.choices)
    assert done.choices[0].message.content != done.choices[1].message.content


def test_cancelled_http_stream_frees_the_engines_blocks(served):
    ai, client = served
    stream = ai.chat.completions.create(
        model=MODEL_NAME, stream=True, max_tokens=1500, temperature=1.0, seed=1,
        messages=[{"role": "user", "content": "Write a very long story about a lighthouse keeper."}])
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    status = client.server_status()
    assert status.running_requests == 1 and status.kv_blocks_used > 0
    stream.close()  # the HTTP connection goes; the gateway cancels the gRPC call
    wait_idle(client)
