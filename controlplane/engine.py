"""The engine loop: validate requests, schedule a step, describe it to the data plane, apply the result.

The same loop drives an in-process data plane (embedded `LLM`) and remote ranks over ZeroMQ (the
service); only the `DataPlaneClient` differs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.logprobs import take_logprobs, take_prompt_logprobs, wants_prompt_logprobs
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.scheduler import Scheduler, SchedulerOutput
from nanoplane.controlplane.sequence import FinishReason, Sequence
from nanoplane.controlplane.structured import CompiledGrammar, GrammarCompiler, SequenceGrammar
from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT, NewRequest, PlaneInfo, StepDescriptor, StepResult, int32_column


class DataPlaneClient(Protocol):
    """How the engine reaches the data plane: in-process or over a transport.

    A client that also has `submit(desc)` and `collect(step_id) -> StepResult` lets the engine keep
    steps in flight: step N+1 (and N+2) is scheduled and sent while step N runs. Its attribute
    `steps_in_flight`, if any, read after `start`, says how many it wants when the engine config
    leaves that open.
    """

    def start(self) -> list[PlaneInfo]:
        """Bring the ranks up and return each rank's handshake."""

    def execute(self, desc: StepDescriptor) -> StepResult:
        """Run one step on every rank and return rank 0's result."""

    def close(self) -> None:
        """Stop the ranks and release their memory."""


@dataclass(slots=True)
class StepOutput:
    """What a step's result did. With steps in flight, that is the result of an earlier step."""

    # (sample, its new output token), for each token that counts. A request with n > 1 has a Sequence
    # per sample: sample.group[0] is the one add_request returned, sample.sample_index says which.
    produced: list[tuple[Sequence, int]]
    finished: list[Sequence]  # samples that ended with this result (a request is done once its whole group is)
    num_tokens: int  # tokens the step computed
    is_prefill: bool
    forward_time_s: float = 0.0
    rows: list[Sequence] = field(default_factory=list)  # the step's rows


def validate_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     kv_capacity_tokens: int) -> None:
    """Raise ValueError with a message a person understands if the request cannot run on an engine of
    these sizes."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if len(token_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    # The common case in C-speed passes (this runs for every request, on the engine thread too);
    # the per-id loop only finds the culprit for the message.
    if not (all(type(t) is int for t in token_ids) and min(token_ids) >= 0 and max(token_ids) < vocab_size):
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token {i} is {t!r}: token ids must be integers in "
                                 f"[0, {vocab_size})")
    bad_bias = [t for t in params.logit_bias if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"invalid sampling parameter logit_bias: token id {bad_bias[0]} is outside the "
                         f"vocabulary (ids are below {vocab_size})")
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total}, "
                         f"more than max_model_len {max_model_len}")
    if total > kv_capacity_tokens:
        raise ValueError(f"prompt plus max_tokens is {total} tokens, more than the KV cache holds "
                         f"({kv_capacity_tokens} tokens)")


class Engine:
    def __init__(self, config: EngineConfig, data_plane: DataPlaneClient, eos_token_ids: tuple[int, ...],
                 overlap: bool | None = None, start_timeout: float | None = None):
        """`overlap`: keep steps in flight (default: whenever the data plane can submit and collect);
        how many is `config.steps_in_flight`, or the data plane's choice when that is 0.
        `start_timeout`: how long to wait for the data plane's ranks (default: the client's own)."""
        self.config = config
        self.data_plane = data_plane
        can_overlap = hasattr(data_plane, "submit") and hasattr(data_plane, "collect")
        self.overlap = can_overlap if overlap is None else overlap and can_overlap
        self.inflight: deque[tuple[SchedulerOutput, int, int]] = deque()  # (output, step id, tokens), oldest first
        self.infos = data_plane.start() if start_timeout is None else data_plane.start(start_timeout)
        # After start: a data plane may choose by what its ranks run on.
        depth = config.steps_in_flight or getattr(data_plane, "steps_in_flight", 1)
        self.steps_in_flight = min(depth, MAX_STEPS_IN_FLIGHT) if self.overlap else 0
        info = self.infos[0]
        self.num_kv_blocks = min(i.num_kv_blocks for i in self.infos)
        self.vocab_size = info.vocab_size
        self.block_size = info.block_size
        self.max_model_len = min(config.max_model_len, info.max_model_len)
        self.scheduler = Scheduler(self.num_kv_blocks, self.block_size, min(config.max_num_seqs, info.max_num_seqs),
                                   config.max_num_batched_tokens, eos_token_ids, config.scheduling_policy,
                                   config.max_queued_requests, config.max_queued_tokens)
        self.step_id = 0
        self.epoch = info.epoch
        self.seqs: dict[int, Sequence] = {}
        # Structured output's compiler; llguidance's tokenizer is built on its first compile, not here.
        self.grammars = GrammarCompiler(config.model, self.vocab_size, self.scheduler.eos_token_ids)
        # Structured output's host work in describe(): seconds, steps with masks, mask rows (benchmarks).
        self.mask_time_s = 0.0
        self.num_mask_steps = self.num_mask_rows = 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a message a person understands; nothing is queued on failure."""
        validate_request(token_ids, params, self.vocab_size, self.max_model_len, self.kv_capacity_tokens)

    def add_request(self, token_ids: list[int], params: SamplingParams, validated: bool = False,
                    deadline: float | None = None, grammar: CompiledGrammar | None = None) -> Sequence:
        """Queue a request. `validated`: the caller has just run validate() on these very arguments
        (a batch checked whole before any of it is queued), so the per-token pass is not run twice.
        `deadline`: the time.monotonic() by which it must start, else it is dropped (take_expired).
        `grammar`: params.structured compiled by self.grammars; without it a structured request
        waits here for its compile (instant when cached: submit it first, off this thread).
        Raises ValueError (a grammar that does not compile, too), or scheduler.QueueFull when the
        waiting queue is at its bound.

        With params.n > 1 the request has n samples, seq.group (sample i draws with seed + i); the
        returned one is sample 0, whose prompt is computed once and shared with the others."""
        token_ids = list(token_ids)
        if not validated:
            self.validate(token_ids, params)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        seq = Sequence(token_ids, params, self.block_size)
        if grammar is not None:
            seq.grammar = SequenceGrammar(grammar)
        seq.deadline = deadline
        if params.n > 1:
            seq.group = [seq] + [Sequence(token_ids, params, self.block_size) for _ in range(1, params.n)]
            for i, sample in enumerate(seq.group[1:], 1):
                sample.sample_index, sample.group, sample.queued_since = i, seq.group, None
                sample.prompt_logprobs = None  # the prompt's are sample 0's alone
                if grammar is not None:  # each sample follows the grammar with a matcher of its own
                    sample.grammar = SequenceGrammar(grammar)
        self.scheduler.add(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def take_expired(self) -> list[Sequence]:
        """The requests dropped for their deadline since the last call (blocks and slots freed already)."""
        expired, self.scheduler.expired = self.scheduler.expired, []
        for seq in expired:
            self.seqs.pop(seq.seq_id, None)
        return expired

    def abort(self, seq_id: int) -> None:
        """Drop a request (every sample of it) at once, wherever it is, and free its blocks; unknown
        ids are ignored."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for sample in reversed(seq.group):  # forks first: they would otherwise outlive sample 0 as requests
                self.scheduler.finish(sample, FinishReason.ABORT)

    def stop_on_string(self, seq: Sequence, stop: str) -> None:
        """End a request whose text reached the stop string `stop` (finish reason STOP) and free its
        blocks at once. One that ended with the same result (its last token) takes this reason instead,
        as in vLLM, where stop strings are judged after the tokens."""
        self.scheduler.finish(seq, FinishReason.STOP)
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        self._forget(seq)

    def stats(self) -> tuple[int, int, int, int]:
        """(running, waiting, KV blocks held by live requests, KV blocks in all)."""
        s = self.scheduler
        return len(s.running), len(s.waiting), s.block_manager.num_used_blocks, self.num_kv_blocks

    def has_work(self) -> bool:
        return bool(self.inflight) or not self.scheduler.is_finished()

    def step(self, on_queued: Callable[[], None] | None = None) -> StepOutput:
        """Schedule and send a step; return what the latest result did: this step's, or with overlap
        that of the step `steps_in_flight` before it (the GPU then never waits for this host work),
        or nothing yet while the first steps of a burst fill the pipeline.

        `on_queued` runs once per call, after the step is sent and before the call waits for a
        result: work done there (handing the previous result's tokens to the streams) is off the
        path from one result to the next step's descriptor, which the GPU waits on."""
        out = self.scheduler.schedule()
        sent = False
        if out.seqs:
            num_tokens = out.num_tokens
            desc = self.describe(out)
            self.scheduler.advance(out)
            if not self.overlap:
                if on_queued is not None:
                    on_queued()
                return self._apply(out, num_tokens, self.data_plane.execute(desc), desc.step_id)
            self.data_plane.submit(desc)
            self.inflight.append((out, desc.step_id, num_tokens))
            sent = True
        if on_queued is not None:
            on_queued()
        # Nothing new to send (the rest waits for results) also means: collect the oldest now.
        if not self.inflight or (sent and len(self.inflight) <= self.steps_in_flight):
            return StepOutput([], [], 0, False)
        prev_out, step_id, num_tokens = self.inflight.popleft()
        return self._apply(prev_out, num_tokens, self.data_plane.collect(step_id), step_id)

    def _apply(self, out: SchedulerOutput, num_tokens: int, result: StepResult, step_id: int) -> StepOutput:
        if result.error:
            raise RuntimeError(f"data plane failed step {step_id}: {result.error}")
        if result.step_id != step_id:
            raise RuntimeError(f"data plane answered step {result.step_id} to step {step_id}")
        token_ids = result.sampled_token_ids.tolist()
        # Only rows that asked come back with logprobs: a step where none did costs a length test.
        if len(result.logprob_rows):
            take_logprobs(out.seqs, out.produces, result, token_ids)
        if len(result.prompt_rows):
            take_prompt_logprobs(out.seqs, result)
        produced = self.scheduler.postprocess(out, token_ids)
        finished = [seq for seq, _ in produced if seq.is_finished]
        for seq in finished:
            self._forget(seq)
        return StepOutput(produced, finished, num_tokens, out.is_prefill, result.forward_time_s, out.seqs)

    def _forget(self, seq: Sequence) -> None:
        """Drop a finished sample's request from `seqs` once its last sample has finished."""
        if len(seq.group) == 1 or all(sample.is_finished for sample in seq.group):
            self.seqs.pop(seq.group[0].seq_id, None)

    def describe(self, out: SchedulerOutput) -> StepDescriptor:
        """The step as deltas against what each data-plane slot already holds."""
        new_requests = []
        for seq in out.new_seqs:
            assert not seq.num_pending, "a request is admitted only once its tokens are known"
            spec = seq.params.to_spec(self.scheduler.eos_token_ids, seq.sample_index)
            # Sample 0 alone computes (and reports) the prompt's; one readmitted after a preemption holds them already.
            if seq.sample_index or (seq.prompt_logprobs is not None and not wants_prompt_logprobs(seq)):
                spec.prompt_logprobs = -1
            new_requests.append(NewRequest(seq.seq_id, seq.slot, int32_column(seq.token_ids),
                                           int32_column(seq.block_table), seq.num_computed_tokens, spec,
                                           seq.num_prompt_tokens))
            seq.num_sent_blocks = len(seq.block_table)
        offsets, appended = [0], []
        for seq in out.seqs:
            appended.extend(seq.block_table[seq.num_sent_blocks:])
            seq.num_sent_blocks = len(seq.block_table)
            offsets.append(len(appended))
        desc = StepDescriptor(
            step_id=self.step_id,
            epoch=self.epoch,
            new_requests=new_requests,
            slots=int32_column([seq.slot for seq in out.seqs]),
            num_computed=int32_column([seq.num_computed_tokens for seq in out.seqs]),
            num_scheduled=int32_column([seq.num_scheduled_tokens for seq in out.seqs]),
            appended_offsets=int32_column(offsets),
            appended_block_ids=int32_column(appended),
            free_slots=int32_column(out.freed_slots),
            copy_src=int32_column([src for src, _ in out.copies]),
            copy_dst=int32_column([dst for _, dst in out.copies]),
        )
        self._add_masks(out, desc)
        self.step_id += 1
        return desc

    def _add_masks(self, out: SchedulerOutput, desc: StepDescriptor) -> None:
        """Allowed-token masks for the rows that sample under a grammar (before advance(): a row samples
        when it computes its sequence's last known token). A grammar row is only scheduled with its
        previous token known (scheduler), so its matcher is up to date."""
        rows, grammars = [], []
        for i, seq in enumerate(out.seqs):
            if seq.grammar is not None and seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.grammar.ensure(seq.completion_token_ids)
                rows.append(i)
                grammars.append(seq.grammar)
        if rows:
            started = time.perf_counter()
            desc.bitmask = self.grammars.fill_masks(grammars)
            desc.bitmask_rows = int32_column(rows)
            self.mask_time_s += time.perf_counter() - started
            self.num_mask_steps += 1
            self.num_mask_rows += len(rows)

    def close(self) -> None:
        self.grammars.close()
        self.data_plane.close()
