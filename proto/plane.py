"""The contract between the control plane and the data plane.

One `StepDescriptor` goes to every rank each step; rank 0 answers with one `StepResult`. The data
plane keeps per-request state in *slots* between steps, so a descriptor carries deltas: a request's
prompt, sampling parameters and initial block table travel once (`NewRequest`), after that only its
row in the column arrays and the block ids it gained.

Columns are numpy int32 arrays so that a 256-row decode descriptor packs into a few buffers. Counts
are absolute (tokens computed so far, not "one more"), which makes a lost or repeated descriptor
detectable on the data plane instead of silently computing on the wrong state.

This module imports numpy only: both planes (and a data plane in another language, one day) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# How many steps the control plane may have sent beyond the one whose result it waits for. A rank
# holds that many launched steps plus the one being answered (its pinned result buffers are sized
# for it), so a control plane must never go deeper. One keeps the GPU busy while the host prepares
# the next step; two also cover a path from result to next descriptor longer than one GPU step,
# which the service's (engine process, ZeroMQ, the rank's own launch) can be at a few rows.
MAX_STEPS_IN_FLIGHT = 2


def int32_column(values=()) -> np.ndarray:
    """A contiguous int32 column, the one array type descriptors carry."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


@dataclass(slots=True)
class SamplingSpec:
    """What the sampler on rank 0 needs of a request; fixed for the request's life."""

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 disables
    min_p: float = 0.0  # drop tokens below min_p * p(max); 0 disables
    seed: int | None = None  # keys the request's noise with each drawn position; None: the plane's shared stream
    # The logits processors below run on the raw logits in this order, before temperature and the
    # filters: token bitmask (StepDescriptor.bitmask), min_tokens mask, logit bias, repetition
    # penalty, then frequency and presence penalties. Their neutral values cost a row nothing.
    presence_penalty: float = 0.0  # subtract this from each logit of a token the output holds at least once
    frequency_penalty: float = 0.0  # subtract this times the token's count in the output
    repetition_penalty: float = 1.0  # HuggingFace's rule over prompt and output tokens: logit / p if > 0, else * p
    min_tokens: int = 0  # stop_ids are masked (-inf) while the output holds fewer tokens than this
    stop_ids: np.ndarray = field(default_factory=int32_column)  # int32: end-of-sequence and stop ids min_tokens masks
    logit_bias_ids: np.ndarray = field(default_factory=int32_column)  # int32 [B]: token ids to bias, each once
    logit_bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [B]: added
    logprobs: int = -1  # -1: none; N >= 0: the sampled token's logprob and the top N (raw model distribution)
    prompt_logprobs: int = -1  # -1: none; N >= 0: each prompt token's logprob (from position 1) and the top N

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor above changes this row's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or (self.min_tokens and len(self.stop_ids)) or len(self.logit_bias_ids))


@dataclass(slots=True)
class NewRequest:
    """A request the data plane has not seen in its slot yet (first admission, or after preemption)."""

    request_id: int  # control-plane sequence id, for error messages and tracing only
    slot: int  # row of the data plane's persistent batch state that this request occupies
    token_ids: np.ndarray  # int32: every token known so far (the prompt, plus output kept over a preemption)
    block_ids: np.ndarray  # int32: the request's whole block table at admission
    num_cached_tokens: int  # leading tokens whose KV the prefix cache already holds in block_ids
    sampling: SamplingSpec  # sampling parameters for rank 0
    # Tokens of token_ids that are the prompt; the rest are output kept over a preemption. Output
    # counts (penalties, min_tokens) start after them; prompt logprobs cover them. -1: all of token_ids.
    num_prompt_tokens: int = -1


@dataclass(slots=True)
class StepDescriptor:
    """One step of work. Rows are the scheduled requests, in the order results come back."""

    step_id: int  # consecutive from 0 per epoch; a gap or repeat is refused
    epoch: int = 0  # bumps when the control plane (re)attaches a data plane; stale steps are refused
    new_requests: list[NewRequest] = field(default_factory=list)  # admitted this step (also listed in rows)
    slots: np.ndarray = field(default_factory=int32_column)  # int32 [R]: slot of each scheduled row
    num_computed: np.ndarray = field(default_factory=int32_column)  # int32 [R]: tokens with KV cached before this step
    num_scheduled: np.ndarray = field(default_factory=int32_column)  # int32 [R]: tokens to compute this step
    # Block ids appended to each row's block table since the last step, in CSR form: row r gained
    # appended_block_ids[appended_offsets[r]:appended_offsets[r + 1]].
    appended_offsets: np.ndarray = field(default_factory=lambda: int32_column([0]))  # int32 [R + 1]
    appended_block_ids: np.ndarray = field(default_factory=int32_column)  # int32 [sum of appends]
    free_slots: np.ndarray = field(default_factory=int32_column)  # int32: slots whose requests ended; applied first
    # KV blocks to copy before the step runs (after frees and admissions), pair i: copy_src[i] ->
    # copy_dst[i] in every layer. A forked sample (n > 1) gets its own copy of the block that holds
    # its prompt's last token; the full blocks before it are shared.
    copy_src: np.ndarray = field(default_factory=int32_column)  # int32 [C]
    copy_dst: np.ndarray = field(default_factory=int32_column)  # int32 [C]
    # Allowed-token masks (structured output) for some rows: bitmask[i] applies to row bitmask_rows[i];
    # bit j of word w allows token 32 * w + j; tokens past the mask's width are not allowed.
    bitmask_rows: np.ndarray = field(default_factory=int32_column)  # int32 [M]: row indices, ascending
    bitmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # int32 [M, W]

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])


@dataclass(slots=True)
class StepResult:
    """Rank 0's answer to one descriptor."""

    step_id: int  # the descriptor's step_id
    sampled_token_ids: np.ndarray  # int32 [R]: one sampled token per row (ignored for mid-prompt chunks)
    forward_time_s: float = 0.0  # wall time the data plane spent on the step
    error: str = ""  # non-empty when the data plane refused or failed the step
    # Logprobs of the sampled tokens, for the rows whose request asked (SamplingSpec.logprobs >= 0)
    # and whose sampled token is an output token (not a mid-prompt chunk's), from log_softmax of the
    # raw logits (before processors and temperature). K is the largest N asked in the step; a row
    # that asked fewer has its extra columns padded with id -1 and logprob -inf.
    logprob_rows: np.ndarray = field(default_factory=int32_column)  # int32 [L]: row indices, ascending
    sampled_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [L]
    sampled_ranks: np.ndarray = field(default_factory=int32_column)  # int32 [L]: 1 + tokens more likely
    top_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # int32 [L, K], most likely first
    top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # float32 [L, K]
    # Prompt logprobs of the rows whose request asked (SamplingSpec.prompt_logprobs >= 0) and whose
    # chunk covered prompt tokens this step, in CSR form: row prompt_rows[i] gives tokens
    # prompt_starts[i] .. prompt_starts[i] + n - 1, n = prompt_offsets[i + 1] - prompt_offsets[i]
    # (a chunk computing positions c .. c + s - 1 gives tokens c + 1 .. min(c + s, prompt - 1), inclusive).
    prompt_rows: np.ndarray = field(default_factory=int32_column)  # int32 [P]
    prompt_starts: np.ndarray = field(default_factory=int32_column)  # int32 [P]: first prompt position given
    prompt_offsets: np.ndarray = field(default_factory=lambda: int32_column([0]))  # int32 [P + 1]
    prompt_token_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [T]
    prompt_token_ranks: np.ndarray = field(default_factory=int32_column)  # int32 [T]: 1 + tokens more likely
    prompt_top_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))  # int32 [T, K2], padded too
    prompt_top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # float32 [T, K2]


@dataclass(slots=True)
class PlaneInfo:
    """What a rank reports once it is ready (the handshake); the control plane sizes itself from it."""

    rank: int  # tensor-parallel rank of the reporting process
    world_size: int  # tensor-parallel size
    epoch: int  # echo of the control plane's epoch
    num_kv_blocks: int  # KV cache blocks this rank allocated; the control plane uses the minimum
    block_size: int  # tokens per KV block
    max_num_seqs: int  # slots in the persistent batch state
    max_model_len: int  # longest sequence the rank can hold (token buffer width)
    vocab_size: int  # rows of the output head; sampled ids are below it
    architecture: str  # config.json architectures[0]
    device: str  # "cuda:0", "cpu", ...
    dtype: str  # model dtype, e.g. "bfloat16"
