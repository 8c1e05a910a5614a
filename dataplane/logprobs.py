"""Logprobs on the device: of the sampled tokens, and of the prompt tokens a chunk computes.

Both come from log_softmax of the raw logits (before any processor and the temperature: vLLM's
default), taken in fp32 by one pass over each row (kernels.logprob_stats: its log-sum-exp, the
target's logprob and rank) and torch.topk for the top N. Only those small arrays go to the host,
copied asynchronously into pinned memory like the sampled ids; never a row of the vocabulary.

Prompt logprobs need the logits at every position of a chunk, not just the last: the LM head runs
over the chunk's hidden states PROMPT_CHUNK positions at a time, so a 32k-token prompt never holds
32k rows of vocabulary at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanoplane.dataplane.batch_state import BatchState
from nanoplane.kernels import reference
from nanoplane.proto.plane import StepResult, int32_column

PROMPT_CHUNK = 256  # positions whose logits exist at once (Qwen3: 256 x 151,936 bf16, as a full decode batch)


def _stats(fused: bool) -> Callable:
    if fused:
        from nanoplane import kernels

        return kernels.logprob_stats
    return reference.logprob_stats_ref


@dataclass(slots=True)
class LogprobPlan:
    rows: np.ndarray  # int64 [L]: output rows whose request asked for logprobs
    num: np.ndarray  # int32 [L]: N of each
    k: int  # the largest N


def plan_logprobs(state: BatchState, slots: np.ndarray, output: np.ndarray) -> LogprobPlan | None:
    rows = np.flatnonzero(output & (state.logprobs[slots] >= 0))
    if not len(rows):
        return None
    num = state.logprobs[slots[rows]]
    return LogprobPlan(rows.astype(np.int64), num, int(num.max()))


def sampled_logprobs(plan: LogprobPlan, rows_t: torch.Tensor, logits: torch.Tensor, sampled: torch.Tensor,
                     fused: bool, raw: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Device tensors of the plan's rows (`rows_t`: plan.rows on the device): the sampled token's
    logprob and rank, the top K. `raw`: the rows' logits copied before processors changed them
    (else `logits` still holds them)."""
    targets = sampled[rows_t]
    if raw is None:
        source, index = logits, rows_t
    else:
        source, index = raw, torch.arange(len(plan.rows), device=raw.device)
    lse, target_lp, rank = _stats(fused)(source, index, targets)
    out = {"sampled_logprobs": target_lp, "sampled_ranks": rank}
    _top(out, "top", source if raw is not None or len(plan.rows) == logits.shape[0] else source[index], lse, plan.k)
    return out


def _top(out: dict, prefix: str, rows: torch.Tensor, lse: torch.Tensor, k: int) -> None:
    if k:
        values, ids = torch.topk(rows, k, dim=-1)
        out[f"{prefix}_ids"] = ids.to(torch.int32)
        out[f"{prefix}_logprobs"] = values.float() - lse[:, None]
    else:
        out[f"{prefix}_ids"] = torch.zeros(rows.shape[0], 0, dtype=torch.int32, device=rows.device)
        out[f"{prefix}_logprobs"] = torch.zeros(rows.shape[0], 0, dtype=torch.float32, device=rows.device)


@dataclass(slots=True)
class PromptPlan:
    rows: np.ndarray  # int32 [P]: rows whose chunk gives prompt tokens
    starts: np.ndarray  # int32 [P]: the first prompt position each gives
    offsets: np.ndarray  # int32 [P + 1]: CSR over the T tokens
    hidden_index: np.ndarray  # int64 [T]: the hidden state (token of the step) whose logits give token t
    target_slot: np.ndarray  # int64 [T]: where the token itself is, in the token buffer
    target_pos: np.ndarray  # int64 [T]
    num: np.ndarray  # int32 [T]: N of the token's request
    k: int


def plan_prompt_logprobs(state: BatchState, slots: np.ndarray, computed: np.ndarray, scheduled: np.ndarray,
                         cu: np.ndarray) -> PromptPlan | None:
    """The prompt tokens this step's chunks give: a chunk computing positions c .. c + s - 1 gives
    tokens c + 1 .. min(c + s, prompt - 1) (the logits at position p are token p + 1's)."""
    want = np.flatnonzero(state.prompt_logprobs[slots] >= 0)
    if not len(want):
        return None
    first = computed[want] + 1
    last = np.minimum(computed[want] + scheduled[want], state.num_prompt[slots[want]] - 1)
    some = last >= first
    if not some.any():
        return None
    rows, first, last = want[some], first[some], last[some]
    counts = (last - first + 1).astype(np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
    positions = np.repeat(first.astype(np.int64), counts) + within  # the prompt token's position
    hidden_index = np.repeat(cu[rows].astype(np.int64) - computed[rows], counts) + positions - 1
    num = np.repeat(state.prompt_logprobs[slots[rows]], counts)
    return PromptPlan(int32_column(rows), int32_column(first), int32_column(offsets), hidden_index,
                      np.repeat(slots[rows].astype(np.int64), counts), positions, num, int(num.max()))


def prompt_logprobs(plan: PromptPlan, hidden: torch.Tensor, compute_logits: Callable, token_buf: torch.Tensor,
                    upload: Callable, fused: bool) -> dict[str, torch.Tensor] | None:
    """The prompt tokens' logprobs and top K on the device (None on ranks other than 0, which
    still run the LM head: under tensor parallelism it gathers over every rank)."""
    index_t, slot_t, pos_t = upload(plan.hidden_index, plan.target_slot, plan.target_pos)
    targets = token_buf[slot_t, pos_t]
    parts: list[dict[str, torch.Tensor]] = []
    for i in range(0, len(plan.hidden_index), PROMPT_CHUNK):
        logits = compute_logits(hidden[index_t[i:i + PROMPT_CHUNK]])
        if logits is None:
            continue
        every = torch.arange(logits.shape[0], device=logits.device)
        lse, target_lp, _ = _stats(fused)(logits, every, targets[i:i + PROMPT_CHUNK])
        part = {"prompt_token_logprobs": target_lp}
        _top(part, "prompt_top", logits, lse, plan.k)
        parts.append(part)
    if not parts:
        return None
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


class HostArrays:
    """Device tensors on their way to the host: pinned buffers copied into asynchronously (CUDA),
    read once the step's event has fired."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        if tensors and next(iter(tensors.values())).is_cuda:
            self.host = {}
            for name, t in tensors.items():
                self.host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.host[name].copy_(t, non_blocking=True)
        else:
            self.host = dict(tensors)

    def numpy(self, name: str) -> np.ndarray:
        return self.host[name].numpy().copy()


def fill_result(result: StepResult, lp_plan: LogprobPlan | None, prompt_plan: PromptPlan | None,
                host: HostArrays) -> None:
    """Put the copied arrays into the result, with the columns past each row's N padded (id -1, -inf)."""
    if lp_plan is not None and "sampled_logprobs" in host.host:
        result.logprob_rows = int32_column(lp_plan.rows)
        result.sampled_logprobs = host.numpy("sampled_logprobs")
        result.sampled_ranks = host.numpy("sampled_ranks")
        result.top_ids, result.top_logprobs = _padded(host, "top", lp_plan.num)
    if prompt_plan is not None and "prompt_token_logprobs" in host.host:
        result.prompt_rows, result.prompt_starts = prompt_plan.rows, prompt_plan.starts
        result.prompt_offsets = prompt_plan.offsets
        result.prompt_token_logprobs = host.numpy("prompt_token_logprobs")
        result.prompt_top_ids, result.prompt_top_logprobs = _padded(host, "prompt_top", prompt_plan.num)


def _padded(host: HostArrays, prefix: str, num: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids, values = host.numpy(f"{prefix}_ids"), host.numpy(f"{prefix}_logprobs")
    beyond = np.arange(ids.shape[1])[None, :] >= num[:, None]
    ids[beyond] = -1
    values[beyond] = -np.inf
    return ids, values
