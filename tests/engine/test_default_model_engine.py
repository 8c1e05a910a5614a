"""Our engine, on the real embedded default model (SmolLM2-135M-Instruct), answers like a chat model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import hf_greedy

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.models.default_model import default_model_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    # The README's first command converts into the default cache; reuse it when it is there.
    cache = os.environ.get("NANOPLANE_CACHE") or str(Path.home() / ".cache" / "nanoplane")
    engine = LLM(str(default_model_dir(cache)), device="cpu")
    yield engine
    engine.close()


def test_capital_of_france_is_paris(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out["text"]
    # token for token what transformers answers on the same weights, up to and including EOS
    ids = llm.tokenizer.encode(prompt)
    expected = hf_greedy(Path(llm.config.model), ids, len(out["token_ids"]))
    assert out["token_ids"] == expected
    assert out["token_ids"][-1] in llm.tokenizer.eos_token_ids


def test_batch_of_chat_questions(llm):
    questions = ["What is the capital of France?", "What is 2 + 2?", "Name a primary color."]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    alone = [llm.generate([p], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0] for p in prompts]
    assert outs == alone  # batching does not change greedy answers
    assert "Paris" in outs[0]["text"] and "4" in outs[1]["text"]
