"""A minimal control plane for data-plane tests: admits requests, chunks their prompts, decodes them
for a number of tokens and keeps what each StepResult said of each request (tokens, logprobs,
prompt logprobs), so that tests check the data plane's arrays without the engine in between."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanoplane.proto.plane import NewRequest, SamplingSpec, StepDescriptor, StepResult, int32_column


@dataclass
class Record:
    prompt: list[int]
    spec: SamplingSpec
    max_tokens: int
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    tokens: list[int] = field(default_factory=list)
    # One (sampled logprob, rank, top ids, top logprobs) per output token that asked.
    logprobs: list[tuple[float, int, list[int], list[float]]] = field(default_factory=list)
    # Prompt position -> (logprob, top ids, top logprobs).
    prompt_logprobs: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)

    @property
    def known(self) -> int:
        return len(self.prompt) + len(self.tokens)


class PlaneDriver:
    """Drives anything with `execute(StepDescriptor) -> StepResult` (a ModelRunner, a LocalDataPlane)."""

    def __init__(self, plane, block_size: int, chunk: int = 64):
        self.plane, self.block_size, self.chunk = plane, block_size, chunk
        self.step_id = 0
        self.next_block = 0
        self.results: list[StepResult] = []

    def generate(self, prompts: list[list[int]], specs: list[SamplingSpec], max_tokens: int,
                 bitmask=None) -> list[Record]:
        """Run every request to max_tokens together. `bitmask(record) -> int32 [W] | None` gives a
        row's allowed-token mask for each step that samples one of its tokens."""
        recs = [Record(list(p), s, max_tokens) for p, s in zip(prompts, specs, strict=True)]
        new = []
        for i, rec in enumerate(recs):
            need = -(-(len(rec.prompt) + max_tokens) // self.block_size)
            rec.slot, rec.blocks = i, list(range(self.next_block, self.next_block + need))
            self.next_block += need
            new.append(NewRequest(i, i, int32_column(rec.prompt), int32_column(rec.blocks), 0, rec.spec))
        live = list(recs)
        freed: list[int] = []
        while live:
            scheduled = [min(self.chunk, r.known - r.computed) for r in live]
            masks = [(row, bitmask(r)) for row, r in enumerate(live)
                     if bitmask is not None and r.computed + scheduled[row] == r.known]
            masks = [(row, m) for row, m in masks if m is not None]
            desc = StepDescriptor(
                self.step_id, new_requests=new, slots=int32_column([r.slot for r in live]),
                num_computed=int32_column([r.computed for r in live]), num_scheduled=int32_column(scheduled),
                appended_offsets=int32_column([0] * (len(live) + 1)), free_slots=int32_column(freed),
                bitmask_rows=int32_column([row for row, _ in masks]),
                bitmask=np.array([m for _, m in masks], dtype=np.int32).reshape(len(masks), -1) if masks
                else np.zeros((0, 0), np.int32))
            result = self.plane.execute(desc)
            assert not result.error, result.error
            self.results.append(result)
            self.step_id += 1
            new, freed = [], []
            self._record(live, scheduled, result)
            for r in [r for r in live if len(r.tokens) == r.max_tokens]:
                live.remove(r)
                freed.append(r.slot)
        return recs

    def _record(self, live: list[Record], scheduled: list[int], result: StepResult) -> None:
        lp_row = {int(r): i for i, r in enumerate(result.logprob_rows)}
        for i, row in enumerate(result.prompt_rows.tolist()):
            rec = live[row]
            lo, hi = result.prompt_offsets[i], result.prompt_offsets[i + 1]
            for j in range(lo, hi):
                pos = int(result.prompt_starts[i]) + j - lo
                assert pos not in rec.prompt_logprobs, f"prompt position {pos} given twice"
                rec.prompt_logprobs[pos] = (float(result.prompt_token_logprobs[j]),
                                            result.prompt_top_ids[j].tolist(), result.prompt_top_logprobs[j].tolist())
        for row, (rec, n) in enumerate(zip(live, scheduled, strict=True)):
            rec.computed += n
            if rec.computed == rec.known:
                rec.tokens.append(int(result.sampled_token_ids[row]))
                if row in lp_row:
                    k = lp_row[row]
                    rec.logprobs.append((float(result.sampled_logprobs[k]), int(result.sampled_ranks[k]),
                                         result.top_ids[k].tolist(), result.top_logprobs[k].tolist()))
            else:
                assert row not in lp_row, "a mid-prompt chunk got sampled-token logprobs"
