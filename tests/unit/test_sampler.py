"""The sampler: greedy, seeded determinism independent of the batch, and the top-k/top-p/min-p masks."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nanoplane.dataplane.sampler import Sampler, apply_filters
from nanoplane.settings import read_tuning

V = 50
# The fused path on CPU tensors runs in Triton's interpreter (CI); a CUDA machine compiles kernels
# instead, which cannot take CPU tensors: there tests/kernels/test_sampling_kernel.py covers the kernel.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the fused path on CPU tensors needs TRITON_INTERPRET=1")
FUSED = [False, pytest.param(True, marks=interpreted)]


def params(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return (full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32))


def test_greedy_is_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    s = Sampler(torch.device("cpu"))
    assert torch.equal(s(logits, *params(6, temperature=0.0), [None] * 6), logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    t, k, p, m = params(4)
    t[1] = 0.0
    out = Sampler(torch.device("cpu"))(logits, t, k, p, m, [None] * 4)
    assert out[1] == logits[1].argmax()


@pytest.mark.parametrize("fused", FUSED)
def test_seeded_rows_do_not_depend_on_the_batch(fused):
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    s = Sampler(torch.device("cpu"), seed=3, fused=fused)
    draws_alone, draws_batched = [], []
    t, k, p, m = params(5)
    t[1], k[3] = 0.0, 3  # the batch mixes in a greedy row and a filtered one (the torch path's, when fused)
    for step in range(20):
        # On both paths the seed and the position of the token drawn key a seeded row's noise.
        draws_alone.append(int(s(logits[2:3], *params(1), [1234], positions=[40 + step])[0]))
        batch = s(logits, t, k, p, m, [None, None, 1234, 5, None], positions=[3, 8, 40 + step, 9, 1])
        draws_batched.append(int(batch[2]))
        assert batch[1] == logits[1].argmax() and batch[3] in logits[3].topk(3).indices
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    s = Sampler(torch.device("cpu"), seed=0)
    rows = 4000
    counts = torch.bincount(s(logits.expand(rows, 4), *params(rows), [None] * rows), minlength=4).float() / rows
    assert torch.allclose(counts, probs, atol=0.03)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).expand(3000, 2)
    s = Sampler(torch.device("cpu"), seed=0)
    hot = s(logits, *params(3000, temperature=2.0), [None] * 3000).float().mean()
    cold = s(logits, *params(3000, temperature=0.25), [None] * 3000).float().mean()
    assert cold < hot  # token 1 (the less likely) is drawn less often when cold


def test_top_k_keeps_k_most_likely():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    _, k, p, m = params(3, top_k=5)
    out = apply_filters(logits, k, p, m)
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [5, 5, 5]
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(-1, logits.topk(5).indices, True))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    _, k, p, m = params(1, top_p=0.7)
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, True, False, False]]
    _, k, p, m = params(1, top_p=0.5)  # the top token alone reaches 0.5
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, False, False, False]]
    _, k, p, m = params(1, top_p=0.01)  # the most likely token always stays
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, False, False, False]]


def test_min_p_and_per_row_settings():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]]))
    t, k, p, m = params(2)
    m[0] = 0.4  # drops tokens under 0.24
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, True, False], [True, True, True]]


def test_sampled_tokens_respect_top_k():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5)).expand(500, V)
    s = Sampler(torch.device("cpu"), seed=1)
    out = s(logits, *params(500, top_k=3), [None] * 500)
    assert set(out.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(out.tolist())) == 3


def host_params(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    full = lambda v, dt: np.full(rows, v, dtype=dt)  # noqa: E731
    return full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32), full(min_p, np.float32)


@interpreted
def test_fused_rows_draw_the_kernels_noise_for_their_seed_and_position():
    pytest.importorskip("triton")
    from nanoplane.kernels.reference import sample_reference
    from nanoplane.kernels.sampling import sampling_uniforms

    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)  # raw, as rank 0's
    s = Sampler(torch.device("cpu"), seed=11, fused=True)
    t, k, p, m = host_params(4)
    t[3] = 0.0
    seeds = np.array([-1, 2**62, -1, 5], dtype=np.int64)
    positions = np.array([7, 30, 7, 2], dtype=np.int32)
    for call in range(2):
        ids = s.sample(logits, t, k, p, m, seeds, positions)
        # Unseeded rows: the shared key (top bit set) and the next draw numbers; seeded: (seed, position).
        keys = torch.tensor([s.shared_key, 2**62, s.shared_key, 5])
        offsets = torch.tensor([4 * call, 30, 4 * call + 2, 2])
        u = sampling_uniforms(keys, offsets, 37)
        assert torch.equal(ids, sample_reference(logits, torch.from_numpy(t), u))
        assert ids[3] == logits[3].argmax()
    assert s.shared_key < 0 and s.draws == 8


def test_fused_streams_never_reuse_an_unseeded_offset():
    s = Sampler(torch.device("cpu"), seed=2**63 + 3, fused=True)
    seeds = np.array([-1, 9, -1], dtype=np.int64)
    first = s.streams(seeds, np.array([5, 6, 7]))
    second = s.streams(seeds, np.array([5, 6, 7]))
    assert first[0].tolist() == second[0].tolist() == [3 - 2**63, 9, 3 - 2**63]
    assert first[1].tolist() == [0, 6, 2] and second[1].tolist() == [3, 6, 5]


@interpreted
def test_fused_filtered_rows_take_the_torch_path():
    pytest.importorskip("triton")
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(8)).expand(6, V)
    s = Sampler(torch.device("cpu"), seed=1, fused=True)
    t, k, p, m = host_params(6)
    k[:3] = 2
    t[5] = 0.0
    seen = set()
    for _ in range(4):
        ids = s.sample(logits, t, k, p, m, np.full(6, -1, dtype=np.int64), np.zeros(6, dtype=np.int32))
        assert set(ids[:3].tolist()) <= set(logits[0].topk(2).indices.tolist())
        assert ids[5] == logits[0].argmax()
        seen |= set(ids[3:5].tolist())
    assert len(seen) > 2  # unfiltered rows draw from the whole vocabulary


@interpreted
def test_fused_sampler_needs_the_positions_of_seeded_rows():
    s = Sampler(torch.device("cpu"), fused=True)
    with pytest.raises(ValueError, match="positions"):
        s(torch.randn(2, V), *params(2), [None, 3])


def test_torch_path_takes_raw_half_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9))
    t, k, p, m = host_params(3, top_k=4)
    t[0] = 0.0
    args = (t, k, p, m, np.full(3, -1, dtype=np.int64), np.zeros(3, dtype=np.int32))
    half = Sampler(torch.device("cpu"), seed=2).sample(logits.to(torch.bfloat16), *args)
    full = Sampler(torch.device("cpu"), seed=2).sample(logits.to(torch.bfloat16).float(), *args)
    assert torch.equal(half, full) and half[0] == logits.to(torch.bfloat16)[0].float().argmax()


@pytest.mark.parametrize("fused", FUSED)
def test_engine_seeded_request_ignores_its_batch(tiny_models, fused):
    """Through rank 0's model runner: the request's seed and token positions reach the sampler."""
    from nanoplane.controlplane import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 250, 8], [40, 41, 42], [7] * 12, [300, 2, 9, 9]]
    seeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=42)
    others = [SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, max_tokens=10, ignore_eos=True, seed=1),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", kvcache_block_size=16)
    try:
        llm.engine.data_plane.runner.sampler.fused = fused
        alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0]["token_ids"]
        batched = llm.generate(prompts, [seeded, *others], use_tqdm=False)
    finally:
        llm.close()
    assert batched[0]["token_ids"] == alone
    assert len(set(alone)) > 3  # it samples


@pytest.mark.parametrize("fused", FUSED)
def test_engine_seeded_request_survives_preemption(tiny_models, fused):
    """A preempted request is recomputed and draws its next positions again: the same tokens, since both paths
    key a seeded row's noise by the position it draws (the torch path once restarted the request's generator)."""
    from nanoplane.controlplane import LLM, SamplingParams

    prompts = [[(7 * i + j) % 380 + 1 for j in range(20 + 4 * i)] for i in range(5)]
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=100 + i) for i in range(5)]
    outs = []
    for blocks in (0, 8):  # 0: sized by memory; 8 blocks of 16 tokens hold 128; the five requests need about 280
        llm = LLM(str(tiny_models["llama-tied"]), device="cpu", kvcache_block_size=16, num_kvcache_blocks=blocks)
        try:
            llm.engine.data_plane.runner.sampler.fused = fused
            outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
            assert (llm.engine.scheduler.num_preemptions > 0) == (blocks > 0)
        finally:
            llm.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fused", FUSED)
def test_engine_seeded_request_ignores_chunking_and_the_prefix_cache(tiny_models, fused):
    """A prompt longer than a step's token budget is prefilled in chunks, each drawing a token that is thrown
    away; run again, most of it comes from the prefix cache and it takes fewer chunks. Same tokens both times."""
    from nanoplane.controlplane import LLM, SamplingParams

    prompt = [(7 * i) % 380 + 1 for i in range(100)]
    seeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1234)
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", kvcache_block_size=16, max_num_batched_tokens=32)
    try:
        llm.engine.data_plane.runner.sampler.fused = fused
        first = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
        assert llm.engine.scheduler.block_manager.num_cache_hits == 0
        again = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
        assert llm.engine.scheduler.block_manager.num_cache_hits >= 4  # of the prompt's six full blocks
    finally:
        llm.close()
    assert again == first and len(set(first)) > 3


@pytest.mark.parametrize("value, fused", [("0", False), ("1", True), ("", None)])
def test_fused_sampler_variable_chooses_the_path(value, fused):
    """NANOPLANE_FUSED_SAMPLER reaches the sampler through the data plane's tuning (ModelRunner)."""
    tuning = read_tuning({"NANOPLANE_FUSED_SAMPLER": value})
    assert tuning.fused_sampler is fused
    assert Sampler(torch.device("cpu"), fused=tuning.fused_sampler).fused is (fused is True)  # unset: not on a CPU


def test_fused_sampler_variable_refuses_other_values():
    with pytest.raises(ValueError, match="NANOPLANE_FUSED_SAMPLER='maybe'"):
        read_tuning({"NANOPLANE_FUSED_SAMPLER": "maybe"})
