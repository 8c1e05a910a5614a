"""What a step does around its sampler beyond drawing: logits processors, logprobs, prompt logprobs.

ModelRunner asks `plan` first; None (no row of the step has a processor, a bitmask, logprobs or
prompt logprobs owed) means the step runs exactly as it would without this module. Otherwise, on
rank 0, `before` runs on the logits just before the sampler (after the decode graph's replay,
before its sampling-tail graph) and `after` right after it:

    raw logits --(logprob rows that processors change: copied)--> bitmask, min_tokens, bias,
    repetition, frequency + presence (in place) --> sampler --> counts += sampled token,
    logprobs of the raw logits --> small arrays copied to pinned host memory

Every rank plans alike (the plan only reads host state every rank holds), so a tensor-parallel step
with a plan takes the gather path on all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoplane.dataplane.batch_state import BatchState, StepRefused
from nanoplane.dataplane.logits_processing import (
    PenaltyState,
    ProcessorPlan,
    apply_processors,
    count_sampled,
    plan_arrays,
    plan_processors,
)
from nanoplane.dataplane.logprobs import (
    HostArrays,
    LogprobPlan,
    PromptPlan,
    plan_logprobs,
    plan_prompt_logprobs,
    prompt_logprobs,
    sampled_logprobs,
)
from nanoplane.proto.plane import StepDescriptor


@dataclass(slots=True)
class TailStep:
    processors: ProcessorPlan | None
    logprobs: LogprobPlan | None
    prompt: PromptPlan | None
    samples: bool  # the sampler's logits are involved (processors or logprobs): whole rows on rank 0
    logits: torch.Tensor | None = None  # the logits `before` processed
    raw: torch.Tensor | None = None  # the logprob rows' logits from before the processors, where they changed
    uploaded: list[torch.Tensor] = field(default_factory=list)  # the plans' index arrays on the device
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # device arrays for the result (rank 0)
    host: HostArrays | None = None  # `out` on its way to the host


class SamplingTail:
    def __init__(self, state: BatchState, vocab_size: int, device: torch.device, upload: Callable, rank: int,
                 fused: bool):
        self.state, self.upload, self.rank, self.fused = state, upload, rank, fused
        # Only rank 0 samples, so only it keeps the penalties' counts.
        self.penalties = PenaltyState(state.num_slots, vocab_size, device) if rank == 0 else None

    def warmup(self, vocab_size: int, dtype: torch.dtype) -> None:
        """Compile the tail's kernels now (rank 0 on a GPU), not in the first step that needs them."""
        if self.rank != 0 or not self.fused or self.penalties.device.type != "cuda":
            return
        from nanoplane import kernels

        device = self.penalties.device
        logits = torch.zeros(2, vocab_size, dtype=dtype, device=device)
        rows = torch.arange(2, device=device)
        kernels.apply_bitmask(logits, rows, torch.full((2, -(-vocab_size // 32)), -1, dtype=torch.int32,
                                                       device=device))
        pool = torch.zeros(2, vocab_size, dtype=torch.int32, device=device)
        ones = torch.ones(2, device=device)
        kernels.apply_penalties(logits, rows, rows, pool, pool.to(torch.uint8), ones, ones, ones)
        for targets in (rows, rows.to(torch.int32)):  # sampled ids come as int64 (eager) or int32 (graphs)
            kernels.logprob_stats(logits, rows, targets)
        torch.cuda.synchronize(device)

    def admit(self, desc: StepDescriptor) -> None:
        """After BatchState.apply: free the ended requests' penalty rows, build the admitted ones'."""
        if self.penalties is not None:
            self.penalties.release(desc.free_slots)
            if desc.new_requests:
                self.penalties.admit(desc.new_requests, self.state, self.upload)

    @staticmethod
    def check(desc: StepDescriptor, num_kv_blocks: int) -> None:
        """Refuse a descriptor whose block copies or bitmask do not fit (before any state changes)."""
        src, dst = desc.copy_src, desc.copy_dst
        if len(src) != len(dst):
            raise StepRefused(f"{len(src)} copy sources but {len(dst)} copy destinations")
        for ids in (src, dst):
            if len(ids) and (ids.min() < 0 or ids.max() >= num_kv_blocks):
                raise StepRefused(f"a block copy names a block outside the cache of {num_kv_blocks}")
        rows, mask = desc.bitmask_rows, desc.bitmask
        if mask.ndim != 2 or mask.shape[0] != len(rows):
            raise StepRefused(f"bitmask of shape {mask.shape} for {len(rows)} rows")
        if len(rows) and (rows.min() < 0 or rows.max() >= desc.num_rows or (np.diff(rows) <= 0).any()):
            raise StepRefused("bitmask rows must be ascending row indices of the step")

    def plan(self, desc: StepDescriptor, slots: np.ndarray, output: np.ndarray, computed: np.ndarray,
             scheduled: np.ndarray, cu: np.ndarray) -> TailStep | None:
        """`output`: the rows whose sampled token is kept (they computed every token their slot holds)."""
        st = self.state
        if not len(desc.bitmask_rows) and not st.tail[slots].any():  # the common step: one lookup
            return None
        prompt = plan_prompt_logprobs(st, slots, computed, scheduled, cu)
        processes = bool(len(desc.bitmask_rows)) or bool((output & st.processes[slots]).any())
        samples = processes or bool((output & (st.logprobs[slots] >= 0)).any())
        if not samples and prompt is None:
            return None
        if self.rank != 0:  # another rank only needs to know that rank 0 wants whole rows
            return TailStep(None, None, prompt, samples)
        processors = plan_processors(st, self.penalties, slots, output, desc.bitmask_rows, desc.bitmask) \
            if processes else None
        return TailStep(processors, plan_logprobs(st, slots, output), prompt, samples)

    def prompt_logprobs(self, step: TailStep, hidden: torch.Tensor, compute_logits: Callable,
                        token_buf: torch.Tensor) -> None:
        out = prompt_logprobs(step.prompt, hidden, compute_logits, token_buf, self.upload, self.fused)
        if out is not None:
            step.out.update(out)

    def before(self, step: TailStep, logits: torch.Tensor) -> None:
        """Rank 0, on the logits the sampler is about to read: keep what logprobs need, then process.
        One upload carries every index the step's processors and logprobs use."""
        step.logits = logits
        arrays = plan_arrays(step.processors) if step.processors is not None else []
        if step.logprobs is not None:
            arrays.append(step.logprobs.rows)
        step.uploaded = self.upload(*arrays)
        if step.processors is None:
            return
        if step.logprobs is not None and np.isin(step.logprobs.rows, step.processors.rows).any():
            step.raw = logits[step.uploaded[-1]]  # a copy (advanced indexing) of the raw rows
        apply_processors(step.processors, step.uploaded, logits, self.penalties, self.fused)

    def after(self, step: TailStep, sampled: torch.Tensor) -> None:
        """Rank 0, with the step's sampled ids [R]: count them, and the logprobs of the raw logits."""
        if step.processors is not None:
            count_sampled(step.processors, step.uploaded, sampled, self.penalties)
        if step.logprobs is not None:
            step.out.update(sampled_logprobs(step.logprobs, step.uploaded[-1], step.logits, sampled, self.fused,
                                             raw=step.raw))
        step.logits = step.raw = None
        step.uploaded = []
