"""The sampling tail on a CUDA GPU: the Triton kernels, the decode CUDA graphs with processors
between the model's replay and the sampling tail's, and logprobs copied back through pinned memory.

float32: tokens and logprobs equal transformers' as on the CPU. bf16: agreement rates with
transformers' float32 reference are printed (run with -s), and bounded loosely, since bf16
logits differ from float32 ones by rounding. Run on the device machine:
`python -m pytest -m gpu tests/engine/test_gpu_sampling_controls.py -s`.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from support.plane_driver import PlaneDriver
from support.sampling_reference import check_logprobs, hf_prompt_logprobs, hf_run, logprob_specs
from support.tiny_models import make_tiny_model

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PENALTIES = [dict(repetition=1.3), dict(presence=1.5, frequency=0.7), {}, dict(presence=-0.5, frequency=1.0,
                                                                                repetition=0.8)]


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 380) for _ in range(n)] for n in lengths]


def penalised_params(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                           presence_penalty=p.get("presence", 0.0), frequency_penalty=p.get("frequency", 0.0),
                           repetition_penalty=p.get("repetition", 1.0)) for p in PENALTIES]


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_penalties_match_transformers_with_cuda_graphs(tiny_models, eager):
    path = tiny_models["qwen3"]
    ps = prompts([5, 40, 17, 60], seed=4)
    llm = LLM(str(path), device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
              attention_backend="triton", enforce_eager=eager)
    try:
        runner = llm.engine.data_plane.runner
        assert (runner.graphs is None) == eager and runner.sampler.fused
        outs = llm.generate(ps, penalised_params(24), use_tqdm=False)
    finally:
        llm.close()
    for prompt, p, out in zip(ps, PENALTIES, outs, strict=True):
        assert out["token_ids"] == hf_run(path, prompt, 24, **p)[0], p


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_logprobs_match_transformers(tiny_models, eager):
    path = tiny_models["llama-tied"]
    specs, penalties = logprob_specs()
    r = ModelRunner(DataPlaneConfig(str(path), device="cuda", dtype="float32", block_size=16, num_kvcache_blocks=64,
                                    max_num_seqs=8, attention_backend="triton", enforce_eager=eager))
    try:
        recs = PlaneDriver(r, 16, chunk=16).generate(prompts([7, 40, 2, 33, 18], seed=9), specs, max_tokens=6)
    finally:
        r.close()
    check_logprobs(path, recs, specs, penalties, 6, tol=1e-3)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "qwen3", "qwen3", dtype=torch.bfloat16)


def test_bf16_agreement_with_transformers(bf16_model):
    """Greedy tokens under penalties, and logprobs, of the bf16 data plane against transformers in
    float32 on the same (bf16-valued) weights; the agreement rates are printed."""
    path = bf16_model
    ps = prompts([5, 40, 17, 60] * 4, seed=8)
    params = penalised_params(32) * 4
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kvcache_block_size=16, attention_backend="triton")
    try:
        outs = llm.generate(ps, params, use_tqdm=False)
    finally:
        llm.close()
    same = total = first_diverged = 0
    for prompt, p, out in zip(ps, PENALTIES * 4, outs, strict=True):
        ref = hf_run(path, prompt, 32, **p)[0]
        agree = next((i for i, (a, b) in enumerate(zip(out["token_ids"], ref, strict=True)) if a != b), 32)
        same += agree  # tokens up to the first difference: after it the sequences differ anyway
        total += 32
        first_diverged += agree < 32
    print(f"\nbf16 penalised greedy: {same / total:.1%} of tokens before the first divergence; "
          f"{first_diverged}/{len(ps)} sequences diverged")
    assert same / total > 0.5

    specs, _ = logprob_specs()
    r = ModelRunner(DataPlaneConfig(str(path), device="cuda", dtype="bfloat16", block_size=16, num_kvcache_blocks=64,
                                    max_num_seqs=8, attention_backend="triton"))
    try:
        recs = PlaneDriver(r, 16, chunk=16).generate(prompts([7, 40, 2, 33, 18], seed=9), specs, max_tokens=8)
    finally:
        r.close()
    errors, top1 = [], []
    for rec in recs:
        if rec.prompt_logprobs:
            ref = hf_prompt_logprobs(path, rec.prompt)
            for pos, (lp, ids, _) in rec.prompt_logprobs.items():
                errors.append(abs(lp - float(ref[pos - 1, rec.prompt[pos]])))
                if ids and ids[0] >= 0:
                    top1.append(ids[0] == int(ref[pos - 1].argmax()))
    errors = np.array(errors)
    print(f"bf16 prompt logprobs: max |error| {errors.max():.4f}, mean {errors.mean():.4f}; "
          f"top-1 agreement {np.mean(top1):.1%} of {len(top1)}")
    assert errors.mean() < 0.05 and np.mean(top1) > 0.9


def test_penalty_state_at_qwen3_vocabulary():
    """The pools grow by POOL_GROWTH rows of 151,936 counts and flags: what 256 penalised requests cost."""
    from nanoplane.dataplane.logits_processing import POOL_GROWTH, PenaltyState

    state = PenaltyState(256, 151_936, torch.device("cuda"))
    assert state.nbytes == 0
    for slot in range(256):
        state.row_of[slot] = state._take()
    print(f"\npenalty state for 256 requests: {state.nbytes / 2**20:.0f} MiB")
    assert state.nbytes == 256 * 151_936 * 5 and 256 % POOL_GROWTH == 0
