"""A step result's logprob arrays turned into the requests' Logprob entries.

The data plane sends only the rows that asked (SamplingSpec.logprobs / prompt_logprobs), so the
engine calls these only when a step's result holds any: rows without logprobs cost nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence as Rows

from nanoplane.controlplane.sequence import Logprob, Sequence
from nanoplane.proto.plane import StepResult


def _top(ids: list[int], logprobs: list[float], n: int) -> list[tuple[int, float]]:
    """The first n (id, logprob) pairs; the data plane pads a row that asked fewer than the step's most with id -1."""
    return [(t, lp) for t, lp in zip(ids[:n], logprobs[:n], strict=True) if t >= 0]


def take_logprobs(seqs: Rows[Sequence], produces: Rows[bool], result: StepResult, token_ids: list[int]) -> None:
    """Append the sampled tokens' logprobs to their sequences. Call before the tokens are applied: a
    row counts exactly when its sequence is not finished and the step produced its token."""
    top_ids, top_logprobs = result.top_ids.tolist(), result.top_logprobs.tolist()
    for i, (row, logprob, rank) in enumerate(zip(result.logprob_rows.tolist(), result.sampled_logprobs.tolist(),
                                                 result.sampled_ranks.tolist(), strict=True)):
        seq = seqs[row]
        if seq.logprobs is None or seq.is_finished or not produces[row]:
            continue  # a mid-prompt chunk, or a request ended while the step ran
        seq.logprobs.append(Logprob(token_ids[row], logprob, rank, _top(top_ids[i], top_logprobs[i],
                                                                        seq.params.logprobs)))


def take_prompt_logprobs(seqs: Rows[Sequence], result: StepResult) -> None:
    """Append prompt logprobs to their sequences, so that entry p is prompt position p's. A prompt
    computed again after a preemption gives positions the sequence holds already: those are skipped."""
    offsets, starts = result.prompt_offsets.tolist(), result.prompt_starts.tolist()
    logprobs = result.prompt_token_logprobs.tolist()
    # A data plane that does not report prompt ranks: a token's place among the top N, else 0 (unknown).
    ranks = result.prompt_token_ranks.tolist() if len(result.prompt_token_ranks) == len(logprobs) else None
    top_ids, top_logprobs = result.prompt_top_ids.tolist(), result.prompt_top_logprobs.tolist()
    for i, row in enumerate(result.prompt_rows.tolist()):
        seq = seqs[row]
        entries = seq.prompt_logprobs
        if entries is None or seq.is_finished:
            continue
        start, lo, hi = starts[i], offsets[i], offsets[i + 1]
        if start > len(entries):
            raise RuntimeError(f"data plane gave prompt logprobs from position {start} of request {seq.seq_id}, "
                               f"which holds them only up to position {len(entries) - 1}")
        n = seq.params.prompt_logprobs
        end = min(hi, lo + seq.num_prompt_tokens - start)  # never past the prompt
        for j in range(lo + len(entries) - start, end):
            token, top = seq.token_ids[start + j - lo], _top(top_ids[j], top_logprobs[j], n)
            rank = ranks[j] if ranks is not None else next((k + 1 for k, (t, _) in enumerate(top) if t == token), 0)
            entries.append(Logprob(token, logprobs[j], rank, top))


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether seq still needs prompt logprobs computed: then every prompt position must run (no
    prefix-cache hits), and the data plane is asked for them."""
    return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens
