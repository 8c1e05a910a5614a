"""Tensor parallelism in the embedded engine: two CPU ranks over gloo give transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy

from nanoplane.controlplane import LLM, SamplingParams


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


def test_tp2_draws_from_vocabulary_slices_as_one_rank_draws_whole_rows(tiny_models, monkeypatch):
    """With the fused sampler each rank draws from its slice of the vocabulary and the ranks swap
    their best (score, column) pairs (ModelRunner._sample_slices): the same greedy tokens as
    transformers, and seeded draws equal to one rank's draws from whole rows (the kernel under
    Triton's interpreter here; the logits of the two layouts differ only by float rounding)."""
    path = tiny_models["qwen3"]
    monkeypatch.setenv("NANOPLANE_FUSED_SAMPLER", "1")  # the spawned rank inherits it
    rng = random.Random(22)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (3, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in (7, 8)]
    # Unseeded rows draw from the shared stream's counter, which must advance alike on every rank,
    # also over the steps whose top-k row sends the logits to rank 0 (the row ends after 2 tokens).
    unseeded = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=1.0, top_k=5, max_tokens=2, ignore_eos=True)]
    runs = {}
    for tp in (1, 2):
        llm = LLM(str(path), device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=64)
        try:
            assert llm.engine.data_plane.runner.sampler.fused
            runs[tp] = [[o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
                        for params in (greedy, seeded, unseeded, unseeded)]
        finally:
            llm.close()
    for prompt, out in zip(prompts, runs[2][0], strict=True):
        assert out == hf_greedy(path, prompt, greedy.max_tokens)
    assert runs[2][1:] == runs[1][1:]
    assert runs[2][1] != runs[2][0] and runs[2][2] != runs[2][3]  # they did draw, and the stream moved on


def test_tp_size_must_divide_heads(tiny_models):
    # 4 query heads and 2 kv heads cannot be split over 3 ranks
    with pytest.raises(Exception, match="divisible"):
        LLM(str(tiny_models["qwen3"]), device="cpu", tensor_parallel_size=3)
