"""LLM.generate's result dicts: finish_reason, stop_reason, stop strings and the text options on the
embedded default model; logprobs and prompt logprobs against transformers' float32 log_softmax on a
tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.models.default_model import default_model_dir

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
FIELDS = {"text", "token_ids", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs"}


@pytest.fixture(scope="module")
def smol():
    # The README's first command converts into the default cache; reuse it when it is there.
    cache = os.environ.get("NANOPLANE_CACHE") or str(Path.home() / ".cache" / "nanoplane")
    llm = LLM(str(default_model_dir(cache)), device="cpu")
    prompt = llm.tokenizer.apply_chat_template(QUESTION)
    yield llm, prompt
    llm.close()


def ask(llm: LLM, prompt: str, **params) -> dict:
    out = llm.generate([prompt], SamplingParams(**{"temperature": 0, "max_tokens": 24, **params}), use_tqdm=False)[0]
    assert set(out) == FIELDS
    assert llm.engine.stats()[2] == 0  # every block freed
    return out


def test_eos_length_and_the_fields_of_a_plain_request(smol):
    llm, prompt = smol
    out = ask(llm, prompt)
    assert out["text"] == ANSWER and out["token_ids"][-1] in llm.tokenizer.eos_token_ids
    assert (out["finish_reason"], out["stop_reason"], out["logprobs"], out["prompt_logprobs"]) == \
        ("eos", None, None, None)
    cut = ask(llm, prompt, max_tokens=3)
    assert (cut["finish_reason"], cut["stop_reason"], cut["token_ids"]) == ("length", None, out["token_ids"][:3])


def test_stop_token_id_ends_the_output_and_names_itself(smol):
    llm, prompt = smol
    full = ask(llm, prompt)["token_ids"]
    paris = llm.tokenizer.encode(" Paris")[0]
    k = full.index(paris)
    out = ask(llm, prompt, stop_token_ids=[paris])
    assert (out["finish_reason"], out["stop_reason"], out["token_ids"]) == ("stop", paris, full[:k + 1])
    assert out["text"] == "The capital of France is"  # the stop id's text left out, as vLLM does
    assert ask(llm, prompt, stop_token_ids=[paris], include_stop_str_in_output=True)["text"] == \
        "The capital of France is Paris"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request_at_once(smol, include):
    llm, prompt = smol
    full = ask(llm, prompt)["token_ids"]
    out = ask(llm, prompt, stop=["Spain", "is Pa"], include_stop_str_in_output=include, max_tokens=64)
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", "is Pa")
    assert out["text"] == ("The capital of France is Pa" if include else "The capital of France ")
    # Generation ended with the token that completed the stop string: " Paris" is the last.
    assert out["token_ids"] == full[:full.index(llm.tokenizer.encode(" Paris")[0]) + 1]


def test_special_tokens_in_the_text(smol):
    llm, prompt = smol
    assert ask(llm, prompt, skip_special_tokens=False)["text"] == ANSWER  # the EOS's text is left out ...
    kept = ask(llm, prompt, skip_special_tokens=False, include_stop_str_in_output=True)
    assert kept["text"] == ANSWER + " <|im_end|>"  # ... unless asked for, spaced from the text before it
    tight = ask(llm, prompt, skip_special_tokens=False, include_stop_str_in_output=True,
                spaces_between_special_tokens=False)
    assert tight["text"] == ANSWER + "<|im_end|>"
    assert ask(llm, prompt, include_stop_str_in_output=True)["text"] == ANSWER  # skipped anyway


def test_min_tokens_holds_off_the_end_of_sequence(smol):
    """The data plane masks end-of-sequence before min_tokens; the control plane does not stop on it either."""
    llm, prompt = smol
    answer = ask(llm, prompt)["token_ids"]
    out = ask(llm, prompt, min_tokens=len(answer) + 4, max_tokens=len(answer) + 12)
    eos = set(llm.tokenizer.eos_token_ids)
    assert len(out["token_ids"]) > len(answer) + 4
    assert not eos & set(out["token_ids"][:len(answer) + 4])


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen3"]
    llm = LLM(str(path), device="cpu", kvcache_block_size=16, max_num_batched_tokens=24)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield llm, hf
    llm.close()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0].float(), dim=-1)


def check_entry(entry: dict[int, float], row: torch.Tensor, token: int, n: int) -> None:
    """The top n in order (ties aside), then the position's own token if not among them, to 1e-4."""
    values, ids = row.topk(n)
    keys = list(entry)
    assert len(keys) == n + (token not in ids.tolist())
    for i, (k, v) in enumerate(zip(keys[:n], values.tolist(), strict=True)):
        assert k == ids[i] or abs(row[k].item() - v) < 1e-5, (i, k, int(ids[i]))
    for k, v in entry.items():
        assert abs(v - row[k].item()) < 1e-4, (k, v, row[k].item())
    assert token in entry


@pytest.mark.parametrize("params", [
    dict(temperature=0),
    # Logprobs are the raw distribution's: before temperature and penalties.
    dict(temperature=0.8, seed=7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
])
def test_logprobs_equal_transformers_log_softmax(tiny, params):
    llm, hf = tiny
    prompts = [[5], list(range(10, 27)), [(i * 37) % 300 + 3 for i in range(50)]]  # chunked by the 24-token budget
    outs = llm.generate(prompts, [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=n, prompt_logprobs=m,
                                                 **params) for n, m in [(5, 3), (0, 0), (20, 1)]], use_tqdm=False)
    for prompt, out, (n, m) in zip(prompts, outs, [(5, 3), (0, 0), (20, 1)], strict=True):
        lsm = reference(hf, prompt + out["token_ids"])
        assert len(out["logprobs"]) == len(out["token_ids"]) == 8
        for i, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"], strict=True)):
            check_entry(entry, lsm[len(prompt) - 1 + i], token, n)
        assert len(out["prompt_logprobs"]) == len(prompt) and out["prompt_logprobs"][0] is None
        for p in range(1, len(prompt)):
            check_entry(out["prompt_logprobs"][p], lsm[p - 1], prompt[p], m)


def test_prompt_logprobs_of_a_cached_prompt_are_complete(tiny):
    llm, hf = tiny
    prompt = [(i * 11) % 300 + 3 for i in range(40)]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # now in the prefix cache
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    lsm = reference(hf, prompt)
    assert len(out["prompt_logprobs"]) == len(prompt)
    for p in range(1, len(prompt)):
        check_entry(out["prompt_logprobs"][p], lsm[p - 1], prompt[p], 2)
