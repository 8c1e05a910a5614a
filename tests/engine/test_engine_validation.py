"""Bad input raises ValueError with a message a person understands, and harms no other request."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from nanoplane.controlplane import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop_token_ids": [-4]}, "stop_token_ids"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_models):
    engine = LLM(str(tiny_models["qwen3"]), device="cpu", max_model_len=256)
    yield engine
    engine.close()


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    ("", SamplingParams(), "empty"),
    ([1, 2, 10_000], SamplingParams(), r"token 2 is 10000.*\[0, 384\)"),
    ([1, -1], SamplingParams(), "token 1 is -1"),
    ([1, "2"], SamplingParams(), "token 1"),
    ([1] * 250, SamplingParams(max_tokens=10), "max_model_len 256"),
    (12, SamplingParams(), "string or a list"),
])
def test_bad_prompts_raise_and_leave_others_untouched(llm, tiny_models, prompt, params, match):
    good = [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # A request already queued on the engine survives the bad call.
    queued = llm.engine.add_request(good, greedy)
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], [greedy, params], use_tqdm=False)
    assert llm.engine.scheduler.waiting[-1] is queued and len(llm.engine.scheduler.waiting) == 1
    while llm.engine.has_work():
        llm.engine.step()
    expected = hf_greedy(tiny_models["qwen3"], good, 6)
    assert queued.completion_token_ids == expected
    assert llm.generate([good], greedy, use_tqdm=False)[0]["token_ids"] == expected


def test_bad_prompt_behind_the_first_step(tiny_models):
    """Prompts past what the first step takes are checked while it runs: a bad one there still raises,
    leaves none of the call's requests queued, and the engine serves the next call exactly."""
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", max_model_len=256, max_num_batched_tokens=64)
    try:
        assert llm.engine.overlap
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        good = [[7 + i] * 40 for i in range(3)]  # 120 tokens: the first step takes only the first two
        with pytest.raises(ValueError, match="prompt 3: prompt token 1 is -1"):
            llm.generate(good + [[1, -1]], greedy, use_tqdm=False)
        assert llm.engine.step_id == 1  # the first step was sent before prompt 3 was checked
        assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
        outs = llm.generate(good, greedy, use_tqdm=False)
        assert not llm.engine.has_work()
        for prompt, out in zip(good, outs, strict=True):
            assert out["token_ids"] == hf_greedy(tiny_models["qwen3"], prompt, 4)
    finally:
        llm.close()


def test_a_tiny_positive_temperature_is_greedy(llm, tiny_models):
    # Dividing the logits by 1e-30 overflows float32: the sampler would see NaN probabilities and
    # return token 0 every step. Below 1e-5 the engine samples greedily instead.
    assert SamplingParams(temperature=1e-30).to_spec().temperature == 0.0
    assert SamplingParams(temperature=1e-5).to_spec().temperature == pytest.approx(1e-5)
    good = [5, 6, 7, 8]
    tiny = llm.generate([good], SamplingParams(temperature=1e-30, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert tiny[0]["token_ids"] == hf_greedy(tiny_models["qwen3"], good, 6)


def test_kv_cache_smaller_than_one_request(tiny_models):
    llm = LLM(str(tiny_models["qwen3"]), device="cpu", num_kvcache_blocks=2, kvcache_block_size=16)
    try:
        with pytest.raises(ValueError, match=r"KV cache holds \(32 tokens\)"):
            llm.generate([[1] * 30], SamplingParams(max_tokens=5), use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"kvcache_block_size": 24}, "power of two"),
    ({"kvcache_block_size": 8}, "power of two"),
    ({"dtype": "int8"}, "dtype"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"device": "tpu"}, "device"),
])
def test_bad_engine_options(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_models["qwen3"]), **{"device": "cpu", **kwargs})


def test_missing_model_and_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
