"""The logits processors of the sampling tail, with the per-request state they keep on the device.

Order (proto.plane.SamplingSpec): token bitmask, min_tokens mask, logit bias, repetition penalty,
frequency and presence penalties; then the sampler's temperature and filters. Each runs in place
on the rows of a step's logits that need it, so a row without processors is never touched, and a
step without any such row does not come here at all (ModelRunner keeps today's path for it).

Launches per step, whatever the batch: one upload of the step's indices, the bitmask kernel, one
index_put for the min_tokens masks, one for the biases, the penalties kernel, and after sampling
one index_put that counts the sampled tokens. The bitmask and penalties are Triton kernels on the
fused path (a GPU), the same rules in torch otherwise.

Penalty state lives on rank 0 only (the rank that samples), for the slots whose request has a
penalty: its output-token counts (int32) and its prompt's token set (uint8), one row each of
vocabulary width in pools that grow by POOL_GROWTH rows when a penalised request comes and none
is free, so a server whose requests use no penalty spends nothing on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanoplane.dataplane.batch_state import BatchState
from nanoplane.kernels import reference
from nanoplane.proto.plane import NewRequest

POOL_GROWTH = 16  # rows the penalty pools grow by (Qwen3: 16 x 151,936 x 5 bytes = 12 MB)


class PenaltyState:
    """Per penalised slot: its output tokens' counts and its prompt's tokens, on the device."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.vocab, self.device = vocab_size, device
        self.row_of = np.full(num_slots, -1, dtype=np.int64)  # slot -> pool row, -1: none
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.uint8, device=device)
        self.free: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * 4 + self.seen.numel()

    def release(self, slots: np.ndarray) -> None:
        for slot in slots.tolist():
            if self.row_of[slot] >= 0:
                self.free.append(int(self.row_of[slot]))
                self.row_of[slot] = -1

    def admit(self, requests: list[NewRequest], state: BatchState, upload: Callable) -> None:
        """Rebuild the counts of the admitted penalised requests from their token ids (a preempted
        request comes back with its output so far): one upload and three writes for all of them."""
        rows, seen_rows, seen_ids, count_rows, count_ids = [], [], [], [], []
        for req in requests:
            slot = req.slot
            if not state.penalised[slot]:
                continue
            row = self.row_of[slot] = self._take()
            prompt, ids = int(state.num_prompt[slot]), np.asarray(req.token_ids, dtype=np.int64)
            rows.append(row)
            if state.repetition[slot] != 1.0:  # only the repetition penalty looks at the prompt
                seen_rows.append(np.full(prompt, row, np.int64))
                seen_ids.append(ids[:prompt])
            count_rows.append(np.full(len(ids) - prompt, row, np.int64))
            count_ids.append(ids[prompt:])
        if not rows:
            return
        cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
        rows_t, seen_rows_t, seen_ids_t, count_rows_t, count_ids_t = upload(
            np.array(rows, np.int64), cat(seen_rows), cat(seen_ids), cat(count_rows), cat(count_ids))
        self.counts[rows_t] = 0
        self.seen[rows_t] = 0
        self.seen[seen_rows_t, seen_ids_t] = 1
        self.counts.index_put_((count_rows_t, count_ids_t), torch.ones_like(count_ids_t, dtype=torch.int32),
                               accumulate=True)

    def _take(self) -> int:
        if not self.free:
            old = self.counts.shape[0]
            self.counts = torch.cat([self.counts, self.counts.new_zeros(POOL_GROWTH, self.vocab)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(POOL_GROWTH, self.vocab)])
            self.free = list(range(old + POOL_GROWTH - 1, old - 1, -1))
        return self.free.pop()


@dataclass(slots=True)
class ProcessorPlan:
    """What one step's processors do, in host arrays (row indices into the step's logits)."""

    bitmask_rows: np.ndarray  # int64 [M]
    bitmask: np.ndarray  # int32 [M, W]
    mask_rows: np.ndarray  # int64: (row, token) pairs set to -inf (min_tokens)
    mask_ids: np.ndarray
    bias_rows: np.ndarray  # int64: (row, token, value) triples added (logit bias)
    bias_ids: np.ndarray
    bias_values: np.ndarray  # float32
    penalty_rows: np.ndarray  # int64 [P]
    penalty_state: np.ndarray  # int64 [P]: their pool rows
    repetition: np.ndarray  # float32 [P]
    frequency: np.ndarray
    presence: np.ndarray
    count_rows: np.ndarray  # int64 [C]: output rows whose sampled token is counted after sampling
    count_state: np.ndarray  # int64 [C]

    @property
    def rows(self) -> np.ndarray:
        """Every row whose logits the plan changes."""
        return np.unique(np.concatenate([self.bitmask_rows, self.mask_rows, self.bias_rows, self.penalty_rows]))


def plan_processors(state: BatchState, penalties: PenaltyState | None, slots: np.ndarray, output: np.ndarray,
                    bitmask_rows: np.ndarray, bitmask: np.ndarray) -> ProcessorPlan:
    """The step's processors: on the output rows (those whose sampled token is kept), plus the bitmask rows."""
    made = state.num_known[slots] - state.num_prompt[slots]  # output tokens before the one drawn now
    sparse = output & state.processes[slots] & ((made < state.min_tokens[slots]) | state.has_bias[slots])
    mask_rows, mask_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
    for r in np.flatnonzero(sparse).tolist():  # rows with a bias, or still short of min_tokens
        slot = slots[r]
        if made[r] < state.min_tokens[slot] and len(state.stop_ids[slot]):
            mask_ids.append(state.stop_ids[slot])
            mask_rows.append(np.full(len(mask_ids[-1]), r, np.int64))
        ids, values = state.bias[slot]
        if len(ids):
            bias_ids.append(ids)
            bias_values.append(values)
            bias_rows.append(np.full(len(ids), r, np.int64))
    pen = np.flatnonzero(output & state.penalised[slots]) if penalties is not None else np.zeros(0, np.int64)
    pen_slots = slots[pen]
    state_rows = penalties.row_of[pen_slots] if penalties is not None else np.zeros(0, np.int64)
    i64 = (lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))
    return ProcessorPlan(
        bitmask_rows=bitmask_rows.astype(np.int64), bitmask=np.ascontiguousarray(bitmask, dtype=np.int32),
        mask_rows=i64(mask_rows), mask_ids=i64(mask_ids), bias_rows=i64(bias_rows), bias_ids=i64(bias_ids),
        bias_values=np.concatenate(bias_values).astype(np.float32) if bias_values else np.zeros(0, np.float32),
        penalty_rows=pen.astype(np.int64), penalty_state=state_rows.astype(np.int64),
        repetition=state.repetition[pen_slots], frequency=state.frequency[pen_slots],
        presence=state.presence[pen_slots], count_rows=pen.astype(np.int64), count_state=state_rows.astype(np.int64))


_UPLOADED = ("bitmask_rows", "bitmask", "mask_rows", "mask_ids", "bias_rows", "bias_ids", "bias_values",
             "penalty_rows", "penalty_state", "repetition", "frequency", "presence", "count_rows", "count_state")


def plan_arrays(plan: ProcessorPlan) -> list[np.ndarray]:
    """The plan's host arrays in the order `apply_processors` takes them uploaded."""
    return [getattr(plan, name) for name in _UPLOADED]


def apply_processors(plan: ProcessorPlan, uploaded: list[torch.Tensor], logits: torch.Tensor,
                     penalties: PenaltyState | None, fused: bool) -> None:
    """Run the plan's processors in place on logits [R, V] (rank 0), in the contract's order;
    `uploaded`: plan_arrays(plan) on the device."""
    t = dict(zip(_UPLOADED, uploaded[:len(_UPLOADED)], strict=True))
    if fused:
        from nanoplane import kernels as ops
    else:
        ops = None
    if len(plan.bitmask_rows):
        (ops.apply_bitmask if ops else reference.apply_bitmask_ref)(logits, t["bitmask_rows"], t["bitmask"])
    if len(plan.mask_rows):
        logits[t["mask_rows"], t["mask_ids"]] = float("-inf")
    if len(plan.bias_rows):
        logits.index_put_((t["bias_rows"], t["bias_ids"]), t["bias_values"].to(logits.dtype), accumulate=True)
    if len(plan.penalty_rows):
        (ops.apply_penalties if ops else reference.apply_penalties_ref)(
            logits, t["penalty_rows"], t["penalty_state"], penalties.counts, penalties.seen, t["repetition"],
            t["frequency"], t["presence"])


def count_sampled(plan: ProcessorPlan, uploaded: list[torch.Tensor], sampled: torch.Tensor,
                  penalties: PenaltyState | None) -> None:
    """Add each penalised output row's sampled token to its request's counts, on the device."""
    if penalties is None or not len(plan.count_rows):
        return
    t = dict(zip(_UPLOADED, uploaded[:len(_UPLOADED)], strict=True))
    # Each pool row appears once a step: a plain += adds one per (row, token).
    penalties.counts[t["count_state"], sampled[t["count_rows"]].long()] += 1
