"""A request as the scheduler sees it: token ids, progress counters and its KV block table."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

from nanoplane.controlplane.sampling_params import SamplingParams

PENDING = -1  # a token the data plane has sampled but the control plane has not seen yet


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(Enum):
    STOP = "stop"  # a stop token id or stop string (Sequence.stop_reason says which); None: a grammar completed
    EOS = "eos"  # the model's end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller or lost to a data-plane failure


@dataclass(slots=True)
class Logprob:
    """Log probabilities at one position, from the model's raw distribution (before penalties,
    logit bias, masks and temperature, as vLLM returns them by default)."""

    token_id: int  # the token at this position: the sampled one, or the prompt's
    logprob: float  # its log probability
    rank: int  # 1 + the number of tokens more likely than it
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), most likely first


class Sequence:
    """Mutable request state owned by the scheduler.

    `num_computed_tokens` counts tokens whose KV is in the cache once the steps sent so far have run;
    `num_scheduled_tokens` is what the step being built computes. A step that computes a sequence's
    last token appends a PENDING token at once, filled in when the step's result comes back, so the
    next step can be scheduled before that (`num_pending` of them trail `token_ids`). A sequence holds a
    data-plane `slot` from admission until it finishes or is preempted; `num_sent_blocks` tells how much
    of the block table that slot already knows.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids)  # checked against every new token: a set, not a list
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission (reported as usage)
        self.num_hashed_blocks = 0
        # Chain hashes of its first full blocks, computed once: a full block's tokens never change, and
        # a request waiting at the head of the queue looks its cached prefix up again every step.
        self.block_hashes: list[int] = []
        self.slot = -1
        self.num_sent_blocks = 0
        self.num_pending = 0
        self.finish_reason: FinishReason | None = None
        self.queued_since: float | None = time.monotonic()  # None once first admitted (the queue-time metric)
        self.deadline: float | None = None  # time.monotonic() by which it must be admitted; None: no deadline
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.sample_index = 0  # which of its request's n samples this is
        self.group: list[Sequence] = [self]  # every sample of the request, sample 0 first
        # One entry per output token when params.logprobs is set (pending tokens have none yet).
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        # One entry per prompt token when params.prompt_logprobs is set; the first token has none.
        self.prompt_logprobs: list[Logprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.grammar = None  # its structured-output matcher (controlplane/structured.py); None without one

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Output tokens known so far (pending ones left out)."""
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        """The output tokens known so far (pending ones left out)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_pending(self) -> None:
        self.token_ids.append(PENDING)
        self.num_pending += 1

    def fill_pending(self, token_id: int) -> None:
        """The oldest pending token's value has arrived."""
        self.token_ids[len(self.token_ids) - self.num_pending] = token_id
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the sequence ended before they could count)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0
