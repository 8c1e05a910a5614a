"""Scheduler and engine loop on CPU with a fake data plane (no model): the seeds' semantics and the
delta descriptors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.scheduler import WaitQueue
from nanoplane.controlplane.sequence import FinishReason, Sequence
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult

VOCAB, EOS = 100, 0


class FakeDataPlane:
    """Tracks the slots like a real rank would and 'samples' slot + step + 1 (never EOS)."""

    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 8):
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.descriptors: list[StepDescriptor] = []
        self.tables: dict[int, list[int]] = {}
        self.eos_at: dict[int, int] = {}  # request id -> step at which to sample EOS
        self.slot_req: dict[int, int] = {}

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, self.num_blocks, self.block_size, self.max_num_seqs, 512, VOCAB, "Fake", "cpu",
                          "float32")]

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.descriptors.append(desc)
        for slot in desc.free_slots.tolist():
            self.tables.pop(slot, None)
        for req in desc.new_requests:
            assert req.slot not in self.tables
            self.tables[req.slot] = req.block_ids.tolist()
            self.slot_req[req.slot] = req.request_id
        for r, slot in enumerate(desc.slots.tolist()):
            self.tables[slot] += desc.appended_block_ids[desc.appended_offsets[r]:desc.appended_offsets[r + 1]].tolist()
            need = -(-(desc.num_computed[r] + desc.num_scheduled[r]) // self.block_size)
            assert len(self.tables[slot]) >= need
        tokens = [EOS if self.eos_at.get(self.slot_req[s]) == desc.step_id else 1 + (s + desc.step_id) % (VOCAB - 1)
                  for s in desc.slots.tolist()]
        return StepResult(desc.step_id, np.asarray(tokens, dtype=np.int32))

    def close(self) -> None:
        pass


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    return str(tmp_path)


def make_engine(model_dir, num_blocks=64, **kw) -> tuple[Engine, FakeDataPlane]:
    dp = FakeDataPlane(num_blocks, max_num_seqs=kw.pop("max_num_seqs", 8))
    cfg = EngineConfig(model_dir, device="cpu", kvcache_block_size=16, max_num_seqs=dp.max_num_seqs, **kw)
    return Engine(cfg, dp, (EOS,)), dp


def run(engine: Engine, limit: int = 1000) -> list:
    outs = []
    for _ in range(limit):
        if not engine.has_work():
            return outs
        outs.append(engine.step())
    raise AssertionError("engine did not finish")


def test_prefill_first_then_decode_and_chunking(model_dir):
    engine, dp = make_engine(model_dir, max_num_batched_tokens=50)
    a = engine.add_request(list(range(1, 31)), SamplingParams(max_tokens=3))
    b = engine.add_request(list(range(99, 19, -1)), SamplingParams(max_tokens=3))
    steps = run(engine)
    d = dp.descriptors
    # Only the first request of a step may be chunked, so b waits: step 0 is a alone (30); step 1
    # b's first 50; step 2 b's last 30 — all prefill before any decode.
    assert [s.is_prefill for s in steps[:3]] == [True, True, True]
    assert [s.num_tokens for s in steps[:4]] == [30, 50, 30, 2]  # what each step computed
    assert d[0].num_scheduled.tolist() == [30] and d[1].num_scheduled.tolist() == [50]
    assert d[2].num_scheduled.tolist() == [30] and d[2].num_computed.tolist() == [50]
    assert engine.scheduler.num_chunked_prefills == 1
    assert all(not s.is_prefill for s in steps[3:])
    assert a.finish_reason is FinishReason.LENGTH and len(a.completion_token_ids) == 3
    assert b.finish_reason is FinishReason.LENGTH and len(b.completion_token_ids) == 3
    # the prompt travels once; later rows of the same slot carry no token ids
    assert [len(x.new_requests) for x in d[:3]] == [1, 1, 0]


def test_descriptor_carries_only_appended_blocks(model_dir):
    engine, dp = make_engine(model_dir)
    engine.add_request(list(range(1, 16)), SamplingParams(max_tokens=20, ignore_eos=True))
    run(engine)
    appended = [x.appended_block_ids.tolist() for x in dp.descriptors]
    # 15 prompt tokens, then 19 decode steps compute positions 15..33: block 0 came with the new
    # request, block 1 is appended by the step computing position 16, block 2 by position 32's.
    grew = [i for i, a in enumerate(appended) if a]
    assert grew == [2, 18] and all(len(appended[i]) == 1 for i in grew)


def test_max_num_seqs_and_slots(model_dir):
    engine, dp = make_engine(model_dir, max_num_seqs=2)
    seqs = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=2)) for _ in range(5)]
    run(engine)
    assert all(len(d.slots) <= 2 for d in dp.descriptors)
    assert all(0 <= s < 2 for d in dp.descriptors for s in d.slots.tolist())
    assert all(s.is_finished for s in seqs)
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_preempts_the_newest_and_resumes_it_first(model_dir):
    # 3 blocks of 16: two requests of 16-token prompts each need a second block after one decode step.
    engine, dp = make_engine(model_dir, num_blocks=3)
    old = engine.add_request(list(range(1, 17)), SamplingParams(max_tokens=20, ignore_eos=True))
    new = engine.add_request(list(range(20, 36)), SamplingParams(max_tokens=20, ignore_eos=True))
    run(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert old.is_finished and new.is_finished
    # the preempted request came back as a new request carrying its generated tokens too
    readmitted = [r for d in dp.descriptors[1:] for r in d.new_requests if r.request_id == new.seq_id]
    assert readmitted and len(readmitted[0].token_ids) > 16
    bm = engine.scheduler.block_manager
    assert bm.num_used_blocks == 0


def test_eos_stops_and_abort_frees(model_dir):
    engine, dp = make_engine(model_dir)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50))
    b = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50))
    dp.eos_at[a.seq_id] = 3
    engine.step()
    engine.step()
    assert engine.scheduler.block_manager.num_used_blocks > 0
    b_slot = b.slot
    engine.abort(b.seq_id)
    assert b.finish_reason is FinishReason.ABORT
    run(engine)
    assert a.finish_reason is FinishReason.EOS and a.completion_token_ids[-1] == EOS
    assert engine.scheduler.block_manager.num_used_blocks == 0
    # the aborted slot is freed in the next descriptor
    assert b_slot in dp.descriptors[2].free_slots.tolist()


def test_result_for_wrong_step_is_an_error(model_dir):
    engine, dp = make_engine(model_dir)
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    dp.execute = lambda desc: StepResult(desc.step_id + 1, np.zeros(1, dtype=np.int32))
    with pytest.raises(RuntimeError, match="answered step"):
        engine.step()


class PositionalDataPlane(FakeDataPlane):
    """'Samples' a token that depends only on the request and the position, so outputs do not depend
    on how steps were batched or pipelined; can keep steps in flight (submit/collect)."""

    def __init__(self, *a, eos_at_position: dict[int, int] | None = None, **kw):
        super().__init__(*a, **kw)
        self.eos_at_position = eos_at_position or {}
        self.index: dict[int, int] = {}  # request id -> its place in the test, so runs compare
        self.queue: list[StepResult] = []
        self.max_queued = 0  # the most steps submitted and not collected at once

    def execute(self, desc: StepDescriptor) -> StepResult:
        for slot in desc.free_slots.tolist():
            self.tables.pop(slot, None)
        for req in desc.new_requests:
            self.slot_req[req.slot] = req.request_id
        tokens = []
        for r, slot in enumerate(desc.slots.tolist()):
            req, pos = self.index[self.slot_req[slot]], int(desc.num_computed[r] + desc.num_scheduled[r])
            tokens.append(EOS if self.eos_at_position.get(req) == pos else 1 + (req * 31 + pos * 7) % (VOCAB - 1))
        self.descriptors.append(desc)
        return StepResult(desc.step_id, np.asarray(tokens, dtype=np.int32))

    def submit(self, desc: StepDescriptor) -> None:
        self.queue.append(self.execute(desc))
        self.max_queued = max(self.max_queued, len(self.queue))

    def collect(self, step_id: int) -> StepResult:
        result = self.queue.pop(0)
        assert result.step_id == step_id
        return result


def run_positional(model_dir, depth: int, num_blocks: int, abort_after: int | None = None,
                   policy: str = "prefill-first", budget: int = 40):
    """The positional workload with `depth` steps in flight (0: every step waited for)."""
    dp = PositionalDataPlane(num_blocks, max_num_seqs=4)
    cfg = EngineConfig(model_dir, device="cpu", kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=budget,
                       steps_in_flight=depth, scheduling_policy=policy)
    engine = Engine(cfg, dp, (EOS,), overlap=depth > 0)
    assert engine.steps_in_flight == depth
    seqs = [engine.add_request([(i * 13 + j) % 90 + 5 for j in range(10 + 9 * i)],
                               SamplingParams(max_tokens=25 + i, ignore_eos=i == 3)) for i in range(6)]
    dp.index = {s.seq_id: i for i, s in enumerate(seqs)}
    dp.eos_at_position = {1: 30, 3: 50}  # request 3 ignores EOS
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort(seqs[4].seq_id)
        assert steps < 2000
    bm = engine.scheduler.block_manager
    assert bm.num_used_blocks == 0 and not engine.scheduler.running and not engine.scheduler.waiting
    assert dp.max_queued == (depth + 1 if depth else 0)  # the pipeline was as deep as asked, no deeper
    if policy == "mixed":  # the seeds' decode steps take every running request whatever the budget
        assert all(int(d.num_scheduled.sum()) <= budget for d in dp.descriptors)
    assert all(d.num_rows <= 4 for d in dp.descriptors)
    return [(s.completion_token_ids, s.finish_reason) for s in seqs], engine.scheduler.num_preemptions


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [64, 7])  # 7 blocks force preemption
def test_steps_in_flight_give_the_same_outputs(model_dir, num_blocks, depth):
    sync, _ = run_positional(model_dir, depth=0, num_blocks=num_blocks)
    piped, preemptions = run_positional(model_dir, depth=depth, num_blocks=num_blocks)
    assert piped == sync
    assert sync[1][1] is FinishReason.EOS and sync[1][0][-1] == EOS
    assert sync[3][1] is FinishReason.LENGTH and len(sync[3][0]) == 28  # EOS ignored
    assert all(len(out) <= 25 + i for i, (out, _) in enumerate(sync))
    if num_blocks == 7:
        assert preemptions > 0


def test_steps_in_flight_come_from_the_config_or_else_the_data_plane(model_dir):
    def depth(data_plane_wants: int | None, configured: int) -> int:
        dp = PositionalDataPlane(64, max_num_seqs=4)
        if data_plane_wants is not None:
            dp.steps_in_flight = data_plane_wants
        cfg = EngineConfig(model_dir, device="cpu", kvcache_block_size=16, max_num_seqs=4, steps_in_flight=configured)
        return Engine(cfg, dp, (EOS,)).steps_in_flight

    assert depth(None, 0) == 1  # a data plane that says nothing gets one
    assert depth(2, 0) == 2 and depth(2, 1) == 1 and depth(1, 2) == 2
    sync = Engine(EngineConfig(model_dir, device="cpu", kvcache_block_size=16, max_num_seqs=4, steps_in_flight=2),
                  FakeDataPlane(64, max_num_seqs=4), (EOS,))
    assert sync.steps_in_flight == 0  # no submit/collect: every step is waited for
    with pytest.raises(ValueError, match="steps_in_flight must be 0"):
        EngineConfig(model_dir, steps_in_flight=3)


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_with_steps_in_flight(model_dir, depth):
    outs, _ = run_positional(model_dir, depth=depth, num_blocks=64, abort_after=5)
    assert outs[4][1] is FinishReason.ABORT
    assert outs[0][1] is FinishReason.LENGTH and len(outs[0][0]) == 25


def test_mixed_steps_keep_decoding_while_a_long_prompt_is_chunked_in(model_dir):
    silent = {}
    for policy in ("prefill-first", "mixed"):
        engine, dp = make_engine(model_dir, max_num_batched_tokens=50, scheduling_policy=policy)
        short = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=30, ignore_eos=True))
        engine.step()  # short's prompt
        long = engine.add_request([(7 * i) % 90 + 5 for i in range(200)], SamplingParams(max_tokens=3, ignore_eos=True))
        silent[policy] = 0  # steps of long's prefill in which short got no token
        while long.num_computed_tokens < 200:
            produced = [seq for seq, _ in engine.step().produced]
            silent[policy] += short not in produced
        slots = [short.slot, long.slot]
        run(engine)
        assert short.finish_reason is long.finish_reason is FinishReason.LENGTH
        assert len(short.completion_token_ids) == 30 and len(long.completion_token_ids) == 3
        if policy == "mixed":
            # short's decode row first, then 49 of long's tokens: the budget is full; 200 = 4 * 49 + 4.
            prefill = dp.descriptors[1:6]
            assert [d.num_scheduled.tolist() for d in prefill] == [[1, 49]] * 4 + [[1, 4]]
            assert all(d.slots.tolist() == slots for d in prefill)
            assert [len(d.new_requests) for d in prefill] == [1, 0, 0, 0, 0]
            assert engine.scheduler.num_mixed_steps == 5 and engine.scheduler.num_chunked_prefills == 4
        else:
            assert engine.scheduler.num_mixed_steps == 0
    assert silent == {"prefill-first": 4, "mixed": 0}


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("num_blocks,budget", [(64, 40), (7, 40), (64, 7), (9, 3)])  # 7 and 9 blocks preempt
def test_mixed_policy_gives_the_same_outputs_within_the_budget(model_dir, depth, num_blocks, budget):
    """Tokens that depend only on the request and the position: any schedule must give the seeds'
    outputs; mixed steps never go over the token budget (3: fewer than the running requests)."""
    seeds, _ = run_positional(model_dir, depth=0, num_blocks=num_blocks, budget=budget)
    mixed, preemptions = run_positional(model_dir, depth=depth, num_blocks=num_blocks, budget=budget, policy="mixed")
    assert mixed == seeds
    assert seeds[1][1] is FinishReason.EOS and seeds[3][1] is FinishReason.LENGTH and len(seeds[3][0]) == 28
    if num_blocks < 64:
        assert preemptions > 0


def test_mixed_preemption_leaves_a_prompt_mid_prefill_at_the_head(model_dir):
    # 6 blocks of 16. Step 0: a's 15 tokens and 5 of b's 80 (b takes the other 5 blocks); step 1: a
    # decodes beside b's next chunk; step 2: a needs a second block and is preempted. Put in front of
    # b, it could never come back (it needs 2 blocks, 1 is free) and b, holding the rest, never finishes.
    engine, dp = make_engine(model_dir, num_blocks=6, max_num_batched_tokens=20, scheduling_policy="mixed")
    a = engine.add_request(list(range(1, 16)), SamplingParams(max_tokens=30, ignore_eos=True))
    b = engine.add_request([(3 * i) % 90 + 5 for i in range(80)], SamplingParams(max_tokens=3, ignore_eos=True))
    run(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert len(a.completion_token_ids) == 30 and len(b.completion_token_ids) == 3
    assert [d.num_scheduled.tolist() for d in dp.descriptors[:2]] == [[15, 5], [1, 19]]
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_unknown_scheduling_policy_is_refused(model_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        EngineConfig(model_dir, scheduling_policy="decode-first")


def test_a_slot_freed_while_idle_is_freed_on_the_data_plane(model_dir):
    # An abort while nothing else runs frees a slot during a step that sends no descriptor; the
    # next descriptor must still carry it, or the data plane refuses the slot's next request.
    engine, dp = make_engine(model_dir)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
    engine.step()
    slot = a.slot
    engine.abort(a.seq_id)
    assert not engine.step().rows  # nothing to run
    b = engine.add_request([4, 5, 6], SamplingParams(max_tokens=2))
    run(engine)
    assert b.slot == -1 and b.is_finished
    assert slot in dp.descriptors[1].free_slots.tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "popleft", "remove"]), st.integers(0, 1000)),
                max_size=80))
def test_wait_queue_behaves_as_a_list(ops):
    """WaitQueue (lazy removal) against a plain list: same order, ends, length and membership."""
    queue, model = WaitQueue(), []
    made = [Sequence([1], SamplingParams(), 16) for _ in range(len(ops))]
    for (op, pick), seq in zip(ops, made, strict=True):
        if op == "append":
            queue.append(seq)
            model.append(seq)
        elif op == "appendleft":
            queue.appendleft(seq)
            model.insert(0, seq)
        elif op == "popleft" and model:
            assert queue.popleft() is model.pop(0)
        elif op == "remove" and model:
            victim = model.pop(pick % len(model))
            queue.remove(victim)
            assert victim not in queue
        assert len(queue) == len(model) and bool(queue) == bool(model) and list(queue) == model
        if model:
            assert queue[0] is model[0] and queue[-1] is model[-1]
        assert all(s in queue for s in model)


def test_wait_queue_sweeps_out_what_was_removed_behind_a_live_head():
    """Requests removed from the middle (the head never leaves: blocked) are not kept for ever."""
    queue = WaitQueue()
    seqs = [Sequence([1], SamplingParams(), 16) for _ in range(1000)]
    for seq in seqs:
        queue.append(seq)
    for seq in seqs[1:-1]:  # every client but the oldest and the newest drops its request
        queue.remove(seq)
        assert len(queue._queue) <= 2 * max(len(queue), 64) + 1  # held entries stay bounded
    assert list(queue) == [seqs[0], seqs[-1]] and len(queue) == 2
    assert queue[0] is seqs[0] and queue[-1] is seqs[-1] and seqs[500] not in queue
