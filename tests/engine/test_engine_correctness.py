"""Greedy tokens of the engine equal HuggingFace transformers' (float32, CPU), token for token,
through chunked prefill, prefix-cache hits and preemption, under both scheduling policies (a mixed
step runs decode rows and prompt chunks in one eager forward)."""

from __future__ import annotations

import gc
import random

import pytest
from conftest import TINY, hf_greedy

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.models.norm_fold import folded

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LENGTHS = [1, 2, 15, 16, 17, 63, 130, 300]
POLICIES = ["prefill-first", "mixed"]


def random_prompts(lengths: list[int], seed: int, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,backend", [(name, "torch") for name in TINY] + [("qwen3", "triton"),
                                                                               ("llama-mqa", "triton")])
def test_greedy_matches_transformers_with_chunked_prefill(tiny_models, name, backend, policy):
    """backend "triton" runs our kernels (attention, the fused QKV prologue and SiLU, the layers' norms folded into
    the projections after them: models/norm_fold.py) in Triton's interpreter; its mixed steps run the paged
    prefill kernel with decode rows as 1-token queries."""
    check_chunked_prefill(tiny_models[name], backend, policy)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_steps_with_two_steps_in_flight(tiny_models, backend):
    """Step s+2 is scheduled and sent before step s's result: a decode row's input is the token the
    data plane sampled for it, never one the control plane has seen."""
    check_chunked_prefill(tiny_models["qwen3"], backend, "mixed", steps_in_flight=2)


def check_chunked_prefill(path, backend: str, policy: str, steps_in_flight: int = 0) -> None:
    prompts = random_prompts(LENGTHS, seed=len(path.name))
    llm = LLM(str(path), device="cpu", kvcache_block_size=16, max_num_batched_tokens=64, attention_backend=backend,
              scheduling_policy=policy, steps_in_flight=steps_in_flight)
    try:
        assert folded(llm.engine.data_plane.runner.model) == (backend == "triton")
        assert llm.engine.steps_in_flight == (steps_in_flight or 1)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_chunked_prefills > 0  # 130 and 300 do not fit a 64-token step
        assert (llm.engine.scheduler.num_mixed_steps > 0) == (policy == "mixed")
    finally:
        llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("policy", POLICIES)
def test_prefix_cache_hits_keep_outputs_exact(tiny_models, policy):
    path = tiny_models["qwen3"]
    rng = random.Random(7)
    shared = [rng.randrange(1, 380) for _ in range(50)]  # three full blocks of 16 and a partial one
    prompts = [shared + [rng.randrange(1, 380) for _ in range(n)] for n in (1, 9, 30)]
    # A 16-token budget chunks what the cache leaves to compute, beside decode rows under `mixed`.
    llm = LLM(str(path), device="cpu", kvcache_block_size=16, max_num_batched_tokens=16, scheduling_policy=policy)
    try:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        hits_before = llm.engine.scheduler.block_manager.num_cache_hits
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        hits = llm.engine.scheduler.block_manager.num_cache_hits - hits_before
        # each later prompt reuses the three shared full blocks
        assert hits == 3 * len(prompts[1:])
        # the same prompt again hits its own blocks, all but the block holding its last token
        again = llm.generate(prompts[2:], GREEDY, use_tqdm=False)
        assert again == rest[1:]
        assert (llm.engine.scheduler.num_mixed_steps > 0) == (policy == "mixed")
    finally:
        llm.close()
    for prompt, out in zip(prompts, first + rest, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_gives_the_unpressured_outputs(tiny_models, policy):
    path = tiny_models["llama-tied"]
    prompts = random_prompts([20, 35, 5, 28, 40, 12], seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(path), device="cpu", kvcache_block_size=16)
    try:
        expected = roomy.generate(prompts, params, use_tqdm=False)
        assert roomy.engine.scheduler.num_preemptions == 0
    finally:
        roomy.close()
    # 8 blocks of 16 tokens hold 128 tokens; the six requests need 300 together.
    tight = LLM(str(path), device="cpu", kvcache_block_size=16, num_kvcache_blocks=8, scheduling_policy=policy)
    try:
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.scheduler.num_preemptions > 0
        assert (tight.engine.scheduler.num_mixed_steps > 0) == (policy == "mixed")
        bm = tight.engine.scheduler.block_manager
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    finally:
        tight.close()
    assert got == expected
    for prompt, out in zip(prompts, got, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, params.max_tokens)


def test_text_prompts_and_eos(tiny_models):
    path = tiny_models["qwen3"]
    llm = LLM(str(path), device="cpu")
    try:
        eos = llm.tokenizer.eos_token_ids[0]
        prompt = llm.tokenizer.encode("the quick brown fox")
        expected = hf_greedy(path, prompt, 8)
        # Declaring the fourth greedy token a stop token ends the output right there.
        out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=8,
                                                                   stop_token_ids=[expected[3]]), use_tqdm=False)
        assert out[0]["token_ids"] == expected[: expected.index(expected[3]) + 1]
        # As in vLLM, the stop id stays in token_ids and its text is left out.
        assert out[0]["text"] == llm.tokenizer.decode(out[0]["token_ids"][:-1])
        assert (out[0]["finish_reason"], out[0]["stop_reason"]) == ("stop", expected[3])
        assert eos not in out[0]["token_ids"][:-1]
    finally:
        llm.close()


def test_startup_objects_frozen_while_the_llm_lives(tiny_models):
    """A full garbage collection mid-run walks every start-up object (200-280 ms on the GPU hosts,
    BENCHMARKS.md): they sit in the permanent generation while the LLM lives, and leave it at close."""
    gc.unfreeze()
    llm = LLM(str(tiny_models["qwen3"]), device="cpu")
    try:
        assert gc.get_freeze_count() > 10_000  # torch and the model at least
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 4
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0
