"""The data plane's logits processors and logprobs against HuggingFace transformers in float32.

Penalties: greedy tokens equal transformers' with RepetitionPenaltyLogitsProcessor and presence /
frequency written out as OpenAI defines them, mixed in one batch with rows that use none (through
the Engine, so also over a preemption). min_tokens and logit_bias, logprobs and prompt logprobs
are checked at the data plane's StepResult arrays (tests/support/plane_driver.py), through a
ModelRunner, a tensor-parallel LocalDataPlane and the decode-graph step on a CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.plane_driver import PlaneDriver
from support.sampling_reference import check_logprobs, hf_run, logprob_specs

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.local import LocalDataPlane
from nanoplane.dataplane.model_runner import ModelRunner
from nanoplane.proto.plane import SamplingSpec, int32_column


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 380) for _ in range(n)] for n in lengths]


PENALTIES = [dict(repetition=1.3), dict(presence=1.5, frequency=0.7), {},
             dict(presence=-0.5, frequency=1.0, repetition=0.8), {}]


@pytest.mark.parametrize("fused", ["0", "1"])
def test_penalties_greedy_match_transformers_beside_plain_rows(tiny_models, monkeypatch, fused):
    """fused=1: the Triton kernels in the interpreter; 0: their torch twins. Tight KV blocks preempt
    requests, which come back with their output and rebuild their counts from it."""
    monkeypatch.setenv("NANOPLANE_FUSED_SAMPLER", fused)
    path = tiny_models["qwen3"]
    ps = prompts([5, 40, 17, 3, 60], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=p.get("presence", 0.0),
                             frequency_penalty=p.get("frequency", 0.0),
                             repetition_penalty=p.get("repetition", 1.0)) for p in PENALTIES]
    llm = LLM(str(path), device="cpu", kvcache_block_size=16, num_kvcache_blocks=10, max_num_batched_tokens=32)
    try:
        assert llm.engine.data_plane.runner.sampler.fused == (fused == "1")
        outs = llm.generate(ps, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.data_plane.runner.tail.penalties.nbytes > 0
    finally:
        llm.close()
    for prompt, p, out in zip(ps, PENALTIES, outs, strict=True):
        assert out["token_ids"] == hf_run(path, prompt, 24, **p)[0], p
    assert outs[1]["token_ids"] != hf_run(path, ps[1], 24)[0]  # the penalties did change something


def runner(path, **kw) -> ModelRunner:
    return ModelRunner(DataPlaneConfig(str(path), device="cpu", block_size=16, num_kvcache_blocks=64,
                                       max_num_seqs=8, **kw))


@pytest.mark.parametrize("fused", [False, True])
def test_logprobs_and_prompt_logprobs_match_transformers(tiny_models, fused, monkeypatch):
    """fused: the Triton kernels in the interpreter. The LM head over a chunk's positions runs 5 at a
    time here, so the prompt logprobs cross its sub-chunks' edges."""
    from nanoplane.dataplane import logprobs

    monkeypatch.setattr(logprobs, "PROMPT_CHUNK", 5)
    path = tiny_models["llama-tied"]
    lengths = [7, 40, 2, 33, 18]
    specs, penalties = logprob_specs()
    r = runner(path)
    try:
        r.sampler.fused = r.tail.fused = fused
        driver = PlaneDriver(r, 16, chunk=16)  # prompts of 33 and 40 take several chunks
        recs = driver.generate(prompts(lengths, seed=9), specs, max_tokens=6)
        padded = [res for res in driver.results if res.top_ids.shape[1] == 5 and len(res.logprob_rows) > 1]
        assert padded and (padded[0].top_ids[0, 3:] == -1).all()  # row 0 asked 3 of the step's 5
    finally:
        r.close()
    check_logprobs(path, recs, specs, penalties, 6)


def test_min_tokens_and_logit_bias(tiny_models):
    """min_tokens masks the stop ids however strongly biased, until that many tokens are out; a +100
    bias forces its token."""
    path = tiny_models["qwen3"]
    eos = 0
    f32 = (lambda *v: torch.tensor(v, dtype=torch.float32).numpy())
    specs = [SamplingSpec(0.0, min_tokens=4, stop_ids=int32_column([eos, 11]), logit_bias_ids=int32_column([eos]),
                          logit_bias_values=f32(100.0)),
             SamplingSpec(0.0, logit_bias_ids=int32_column([42]), logit_bias_values=f32(100.0)),
             SamplingSpec(0.7, seed=3, logit_bias_ids=int32_column([5, 6]), logit_bias_values=f32(100.0, -100.0))]
    r = runner(path)
    try:
        recs = PlaneDriver(r, 16).generate(prompts([6, 20, 9], seed=2), specs, max_tokens=7)
    finally:
        r.close()
    assert eos not in recs[0].tokens[:4] and 11 not in recs[0].tokens[:4]
    assert recs[0].tokens[4:] == [eos] * 3
    assert recs[1].tokens == [42] * 7
    assert recs[2].tokens == [5] * 7


def test_bitmask_allows_only_its_tokens(tiny_models):
    path = tiny_models["qwen3"]
    allowed = {3, 40, 41, 200, 383}
    words = [0] * 12  # 384 tokens
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy()  # bit 31 wraps to the sign
    r = runner(path)
    try:
        recs = PlaneDriver(r, 16).generate(prompts([6, 12], seed=5), [SamplingSpec(0.0), SamplingSpec(1.0, seed=1)],
                                           max_tokens=8, bitmask=lambda rec: mask if rec.slot == 1 else None)
    finally:
        r.close()
    assert set(recs[1].tokens) <= allowed
    assert recs[0].tokens == hf_run(path, recs[0].prompt, 8)[0]


def test_tensor_parallel_logprobs_and_penalties(tiny_models, monkeypatch):
    """Two gloo ranks with the fused sampler: steps with processors or logprobs gather the logits to
    rank 0; the prompt logprobs' head runs on both ranks."""
    monkeypatch.setenv("NANOPLANE_FUSED_SAMPLER", "1")
    path = tiny_models["qwen3"]
    lengths = [7, 40, 2, 33, 18]
    specs, penalties = logprob_specs()
    plane = LocalDataPlane(DataPlaneConfig(str(path), device="cpu", world_size=2, block_size=16,
                                           num_kvcache_blocks=64, max_num_seqs=8))
    try:
        plane.start()
        assert plane.runner.sampler.fused
        recs = PlaneDriver(plane, 16, chunk=16).generate(prompts(lengths, seed=9), specs, max_tokens=5)
    finally:
        plane.close()
    check_logprobs(path, recs, specs, penalties, 5)


def test_kv_block_copies_and_refusals(tiny_models):
    from nanoplane.proto.plane import StepDescriptor

    r = runner(tiny_models["qwen3"])
    try:
        r.kv_cache.normal_()
        before = r.kv_cache.clone()
        res = r.execute(StepDescriptor(0, copy_src=int32_column([3, 5]), copy_dst=int32_column([10, 3])))
        assert not res.error
        # All read before any written: block 3's old content went to 10 and 5's to 3.
        assert torch.equal(r.kv_cache[:, :, 10], before[:, :, 3]) and torch.equal(r.kv_cache[:, :, 3], before[:, :, 5])
        assert torch.equal(r.kv_cache[:, :, 5], before[:, :, 5])
        bad = r.execute(StepDescriptor(1, copy_src=int32_column([64]), copy_dst=int32_column([0])))
        assert "refused" in bad.error and "outside the cache" in bad.error
        bad = r.execute(StepDescriptor(1, bitmask_rows=int32_column([0]), bitmask=torch.zeros(1, 12,
                                       dtype=torch.int32).numpy()))
        assert "bitmask rows" in bad.error
        assert not r.execute(StepDescriptor(1)).error  # the refusals consumed no step id
    finally:
        r.close()


def test_tensor_parallel_draw_counters_stay_in_step(tiny_models, monkeypatch):
    """Unseeded rows draw from the shared stream's counter: over the steps whose logprobs row sends
    the logits to rank 0 (the row ends after 2 tokens) and the sliced steps after them, two ranks
    draw what one rank draws from whole rows."""
    monkeypatch.setenv("NANOPLANE_FUSED_SAMPLER", "1")
    path = tiny_models["qwen3"]
    ps = prompts([3, 30, 12], seed=12)
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1, presence_penalty=0.5)]
    runs = {}
    for tp in (1, 2):
        llm = LLM(str(path), device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=64)
        try:
            runs[tp] = [o["token_ids"] for o in llm.generate(ps, params, use_tqdm=False)]
        finally:
            llm.close()
    assert runs[2] == runs[1]
    assert runs[1][0] != runs[1][1]
