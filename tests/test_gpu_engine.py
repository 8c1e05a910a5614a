"""The engine on a CUDA GPU: exact greedy tokens in float32, and bf16 logits close to transformers'
on Qwen3-0.6B-shaped random weights (greedy agreement rate printed). Run on the device machine:
`python -m pytest -m gpu tests/test_gpu_engine.py -s`."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from controlplane import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["qwen3", "llama-tied", "llama-mqa"])
def test_fp32_greedy_matches_transformers_on_gpu(tiny_models, name, backend):
    path = tiny_models[name]
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (1, 16, 17, 100, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=128,
              attention_backend=backend, num_kvcache_blocks=64)
    try:
        outs = llm.generate(prompts + prompts[1:3], params, use_tqdm=False)  # repeats hit the prefix cache
        assert llm.engine.scheduler.num_chunked_prefills > 0
    finally:
        llm.close()
    for prompt, out in zip(prompts + prompts[1:3], outs, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, params.max_tokens)


QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0)


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    from tiny_models import make_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-0.6b")
    make_tokenizer(path)
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_06B)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path, model.eval()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_logits_close_to_transformers(qwen3_06b, backend):
    path, hf = qwen3_06b
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 150000) for _ in range(n)] for n in (7, 200, 1000)]
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend=backend, max_model_len=2048,
              gpu_memory_utilization=0.5)
    runner = llm.engine.data_plane.runner
    recorded: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def record(hidden):
        logits = original(hidden)
        recorded.append(logits.float().cpu())
        return logits

    runner.model.compute_logits = record
    n_new = 32
    agree = total = 0
    worst_prefill = worst_decode = 0.0
    try:
        for prompt in prompts:
            recorded.clear()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
            ours = torch.cat(recorded)  # one row per step: the logits each sampled token came from
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + out[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float().cpu()
            assert ours.shape == ref.shape
            err = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
            worst_prefill = max(worst_prefill, float(err[0]))
            worst_decode = max(worst_decode, float(err[1:].max()))
            agree += int((ref.argmax(-1) == torch.tensor(out)).sum())
            total += len(out)
    finally:
        llm.close()
    rate = agree / total
    print(f"\n[{backend}] bf16 Qwen3-0.6B shapes: relative logit error prefill {worst_prefill:.4f}, "
          f"decode {worst_decode:.4f}; greedy agreement with transformers {agree}/{total} = {rate:.3f}")
    assert worst_prefill < 0.05 and worst_decode < 0.05
    assert rate >= 0.9
