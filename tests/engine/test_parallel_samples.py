"""n parallel samples of one prompt on the tiny models (CPU, float32): the prompt is prefilled once,
each sample's tokens equal an n=1 run seeded with seed + i (the data plane keys a seeded row's noise
with its seed and the position drawn, so a fork drawing at the same position with seed + i draws the
same noise as that run), every block is freed after, through preemption and aborts."""

from __future__ import annotations

import pytest
from conftest import hf_greedy
from test_engine_correctness import random_prompts

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.controlplane.sequence import FinishReason

BS = 16
LENGTHS = [16, 21, 32, 45]  # multiples of the block size and not


@pytest.fixture(scope="module")
def llm(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", kvcache_block_size=BS)
    yield llm
    llm.close()


def alone(llm: LLM, prompts: list[list[int]], params: SamplingParams, index: int) -> list[list[int]]:
    """Sample `index` of each prompt, run with n = 1 and seed + index."""
    one = SamplingParams(temperature=params.temperature, top_k=params.top_k, max_tokens=params.max_tokens,
                         seed=params.sample_seed(index), ignore_eos=params.ignore_eos)
    return [out["token_ids"] for out in llm.generate(prompts, one, use_tqdm=False)]


def samples(outs: list[dict]) -> list[list[list[int]]]:
    return [[s["token_ids"] for s in out["outputs"]] for out in outs]


def test_seeded_samples_differ_and_each_equals_its_seed_alone(llm):
    prompts = random_prompts(LENGTHS, seed=1)
    params = SamplingParams(temperature=1.0, seed=1234, n=4, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = samples(outs)
    for out, per_prompt in zip(outs, got, strict=True):
        assert len(per_prompt) == 4 and len({tuple(t) for t in per_prompt}) == 4, "four different samples"
        assert out["token_ids"] == per_prompt[0] and out["text"] == out["outputs"][0]["text"]
        assert all(s["finish_reason"] == "length" and s["text"] == llm.tokenizer.decode(s["token_ids"])
                   for s in out["outputs"])
    expected = [alone(llm, prompts, params, i) for i in range(4)]
    assert got == [[expected[i][p] for i in range(4)] for p in range(len(prompts))]
    bm = llm.engine.scheduler.block_manager
    assert bm.num_used_blocks == 0 and not llm.engine.seqs


def test_mixed_steps_with_chunked_prompts(tiny_models):
    """Forks join mixed steps beside decode rows and prompt chunks, two steps in flight."""
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", kvcache_block_size=BS, scheduling_policy="mixed",
              max_num_batched_tokens=24, steps_in_flight=2)
    try:
        prompts = random_prompts([40, 16, 33], seed=4)
        params = SamplingParams(temperature=1.0, seed=99, n=3, max_tokens=8, ignore_eos=True)
        got = samples(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.scheduler.num_mixed_steps > 0 and llm.engine.scheduler.num_forks > 0
        expected = [alone(llm, prompts, params, i) for i in range(3)]
    finally:
        llm.close()
    assert got == [[expected[i][p] for i in range(3)] for p in range(len(prompts))]


def test_greedy_samples_all_equal_the_greedy_run(llm, tiny_models):
    prompts = random_prompts([17, 32], seed=2)
    params = SamplingParams(temperature=0, n=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, per_prompt in zip(prompts, samples(outs), strict=True):
        assert per_prompt == [hf_greedy(tiny_models["qwen3"], prompt, 8)] * 3


@pytest.mark.parametrize("length", [32, 37])
def test_the_prompt_is_computed_once_and_its_full_blocks_shared(llm, length):
    """Driven step by step: while all four samples run, their tables share the prompt's full blocks
    and hold the rest each on its own; the blocks in use are exactly those; all are freed after."""
    engine = llm.engine
    prompt = random_prompts([length], seed=length)[0]
    seq = engine.add_request(prompt, SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=6, ignore_eos=True))
    full, computed, seen_all = (length - 1) // BS, 0, False
    while engine.has_work():
        out = engine.step()
        computed += out.num_tokens
        tables = [s.block_table for s in seq.group if s.block_table]
        if len(tables) == 4:
            seen_all = True
            assert all(t[:full] == tables[0][:full] for t in tables)
            assert len({b for t in tables for b in t[full:]}) == sum(len(t) - full for t in tables)
            assert engine.scheduler.block_manager.num_used_blocks == full + sum(len(t) - full for t in tables)
    assert seen_all
    assert engine.scheduler.num_forks >= 3
    # The prompt once, each fork its last prompt token, then each sample's decode steps.
    assert computed == length + 3 + 4 * 5
    assert engine.scheduler.block_manager.num_used_blocks == 0 and not engine.seqs


def test_forks_preempted_give_the_unpressured_samples(tiny_models):
    prompts = random_prompts([20, 35], seed=3)
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=30, ignore_eos=True)
    roomy = LLM(str(tiny_models["llama-tied"]), device="cpu", kvcache_block_size=BS)
    try:
        expected = roomy.generate(prompts, params, use_tqdm=False)
        assert roomy.engine.scheduler.num_preemptions == 0
    finally:
        roomy.close()
    # 9 blocks of 16 tokens: the six samples need 18 at their longest.
    tight = LLM(str(tiny_models["llama-tied"]), device="cpu", kvcache_block_size=BS, num_kvcache_blocks=9)
    try:
        s = tight.engine.scheduler
        preempted, preempt = [], s.preempt
        s.preempt = lambda seq: (preempted.append(seq.sample_index), preempt(seq))
        got = tight.generate(prompts, params, use_tqdm=False)
        assert any(preempted) and s.num_forks > 0  # a fork was preempted and recomputed
        assert s.block_manager.num_used_blocks == 0 and s.block_manager.num_free_blocks == 9
    finally:
        tight.close()
    assert samples(got) == samples(expected)


@pytest.mark.parametrize("after", [1, 2, 5])
def test_abort_mid_run_frees_everything(llm, after):
    engine = llm.engine
    seq = engine.add_request(random_prompts([40], seed=after)[0],
                             SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=20, ignore_eos=True))
    for _ in range(after):
        engine.step()
    engine.abort(seq.seq_id)
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason is FinishReason.ABORT for s in seq.group)
    assert engine.scheduler.block_manager.num_used_blocks == 0 and not engine.seqs
    assert sorted(engine.scheduler.free_slots) == list(range(engine.scheduler.max_num_seqs))


def test_each_sample_carries_its_own_logprobs(llm):
    prompt = random_prompts([21], seed=9)[0]
    outs = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, logprobs=2,
                                                 ignore_eos=True), use_tqdm=False)
    for sample in outs[0]["outputs"]:
        assert len(sample["logprobs"]) == len(sample["token_ids"]) == 5
        for token, entry in zip(sample["token_ids"], sample["logprobs"], strict=True):
            assert token in entry and 2 <= len(entry) <= 3 and all(lp <= 0 for lp in entry.values())


def test_each_sample_follows_the_stop_strings_on_its_own(llm):
    prompt = random_prompts([21], seed=12)[0]
    params = SamplingParams(temperature=1.0, seed=8, n=3, max_tokens=12, ignore_eos=True)
    full = [s["text"] for s in llm.generate([prompt], params, use_tqdm=False)[0]["outputs"]]
    stop = full[1][len(full[1]) // 2:][:3]  # from the middle of sample 1's text
    assert stop.strip()
    stopped = SamplingParams(temperature=1.0, seed=8, n=3, max_tokens=12, ignore_eos=True, stop=[stop])
    outs = llm.generate([prompt], stopped, use_tqdm=False)[0]["outputs"]
    for text, out in zip(full, outs, strict=True):
        if stop in text:
            assert out["text"] == text[:text.index(stop)] and out["finish_reason"] == "stop"
            assert out["stop_reason"] == stop
        else:
            assert out["text"] == text and out["finish_reason"] == "length"
    assert not llm.engine.seqs and llm.engine.scheduler.block_manager.num_used_blocks == 0
