"""transformers' float32 reference for the sampling tail: greedy tokens under the logits processors
in the contract's order, raw logprobs, and the check of a PlaneDriver's records against them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from nanoplane.proto.plane import SamplingSpec, int32_column

_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(path) -> torch.nn.Module:
    if str(path) not in _MODELS:
        _MODELS[str(path)] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[str(path)]


@torch.no_grad()
def hf_run(path, prompt: list[int], max_tokens: int, presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0,
           stop_ids=(), bias: dict | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens with the processors in the contract's order, and each step's raw log_softmax."""
    model = hf_model(path)
    ids, out, raw = list(prompt), [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        raw.append(torch.log_softmax(logits, dim=-1))
        x = logits.clone()
        if len(out) < min_tokens:
            x[list(stop_ids)] = float("-inf")
        for t, b in (bias or {}).items():
            x[t] += b
        if repetition != 1.0:
            x = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), x[None])[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
        x = x - frequency * counts - presence * (counts > 0).float()  # OpenAI's definition
        out.append(int(x.argmax()))
        ids.append(out[-1])
    return out, raw


@torch.no_grad()
def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(path)(torch.tensor([prompt]), use_cache=False).logits[0].float(), dim=-1)


def check_logprobs(path, recs, specs: list[SamplingSpec], penalties: list[dict], max_tokens: int,
                   tol: float = 1e-4) -> None:
    """Each record's tokens equal hf_run's under its penalties; its logprobs (sampled, rank, top N,
    padded past N) and prompt logprobs equal log_softmax of transformers' raw float32 logits."""
    for rec, spec, pen in zip(recs, specs, penalties, strict=True):
        tokens, raw = hf_run(path, rec.prompt, max_tokens, **pen)
        assert rec.tokens == tokens
        if spec.logprobs < 0:
            assert not rec.logprobs
        else:
            assert len(rec.logprobs) == max_tokens
            for (lp, rank, top_ids, top_lps), t, ref in zip(rec.logprobs, tokens, raw, strict=True):
                assert abs(lp - float(ref[t])) < tol
                assert rank == 1 + int((ref > ref[t]).sum())
                values, ids = torch.topk(ref, spec.logprobs)
                n = spec.logprobs
                assert set(top_ids[n:]) <= {-1} and set(top_lps[n:]) <= {float("-inf")}  # padding to the step's K
                top_ids, top_lps = top_ids[:n], top_lps[:n]
                assert top_lps == pytest.approx(values.tolist(), abs=tol)
                for got, want, v in zip(top_ids, ids.tolist(), values.tolist(), strict=True):
                    if int((ref - v).abs().lt(1e-6).sum()) == 1:  # ties aside, the same order
                        assert got == want
        if spec.prompt_logprobs < 0:
            assert not rec.prompt_logprobs
            continue
        ref = hf_prompt_logprobs(path, rec.prompt)
        assert sorted(rec.prompt_logprobs) == list(range(1, len(rec.prompt)))
        for pos, (lp, top_ids, top_lps) in rec.prompt_logprobs.items():
            assert abs(lp - float(ref[pos - 1, rec.prompt[pos]])) < tol
            n = spec.prompt_logprobs
            values, ids = torch.topk(ref[pos - 1], n)
            assert set(top_ids[n:]) <= {-1} and set(top_lps[n:]) <= {float("-inf")}
            top_ids, top_lps = top_ids[:n], top_lps[:n]
            assert top_ids == ids.tolist() and top_lps == pytest.approx(values.tolist(), abs=tol)


def logprob_specs():
    """Rows asking different N (padding to the step's largest), one with penalties (logprobs stay the
    raw model's), one asking nothing, one prompt logprobs only."""
    specs = [SamplingSpec(0.0, logprobs=3, prompt_logprobs=2),
             SamplingSpec(0.0, logprobs=0, repetition_penalty=1.5, presence_penalty=1.0),
             SamplingSpec(0.0),
             SamplingSpec(0.0, prompt_logprobs=0),
             SamplingSpec(0.0, logprobs=5, logit_bias_ids=int32_column([9]),
                          logit_bias_values=np.array([2.0], np.float32))]
    penalties = [{}, dict(repetition=1.5, presence=1.0), {}, {}, dict(bias={9: 2.0})]
    return specs, penalties


