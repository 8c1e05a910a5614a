"""Per-request state a data-plane rank keeps between steps, one slot per running request.

Descriptors only carry deltas, so this is where a request's tokens, block table and sampling
parameters live. Tokens sit in a device buffer: a decode step's input is the token sampled last step,
read on the device, so the control plane never sends it back.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoplane.proto.plane import NewRequest, StepDescriptor


class StepRefused(Exception):
    """The descriptor does not fit this rank's state (lost, repeated or corrupt); nothing was run."""


class BatchState:
    def __init__(self, num_slots: int, max_model_len: int, block_size: int, device: torch.device,
                 vocab_size: int | None = None):
        self.num_slots, self.max_model_len, self.block_size = num_slots, max_model_len, block_size
        self.vocab_size = vocab_size  # token ids a request's processors name must be below it (None: unchecked)
        self.max_blocks = -(-max_model_len // block_size)
        # One spare row and column: CUDA-graph padding rows read the spare row and write every
        # sampled token nobody needs (padding, a request at max_model_len) to the spare column.
        self.token_buf = torch.zeros(num_slots + 1, max_model_len + 1, dtype=torch.int64, device=device)
        self.block_tables = np.zeros((num_slots, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(num_slots, dtype=np.int32)
        self.num_known = np.zeros(num_slots, dtype=np.int32)  # tokens this slot holds
        self.num_computed = np.full(num_slots, -1, dtype=np.int32)  # -1 marks a free slot
        self.temperature = np.zeros(num_slots, dtype=np.float32)
        self.top_k = np.zeros(num_slots, dtype=np.int32)
        self.top_p = np.ones(num_slots, dtype=np.float32)
        self.min_p = np.zeros(num_slots, dtype=np.float32)
        self.seeds = np.full(num_slots, -1, dtype=np.int64)  # a request's sampling seed, -1 for none
        # The logits processors and logprobs of each slot's request (proto.plane.SamplingSpec).
        self.num_prompt = np.zeros(num_slots, dtype=np.int32)  # tokens of the slot's token ids that are its prompt
        self.presence = np.zeros(num_slots, dtype=np.float32)
        self.frequency = np.zeros(num_slots, dtype=np.float32)
        self.repetition = np.ones(num_slots, dtype=np.float32)
        self.min_tokens = np.zeros(num_slots, dtype=np.int32)
        self.logprobs = np.full(num_slots, -1, dtype=np.int32)
        self.prompt_logprobs = np.full(num_slots, -1, dtype=np.int32)
        self.processes = np.zeros(num_slots, dtype=bool)  # SamplingSpec.processes_logits
        self.penalised = np.zeros(num_slots, dtype=bool)  # some penalty: output counts kept on the device
        self.has_bias = np.zeros(num_slots, dtype=bool)
        self.tail = np.zeros(num_slots, dtype=bool)  # any of the above or logprobs: the step's sampling tail has work
        self.stop_ids: list[np.ndarray] = [np.zeros(0, np.int32)] * num_slots
        self.bias: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.int32), np.zeros(0, np.float32))] * num_slots

    def apply(self, desc: StepDescriptor, upload=None) -> None:
        """Bring the slots up to date with a descriptor; raise StepRefused if it does not fit.
        `upload(*arrays)` (dataplane.uploader) carries the admitted prompts to the device."""
        for slot in desc.free_slots.tolist():
            self._check_slot(slot)
            self.num_computed[slot] = -1
        admitted: list[tuple[int, np.ndarray]] = []
        try:
            for req in desc.new_requests:
                self._admit(req)
                admitted.append((req.slot, req.token_ids))
        finally:
            self._store_prompts(admitted, upload)
        slots, computed, scheduled = desc.slots, desc.num_computed, desc.num_scheduled
        if not (len(computed) == len(scheduled) == len(slots) == len(desc.appended_offsets) - 1):
            raise StepRefused("descriptor columns have different lengths")
        if len(slots) and ((slots < 0).any() or (slots >= self.num_slots).any()):
            raise StepRefused("descriptor names a slot outside the batch")
        if len(np.unique(slots)) != len(slots):
            raise StepRefused("descriptor schedules a slot twice")
        if (self.num_computed[slots] != computed).any():
            bad = int(np.flatnonzero(self.num_computed[slots] != computed)[0])
            raise StepRefused(f"slot {int(slots[bad])} has {int(self.num_computed[slots[bad]])} computed tokens, "
                              f"the descriptor says {int(computed[bad])}: a step was lost or repeated")
        if (scheduled < 1).any() or (computed + scheduled > self.num_known[slots]).any():
            raise StepRefused("descriptor schedules tokens this rank does not hold")
        offsets, appended = desc.appended_offsets, desc.appended_block_ids
        for r in np.flatnonzero(offsets[1:] != offsets[:-1]).tolist():
            slot, new = int(slots[r]), appended[offsets[r]:offsets[r + 1]]
            start = self.num_blocks[slot]
            if start + len(new) > self.max_blocks:
                raise StepRefused(f"slot {slot} would hold more blocks than max_model_len allows")
            self.block_tables[slot, start:start + len(new)] = new
            self.num_blocks[slot] = start + len(new)
        needed = -(-(computed + scheduled) // self.block_size)
        if (needed > self.num_blocks[slots]).any():
            raise StepRefused("descriptor computes tokens beyond a request's block table")

    def _store_prompts(self, admitted: list[tuple[int, np.ndarray]], upload) -> None:
        """Write the admitted prompts into the token buffer: one upload for all of them. A plain
        `.to(device)` a prompt would wait for the step running on the GPU (a blocking copy syncs
        the stream), and the host could not prepare this step meanwhile."""
        if not admitted:
            return
        rows = np.repeat(np.array([slot for slot, _ in admitted], dtype=np.int64),
                         [len(ids) for _, ids in admitted])
        cols = np.concatenate([np.arange(len(ids), dtype=np.int64) for _, ids in admitted])
        values = np.concatenate([ids for _, ids in admitted]).astype(np.int64)
        if upload is None:
            rows_t, cols_t, values_t = (torch.from_numpy(a).to(self.token_buf.device) for a in (rows, cols, values))
        else:
            rows_t, cols_t, values_t = upload(rows, cols, values)
        self.token_buf[rows_t, cols_t] = values_t

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise StepRefused(f"slot {slot} is outside the batch of {self.num_slots}")

    def _admit(self, req: NewRequest) -> None:
        slot, n, nb = req.slot, len(req.token_ids), len(req.block_ids)
        self._check_slot(slot)
        if self.num_computed[slot] != -1:
            raise StepRefused(f"slot {slot} is still in use by another request")
        if not 0 < n <= self.max_model_len or nb > self.max_blocks:
            raise StepRefused(f"request {req.request_id} does not fit max_model_len {self.max_model_len}")
        self.num_known[slot] = n
        self.block_tables[slot, :nb] = req.block_ids
        self.num_blocks[slot] = nb
        if not 0 <= req.num_cached_tokens < n or req.num_cached_tokens > nb * self.block_size:
            raise StepRefused(f"request {req.request_id} claims {req.num_cached_tokens} cached tokens of {n}")
        self.num_computed[slot] = req.num_cached_tokens
        s = req.sampling
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = (
            s.temperature, s.top_k, s.top_p, s.min_p)
        self.seeds[slot] = s.seed if s.seed is not None else -1
        self._admit_processors(req, n)

    def _admit_processors(self, req: NewRequest, n: int) -> None:
        slot, s = req.slot, req.sampling
        prompt = n if req.num_prompt_tokens == -1 else req.num_prompt_tokens
        if not 0 < prompt <= n:
            raise StepRefused(f"request {req.request_id} has {req.num_prompt_tokens} prompt tokens of {n}")
        stop_ids, bias_ids = np.asarray(s.stop_ids, np.int32), np.asarray(s.logit_bias_ids, np.int32)
        bias_values = np.asarray(s.logit_bias_values, np.float32)
        if len(bias_ids) != len(bias_values) or len(np.unique(bias_ids)) != len(bias_ids):
            raise StepRefused(f"request {req.request_id}: logit bias ids and values do not pair up once each")
        vocab = self.vocab_size
        for name, ids in (("stop", stop_ids), ("logit bias", bias_ids)):
            if len(ids) and (ids.min() < 0 or (vocab is not None and ids.max() >= vocab)):
                raise StepRefused(f"request {req.request_id} has a {name} id outside the vocabulary")
        if not (np.isfinite(bias_values).all() and s.repetition_penalty > 0 and s.min_tokens >= 0
                and np.isfinite([s.presence_penalty, s.frequency_penalty, s.repetition_penalty]).all()):
            raise StepRefused(f"request {req.request_id} has a penalty or bias out of range")
        for name, k in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs)):
            if not -1 <= k <= (vocab if vocab is not None else k):
                raise StepRefused(f"request {req.request_id} asks {name}={k}, more than the vocabulary")
        self.num_prompt[slot] = prompt
        self.presence[slot], self.frequency[slot], self.repetition[slot] = (
            s.presence_penalty, s.frequency_penalty, s.repetition_penalty)
        self.min_tokens[slot] = s.min_tokens
        self.logprobs[slot], self.prompt_logprobs[slot] = s.logprobs, s.prompt_logprobs
        self.stop_ids[slot], self.bias[slot] = stop_ids, (bias_ids, bias_values)
        self.processes[slot] = s.processes_logits
        self.penalised[slot] = bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)
        self.has_bias[slot] = len(bias_ids) > 0
        self.tail[slot] = self.processes[slot] or s.logprobs >= 0 or s.prompt_logprobs >= 0
