"""The engine on a CUDA GPU: exact greedy tokens in float32, and bf16 logits close to transformers'
on Qwen3-0.6B-shaped random weights (greedy agreement rate printed). Run on the device machine:
`python -m pytest -m gpu tests/engine/test_gpu_engine.py -s`."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import hf_greedy

from nanoplane.controlplane import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("policy", ["prefill-first", "mixed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["qwen3", "llama-tied", "llama-mqa"])
def test_fp32_greedy_matches_transformers_on_gpu(tiny_models, name, backend, policy):
    path = tiny_models[name]
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (1, 16, 17, 100, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), device="cuda", dtype="float32", kvcache_block_size=16, max_num_batched_tokens=128,
              attention_backend=backend, num_kvcache_blocks=64, scheduling_policy=policy)
    try:
        outs = llm.generate(prompts + prompts[1:3], params, use_tqdm=False)  # repeats hit the prefix cache
        assert llm.engine.scheduler.num_chunked_prefills > 0
        # mixed: decode rows beside prompt chunks in one eager step (no CUDA graph covers such a step)
        assert (llm.engine.scheduler.num_mixed_steps > 0) == (policy == "mixed")
    finally:
        llm.close()
    for prompt, out in zip(prompts + prompts[1:3], outs, strict=True):
        assert out["token_ids"] == hf_greedy(path, prompt, params.max_tokens)


QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0)


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
    """Random Qwen3-0.6B-shaped weights saved in bf16, and transformers' models loaded back from disk.

    Loaded, not the in-memory model: casting a model with .to() also rounds its rotary inv_freq
    buffer to bf16, which a model loaded from the checkpoint (ours included) never does.
    """
    from support.tiny_models import make_tokenizer
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-0.6b")
    make_tokenizer(path)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B))
    with torch.no_grad():  # norm weights other than ones: the data plane folds them into the projections
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(path)
    load = lambda dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()  # noqa: E731
    return path, load(torch.bfloat16), load(torch.float32)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_logits_close_to_transformers(qwen3_06b, backend):
    """bf16 rounding alone moves logits by a few percent over 28 random layers, so the yardstick is
    transformers' own bf16 error: both are measured against fp32 on the same weights and sequences."""
    path, hf_bf16, hf_fp32 = qwen3_06b
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 150000) for _ in range(n)] for n in (7, 200, 1000)]
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend=backend, max_model_len=2048,
              gpu_memory_utilization=0.5)
    runner = llm.engine.data_plane.runner
    recorded: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def record(hidden):
        logits = original(hidden)
        recorded.append(logits.float())
        return logits

    runner.model.compute_logits = record  # eager steps (prefill, and every step with the torch backend)
    graphs = runner.graphs
    if graphs is not None:
        # Decode steps replay a graph that holds the LM head and the argmax: run it without the
        # tail to see its logits, then finish the step as the greedy tail does.
        graph_run = graphs.run

        def run_recorded(*args):
            logits = graph_run(*args[:7])
            recorded.append(logits.float())
            tokens = logits.argmax(dim=-1)
            graphs.scatter(tokens)
            return tokens

        graphs.run = run_recorded
    ours_err, hf_err, ours_agree, hf_agree = [], [], 0, 0
    try:
        for prompt in prompts:
            recorded.clear()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
            ours = torch.cat(recorded)  # one row per step: the logits each sampled token came from
            seq = torch.tensor([prompt + out[:-1]], device="cuda")
            with torch.no_grad():
                ref = hf_fp32(seq).logits[0, len(prompt) - 1:].float()
                theirs = hf_bf16(seq).logits[0, len(prompt) - 1:].float()
            assert ours.shape == ref.shape
            ours_err.append(rel_err(ours, ref))
            hf_err.append(rel_err(theirs, ref))
            ours_agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            hf_agree += int((theirs.argmax(-1) == ref.argmax(-1)).sum())
    finally:
        runner.model.compute_logits = original
        llm.close()
    ours_err, hf_err = torch.cat(ours_err), torch.cat(hf_err)
    n = len(ours_err)
    print(f"\n[{backend}] bf16 Qwen3-0.6B shapes vs fp32 transformers, {n} positions: relative logit error "
          f"ours mean {ours_err.mean():.4f} max {ours_err.max():.4f} (prefill rows {ours_err[::32].max():.4f}); "
          f"transformers-bf16 mean {hf_err.mean():.4f} max {hf_err.max():.4f}; greedy agreement with fp32 "
          f"ours {ours_agree}/{n} = {ours_agree / n:.3f}, transformers-bf16 {hf_agree}/{n} = {hf_agree / n:.3f}")
    assert ours_err.mean() <= 1.25 * hf_err.mean()
    assert ours_agree >= hf_agree - 0.05 * n


def test_graph_tails_sample_as_the_eager_step_does(tiny_models):
    """Decode steps through the captured graphs (LM head, argmax or the fused sampler, the token
    write-back) give the tokens of the eager step: greedy, seeded and unseeded sampled rows, and a
    top-k row, which sends its steps back to the eager sampler."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (3, 40, 17, 90, 9)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.1, seed=123, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, top_k=20, max_tokens=12, ignore_eos=True)]
    runs = {}
    for eager in (False, True):
        for subset in ("no top-k", "all"):
            chosen = slice(0, 4) if subset == "no top-k" else slice(0, 5)
            llm = LLM(str(tiny_models["qwen3"]), device="cuda", dtype="float32", enforce_eager=eager,
                      attention_backend="triton", seed=1, max_num_seqs=8, kvcache_block_size=16,
                      num_kvcache_blocks=64)
            try:
                assert (llm.engine.data_plane.runner.graphs is None) == eager
                runs[eager, subset] = [o["token_ids"] for o in
                                       llm.generate(prompts[chosen], params[chosen], use_tqdm=False)]
            finally:
                llm.close()
    for subset in ("no top-k", "all"):
        assert runs[False, subset] == runs[True, subset]
        assert [len(t) for t in runs[False, subset]] == [p.max_tokens for p in params[: len(runs[False, subset])]]


def test_programmatic_dependent_launch_changes_no_result(tiny_models, monkeypatch):
    """PDL only moves launches earlier; a kernel that read its predecessor's output before waiting would
    show here as tokens that differ between launches with and without it (bf16, graphs and eager)."""
    from nanoplane.kernels import pdl

    rng = random.Random(9)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (2, 33, 70, 5, 120, 9, 41)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("NANOPLANE_PDL", flag)  # each LLM's ModelRunner reads it and calls set_pdl
        pdl.set_pdl(flag == "1")
        assert pdl.pdl_enabled(torch.device("cuda", 0)) == (flag == "1" and torch.cuda.get_device_capability()[0] >= 9)
        for eager in (False, True):
            llm = LLM(str(tiny_models["qwen3"]), device="cuda", dtype="bfloat16", enforce_eager=eager,
                      attention_backend="triton", max_num_seqs=8, kvcache_block_size=16, num_kvcache_blocks=128)
            try:
                runs[flag, eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
            finally:
                llm.close()
    pdl.set_pdl(True)
    assert runs["1", False] == runs["0", False]
    assert runs["1", True] == runs["0", True]
