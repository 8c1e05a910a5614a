"""Which requests run in the next step, and how many tokens each computes.

Two policies. `prefill-first`, the seeds' semantics (nano-vllm): waiting requests first, as a prefill
step; when the token budget runs out, only the head of the queue may be split (chunked prefill); with
nothing to prefill, a decode step over the running requests. `mixed` (as vLLM and SGLang do): every
step decodes the running requests and fills the rest of the token budget with waiting prompts, the
last of them chunked, so running streams keep producing while a long prompt prefills. Under both,
when the KV cache is full the newest running request is preempted (its blocks freed, to be
recomputed later) and goes back to the front of the queue (behind a prompt mid-prefill, if any).

A request that asks for prompt logprobs takes no prefix-cache hits: each prompt position is computed.

Admission: `add` refuses a request (QueueFull) when the waiting queue is at --max-queued-requests or
its prompt tokens would pass --max-queued-tokens; the engine thread adds requests one at a time, so
the bound holds exactly. A request with a deadline (engine monotonic clock) that passes before it is
first admitted is dropped before prefill and listed in `expired` for the engine to report.

Parallel samples (n > 1): only sample 0 of a request is queued; the other samples (forks) wait in
`forks` until sample 0's prompt is computed, then join a step as one-token rows that share its full
prompt blocks and copy the block holding its last prompt token (BlockManager.fork). If sample 0 ends
first, they are queued at the front as requests of their own (their prompt blocks then come from the
prefix cache).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from nanoplane.controlplane.block_manager import BlockManager
from nanoplane.controlplane.logprobs import wants_prompt_logprobs
from nanoplane.controlplane.sequence import FinishReason, Sequence, SequenceStatus
from nanoplane.controlplane.wait_queue import WaitQueue

__all__ = ["SCHEDULING_POLICIES", "QueueFull", "Scheduler", "SchedulerOutput", "WaitQueue"]

SCHEDULING_POLICIES = ("prefill-first", "mixed")
log = logging.getLogger(__name__)


class QueueFull(Exception):
    """A request refused at admission: the waiting queue is at one of its bounds."""


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence]  # rows of the step, in order (a mixed step: decode rows first)
    is_prefill: bool  # some row computes prompt tokens (a mixed step with any prompt chunk counts)
    new_seqs: list[Sequence] = field(default_factory=list)  # admitted to a slot this step
    freed_slots: list[int] = field(default_factory=list)  # slots released since the last step
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks for forks
    produces: list[bool] = field(default_factory=list)  # per row: the step samples this row's next token

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_scheduled_tokens for seq in self.seqs)


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: tuple[int, ...] = (), policy: str = "prefill-first", max_queued_requests: int = 0,
                 max_queued_tokens: int = 0):
        """`max_queued_requests`, `max_queued_tokens`: the waiting queue's bounds (0: unbounded)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.waiting = WaitQueue()
        self.running: deque[Sequence] = deque()
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.released_slots: list[int] = []
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # steps that cut a prompt short, for tests and metrics
        self.num_mixed_steps = 0  # steps with decode rows and prompt chunks together, likewise
        self.num_prefix_queries = 0  # tokens of requests looked up in the prefix cache at admission (metrics)
        self.num_prefix_hits = 0  # of those, tokens found cached
        # Seconds from arrival to first admission, per request, while a metrics reader drains them (None: nobody).
        self.queue_times: list[float] | None = None
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._deadlines: list[tuple[float, int, Sequence]] = []  # a heap of (deadline, seq_id, seq)
        self.expired: list[Sequence] = []  # dropped for their deadline, until the engine takes them
        self.num_expired = 0
        self.forks: dict[Sequence, list[Sequence]] = {}  # sample 0 -> its samples waiting to fork from it
        self.num_forks = 0  # samples admitted by forking (tests and metrics)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.forks

    def add(self, seq: Sequence) -> None:
        """Queue seq, or raise QueueFull (nothing queued) if that would pass a bound of the queue."""
        waiting = self.waiting
        if self.max_queued_requests and len(waiting) >= self.max_queued_requests:
            raise QueueFull(f"the server's queue is full: {len(waiting)} requests are waiting "
                            f"(--max-queued-requests {self.max_queued_requests}); retry later")
        # An empty queue takes any prompt: one longer than the bound could otherwise never run.
        if self.max_queued_tokens and waiting and waiting.num_prompt_tokens + seq.num_prompt_tokens > \
                self.max_queued_tokens:
            raise QueueFull(f"the server's queue is full: {waiting.num_prompt_tokens} prompt tokens are waiting "
                            f"and this request's {seq.num_prompt_tokens} would pass --max-queued-tokens "
                            f"{self.max_queued_tokens}; retry later")
        waiting.append(seq)
        if len(seq.group) > 1:
            self.forks[seq] = seq.group[1:]
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, seq.seq_id, seq))

    def _drop_expired(self) -> None:
        """Finish the waiting requests whose deadline has passed before their first admission."""
        now, heap = time.monotonic(), self._deadlines
        while heap and heap[0][0] <= now:
            seq = heapq.heappop(heap)[2]
            if seq in self.waiting and seq.queued_since is not None and not seq.block_table:
                for sample in reversed(seq.group):  # its forks wait on it: they go with it
                    self.finish(sample, FinishReason.ABORT)
                self.expired.append(seq)
                self.num_expired += 1
        if len(heap) > 2 * len(self.waiting) + 64:
            # Entries of requests admitted or ended meanwhile would pile up until their deadlines: sweep them.
            self._deadlines = [e for e in heap if e[2] in self.waiting and e[2].queued_since is not None]
            heapq.heapify(self._deadlines)

    def schedule(self) -> SchedulerOutput:
        if self._deadlines:
            self._drop_expired()
        if self.policy == "mixed":
            out = self._schedule_mixed()
        else:
            out = self._schedule_prefill(SchedulerOutput([], True), self.max_num_batched_tokens)
            if not out.seqs:
                out = self._schedule_decode(self.max_num_seqs)
        if self.forks:
            self._schedule_forks(out)
        if out.seqs:  # freed slots ride on the next descriptor actually sent
            out.freed_slots, self.released_slots = self.released_slots, []
        return out

    def _schedule_mixed(self) -> SchedulerOutput:
        """Decode rows first (one token each), then waiting prompts in the budget they leave."""
        out = self._schedule_decode(min(self.max_num_seqs, self.max_num_batched_tokens))
        num_decode = len(out.seqs)
        self._schedule_prefill(out, self.max_num_batched_tokens - num_decode)
        out.is_prefill = len(out.seqs) > num_decode
        if out.is_prefill and num_decode:
            self.num_mixed_steps += 1
        return out

    def _schedule_prefill(self, out: SchedulerOutput, budget: int) -> SchedulerOutput:
        """Add waiting prompts to out within budget tokens, the last one perhaps cut short (chunked)."""
        first = len(out.seqs)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.slot < 0 and not self.free_slots or seq.num_pending:
                break  # no slot free, or a preempted request whose last token is still in flight
            if not seq.block_table:
                num_cached_blocks = self._cached_blocks(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_manager.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_computed_tokens
            # The seeds cut only the step's first prompt short; mixed steps fill the budget.
            if num_tokens > budget and len(out.seqs) > first and self.policy == "prefill-first":
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks)
                self.num_prefix_queries += seq.num_tokens
                self.num_prefix_hits += seq.num_computed_tokens
                if seq.num_completion_tokens == 0:
                    seq.num_cached_prompt_tokens = seq.num_computed_tokens
                if seq.queued_since is not None:
                    if self.queue_times is not None:
                        self.queue_times.append(time.monotonic() - seq.queued_since)
                    seq.queued_since = None
            if seq.slot < 0:
                seq.slot = self.free_slots.pop()
                out.new_seqs.append(seq)
            seq.num_scheduled_tokens = min(num_tokens, budget)
            budget -= seq.num_scheduled_tokens
            out.seqs.append(seq)
            if seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            else:
                self.num_chunked_prefills += 1
                break  # a chunked head takes the rest of the budget
        return out

    def _cached_blocks(self, seq: Sequence) -> int:
        """Prefix blocks seq may reuse, or -1 if its blocks do not fit now. A request that still wants
        prompt logprobs reuses none: every prompt position must be computed to give its logprobs."""
        if wants_prompt_logprobs(seq):
            return 0 if seq.num_blocks <= self.block_manager.num_free_blocks else -1
        return self.block_manager.can_allocate(seq)

    def _schedule_decode(self, max_rows: int) -> SchedulerOutput:
        out = SchedulerOutput([], False)
        bm = self.block_manager
        block_size = bm.block_size
        waiting_for_results: list[Sequence] = []
        while self.running and len(out.seqs) < max_rows:
            seq = self.running.popleft()
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens or \
                    seq.num_pending and seq.grammar is not None:
                # Its last token is still in flight; the result will finish it. A grammar row's next
                # mask needs its previous token: it sits out steps until that is back.
                waiting_for_results.append(seq)
                continue
            # Most steps need no new block: test that cheaply before asking the block manager.
            if len(seq.token_ids) > len(seq.block_table) * block_size:
                while not bm.can_append(seq, seq.num_tokens):
                    if self.running:
                        self.preempt(self.running.pop())
                    else:
                        self.preempt(seq)
                        break
                else:
                    bm.may_append(seq, seq.num_tokens)
                if seq.status is not SequenceStatus.RUNNING:
                    continue
            seq.num_scheduled_tokens = 1
            out.seqs.append(seq)
        self.running.extendleft(reversed(out.seqs + waiting_for_results))
        return out

    def _schedule_forks(self, out: SchedulerOutput) -> None:
        """Add to out the forks whose sample 0 has its prompt computed, one token each, while a slot,
        a block and the token budget last."""
        budget = self.max_num_batched_tokens - out.num_tokens
        bm = self.block_manager
        if not out.seqs:
            out.is_prefill = True  # fork rows compute a prompt token
        for parent, forks in list(self.forks.items()):
            if parent.status is not SequenceStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens:
                continue  # its prompt is not computed yet (or again, after a preemption)
            while forks and budget > 0 and self.free_slots and bm.num_free_blocks:
                fork = forks.pop(0)
                out.copies.append(bm.fork(parent, fork))
                fork.slot = self.free_slots.pop()
                fork.status = SequenceStatus.RUNNING
                fork.num_cached_prompt_tokens = fork.num_computed_tokens
                fork.num_scheduled_tokens = 1
                budget -= 1
                out.new_seqs.append(fork)
                out.seqs.append(fork)
                self.running.append(fork)
                self.num_forks += 1
            if not forks:
                del self.forks[parent]

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            self.released_slots.append(seq.slot)
            seq.slot = -1

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and slot; it is recomputed from its tokens when readmitted."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        if seq.grammar is not None:
            seq.grammar.release()  # rebuilt from its output when readmitted
        self.block_manager.deallocate(seq)
        self._release_slot(seq)
        self._queue_first(seq)

    def _queue_first(self, seq: Sequence) -> None:
        """Queue seq at the front (behind a prompt mid-prefill, if any)."""
        head = self.waiting[0] if self.waiting else None
        if head is not None and head.block_table:
            # A prompt mid-prefill (mixed steps preempt beside one) keeps the head: behind seq it would
            # hold its blocks while seq waits for them.
            self.waiting.popleft()
            self.waiting.appendleft(seq)
            self.waiting.appendleft(head)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq wherever it is (running, waiting, mid-prefill) and free what it holds."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.drop_pending()
        if seq.grammar is not None:
            seq.grammar.release()
        self.block_manager.deallocate(seq)
        self._release_slot(seq)
        if seq in self.waiting:  # O(1); running holds at most max_num_seqs
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        elif seq.sample_index and seq in self.forks.get(seq.group[0], ()):
            forks = self.forks[seq.group[0]]
            forks.remove(seq)
            if not forks:
                del self.forks[seq.group[0]]
        forks = self.forks.pop(seq, None) if len(seq.group) > 1 else None
        for fork in reversed(forks or ()):  # sample 0 ended first: its forks run as requests of their own
            self._queue_first(fork)

    def _refused_by_grammar(self, seq: Sequence, token_id: int) -> bool:
        """Advance seq's matcher; a token its mask did not allow (a data plane that ignored the mask)
        ends it with ABORT, since no output after it can match."""
        if seq.grammar.matcher is None:  # preempted while this token was in flight: catch up first
            seq.grammar.ensure(seq.completion_token_ids[:-1])
        if seq.grammar.accept(token_id):
            return False
        log.warning("request %d: sampled token %d is outside its grammar (%s); aborting it",
                    seq.seq_id, token_id, seq.grammar.error)
        self.finish(seq, FinishReason.ABORT)
        return True

    def advance(self, out: SchedulerOutput) -> None:
        """Count a step as computed the moment it is sent, so the next one can be scheduled before
        its result is back; a row that computes its sequence's last token gets a pending token."""
        for seq in out.seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            produces = seq.num_computed_tokens == seq.num_tokens
            if produces:
                seq.append_pending()
            out.produces.append(produces)

    def postprocess(self, out: SchedulerOutput, token_ids: list[int]) -> list[tuple[Sequence, int]]:
        """Apply a step's sampled tokens; returns (sequence, new token) for each token that counts."""
        produced = []
        block_size = self.block_manager.block_size
        for seq, produces, token_id in zip(out.seqs, out.produces, token_ids, strict=True):
            if seq.is_finished:  # aborted, or ended by an earlier result while this step ran
                continue
            if produces:
                seq.fill_pending(token_id)
            if min(seq.num_computed_tokens, seq.num_known_tokens) // block_size > seq.num_hashed_blocks:
                self.block_manager.hash_blocks(seq)
            if not produces:
                continue  # a prefill chunk that stopped before the last prompt token
            produced.append((seq, token_id))
            if seq.grammar is not None and self._refused_by_grammar(seq, token_id):
                continue
            if (token_id in self.eos_token_ids or token_id in seq.stop_ids) and self._stop_token(seq, token_id):
                continue
            if seq.grammar is not None and seq.grammar.is_stopped:
                # Complete: the grammar allows only end-of-sequence now. It ends here, that token unsampled,
                # as STOP with no stop_reason: vLLM's finish_reason and stop_reason for it, and the last
                # token's text stays (it is the grammar's, not an ending token's).
                self.finish(seq, FinishReason.STOP)
            elif seq.num_completion_tokens >= seq.params.max_tokens:
                self.finish(seq, FinishReason.LENGTH)
        return produced

    def _stop_token(self, seq: Sequence, token_id: int) -> bool:
        """End seq on an end-of-sequence or stop token it has just produced, if that may end it now;
        returns whether it did. Before min_tokens output tokens (this one counted) neither ends it
        (vLLM's check_stop), and ignore_eos leaves end-of-sequence to the length limit."""
        params = seq.params
        if seq.num_completion_tokens < params.min_tokens:
            return False
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, FinishReason.EOS)
        elif token_id in seq.stop_ids:
            seq.stop_reason = token_id
            self.finish(seq, FinishReason.STOP)
        return seq.is_finished
