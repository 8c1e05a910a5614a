"""Tensor parallelism in the embedded engine: two CPU ranks over gloo give transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy

from controlplane import LLM, SamplingParams


@pytest.mark.parametrize("name", ["qwen3", "llama-tied"])
def test_tp2_greedy_matches_transformers(tiny_models, name):
    path = tiny_models[name]
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (1, 17, 90, 200)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        assert [i.rank for i in llm.engine.infos] == [0, 1]
        outs = llm.generate(prompts, params, use_tqdm=False)
        # seeded sampling on rank 0 is shared with rank 1 through the broadcast of sampled ids
        sampled = llm.generate(prompts[:2], SamplingParams(temperature=0.9, seed=5, max_tokens=8), use_tqdm=False)
        again = llm.generate(prompts[:2], SamplingParams(temperature=0.9, seed=5, max_tokens=8), use_tqdm=False)
        assert sampled == again
    finally:
        llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, params.max_tokens)


def test_tp_size_must_divide_heads(tiny_models):
    # 4 query heads and 2 kv heads cannot be split over 3 ranks
    with pytest.raises(Exception, match="divisible"):
        LLM(str(tiny_models["qwen3"]), device="cpu", tensor_parallel_size=3)
