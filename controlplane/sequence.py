"""A request as the scheduler sees it: token ids, progress counters and its KV block table."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from controlplane.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(Enum):
    STOP = "stop"  # end-of-sequence or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller or lost to a data-plane failure


class Sequence:
    """Mutable request state owned by the scheduler.

    `num_computed_tokens` counts tokens whose KV is in the cache; `num_scheduled_tokens` is what the
    current step computes. A sequence holds a data-plane `slot` from admission until it finishes or
    is preempted; `num_sent_blocks` tells how much of the block table that slot already knows.
    """

    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission (reported as usage)
        self.num_hashed_blocks = 0
        self.slot = -1
        self.num_sent_blocks = 0
        self.finish_reason: FinishReason | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while prompt (or recomputed) tokens remain to be computed."""
        return self.num_computed_tokens < len(self.token_ids) - 1 or self.num_computed_tokens == 0

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
