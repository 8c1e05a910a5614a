"""Parallel samples (n > 1) on the control plane, with a fake data plane that keeps token ids as its
"KV cache": forks share the prompt's full blocks, copy the one holding the last prompt token, and each
sample reads back exactly its own tokens, through preemption, steps in flight and aborts."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from nanoplane.controlplane.block_manager import BlockManager
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Sequence
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult

VOCAB, EOS, BS = 40, 0, 4


class TokenKVPlane:
    """A step writes each computed position's token id into its block-table cell, then every row that
    reached its last known token checks that its context reads back as its own tokens (a wrong table,
    a missing copy or a shared block written by another sample shows) and draws a token from its seed
    and that context, so equal seeds and equal contexts give equal tokens however steps are batched."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8):
        self.num_blocks, self.max_num_seqs = num_blocks, max_num_seqs
        self.kv = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.slots: dict[int, dict] = {}
        self.descriptors: list[StepDescriptor] = []
        self.queue: list[StepResult] = []

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, self.num_blocks, BS, self.max_num_seqs, 512, VOCAB, "Fake", "cpu", "float32")]

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.descriptors.append(desc)
        for slot in desc.free_slots.tolist():
            del self.slots[slot]
        for req in desc.new_requests:
            assert req.slot not in self.slots
            self.slots[req.slot] = {"tokens": req.token_ids.tolist(), "table": req.block_ids.tolist(),
                                    "seed": req.sampling.seed, "computed": req.num_cached_tokens}
        for src, dst in zip(desc.copy_src.tolist(), desc.copy_dst.tolist(), strict=True):
            self.kv[dst] = self.kv[src]
        rows = []
        for r, slot in enumerate(desc.slots.tolist()):
            st = self.slots[slot]
            st["table"] += desc.appended_block_ids[desc.appended_offsets[r]:desc.appended_offsets[r + 1]].tolist()
            start, end = int(desc.num_computed[r]), int(desc.num_computed[r] + desc.num_scheduled[r])
            assert st["computed"] == start
            for pos in range(start, end):
                self.kv[st["table"][pos // BS], pos % BS] = st["tokens"][pos]
            st["computed"] = end
            rows.append((st, end))
        tokens = []
        for st, end in rows:
            context = [int(self.kv[st["table"][p // BS], p % BS]) for p in range(end)]
            assert context == st["tokens"][:end], "a row read KV that is not its own"
            token = random.Random(f"{st['seed']}:{context}").randrange(VOCAB) if end == len(st["tokens"]) else -1
            if token >= 0:
                st["tokens"].append(token)
            tokens.append(max(token, 0))
        return StepResult(desc.step_id, np.asarray(tokens, dtype=np.int32))

    def submit(self, desc: StepDescriptor) -> None:
        self.queue.append(self.execute(desc))

    def collect(self, step_id: int) -> StepResult:
        return self.queue.pop(0)

    def close(self) -> None:
        pass


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    return str(tmp_path)


def make_engine(model_dir, num_blocks=64, depth=0, max_num_seqs=8, **kw) -> tuple[Engine, TokenKVPlane]:
    dp = TokenKVPlane(num_blocks, max_num_seqs)
    cfg = EngineConfig(model_dir, device="cpu", max_num_seqs=max_num_seqs,  # the block size is the plane's
                       steps_in_flight=depth, **kw)
    return Engine(cfg, dp, (EOS,), overlap=depth > 0), dp


def live_seqs(engine: Engine) -> list[Sequence]:
    s = engine.scheduler
    return [seq for seq in list(s.running) + list(s.waiting) if seq.block_table]


def check_ref_counts(engine: Engine) -> None:
    """Each block's reference count is the number of live block tables holding it."""
    bm = engine.scheduler.block_manager
    refs: dict[int, int] = {}
    for seq in live_seqs(engine):
        for b in seq.block_table:
            refs[b] = refs.get(b, 0) + 1
    assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == refs
    assert bm.used_block_ids == set(refs)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == len(bm.blocks)


def run(engine: Engine, on_step=None, limit: int = 3000) -> int:
    """Step until done, checking the reference counts after every step; all must be freed after."""
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        check_ref_counts(engine)
        if on_step is not None:
            on_step(steps)
        assert steps < limit, "engine did not finish"
    engine.take_expired()
    bm = engine.scheduler.block_manager
    assert bm.num_used_blocks == 0 and not engine.seqs and not engine.scheduler.forks
    return steps


def outputs(seq: Sequence) -> list[tuple[list[int], FinishReason]]:
    return [(s.completion_token_ids, s.finish_reason) for s in seq.group]


def alone(model_dir, prompt: list[int], params: SamplingParams, index: int) -> tuple[list[int], FinishReason]:
    """Sample `index` of params run as a request of its own with n = 1."""
    seed = params.sample_seed(index)
    engine, _ = make_engine(model_dir)
    one = SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens, seed=seed,
                         ignore_eos=params.ignore_eos)
    seq = engine.add_request(prompt, one)
    run(engine)
    return seq.completion_token_ids, seq.finish_reason


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7 + salt) % (VOCAB - 1) for i in range(length)]


@pytest.mark.parametrize("length", [1, 3, 4, 8, 9, 13])  # multiples of the block size and not
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_samples_share_the_prompt_and_equal_their_seeds_alone(model_dir, length, depth):
    engine, dp = make_engine(model_dir, depth=depth)
    prompt = prompt_of(length)
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=9)
    seq = engine.add_request(prompt, params)
    bm = engine.scheduler.block_manager
    seen = []

    def watch(step):
        # No block is taken for the prompt twice: the samples' tables share its full blocks.
        seen.append(bm.num_used_blocks)
        tables = [s.block_table for s in seq.group if s.block_table]
        if len(tables) == 4:
            full = (length - 1) // BS
            assert all(t[:full] == tables[0][:full] for t in tables)
            assert len({t[full] for t in tables}) == 4

    run(engine, watch)
    got = outputs(seq)
    assert [alone(model_dir, prompt, params, i) for i in range(4)] == got
    assert len({tuple(t) for t, _ in got}) > 1, "the samples should differ"
    assert engine.scheduler.num_forks == 3 and engine.scheduler.num_preemptions == 0
    # Prompt blocks allocated once: the prompt travels once as token ids, forks compute one token each.
    admitted = [r for d in dp.descriptors for r in d.new_requests]
    assert [r.num_cached_tokens for r in admitted] == [0] + [length - 1] * 3
    copies = [(s, t) for d in dp.descriptors for s, t in zip(d.copy_src.tolist(), d.copy_dst.tolist(), strict=True)]
    assert len(copies) == 3 and len({s for s, _ in copies}) == 1
    assert sum(int(d.num_scheduled.sum()) for d in dp.descriptors[:2]) <= length + 3 + 1


def test_greedy_samples_all_equal_the_greedy_run(model_dir):
    engine, _ = make_engine(model_dir)
    params = SamplingParams(temperature=0, n=3, max_tokens=12)
    seq = engine.add_request(prompt_of(10), params)
    run(engine)
    assert outputs(seq) == [alone(model_dir, prompt_of(10), params, 0)] * 3


def test_each_sample_ends_on_its_own(model_dir):
    """Sampling from 40 tokens with EOS among them: some samples stop early, others reach max_tokens."""
    engine, _ = make_engine(model_dir)
    params = SamplingParams(temperature=1.0, seed=3, n=12, max_tokens=30)
    seq = engine.add_request(prompt_of(6), params)
    run(engine)
    reasons = {r for _, r in outputs(seq)}
    assert reasons == {FinishReason.EOS, FinishReason.LENGTH}
    for tokens, reason in outputs(seq):
        assert (reason is FinishReason.EOS) == (tokens[-1] == EOS) and len(tokens) <= 30


@pytest.mark.parametrize("depth", [0, 1])
def test_forks_under_preemption_give_the_unpressured_outputs(model_dir, depth):
    """A cache too small for all samples at once: forks and sample 0 are preempted and recomputed."""
    prompts = [prompt_of(9, 1), prompt_of(6, 2)]
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=14, ignore_eos=True)
    free_engine, _ = make_engine(model_dir, depth=depth)
    free = [free_engine.add_request(p, params) for p in prompts]
    run(free_engine)
    engine, _ = make_engine(model_dir, num_blocks=12, depth=depth)
    seqs = [engine.add_request(p, params) for p in prompts]
    preempted, preempt = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.sample_index), preempt(seq))
    run(engine)
    assert any(preempted)  # forks were preempted and recomputed from the prefix cache
    assert [outputs(s) for s in seqs] == [outputs(s) for s in free]


@pytest.mark.parametrize("depth", [0, 1])
def test_forks_wait_for_sample_0_preempted_before_they_joined(model_dir, depth):
    """Two blocks: the older request's first decode step takes sample 0's block before its forks can
    join; they wait for its prompt to be computed again (or run on their own once it ends)."""
    engine, _ = make_engine(model_dir, num_blocks=2, depth=depth)
    first = engine.add_request(prompt_of(4, 5), SamplingParams(temperature=1.0, seed=4, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=1.0, seed=8, n=3, max_tokens=4, ignore_eos=True)
    seq = engine.add_request(prompt_of(4), params)
    preempted, preempt = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda s: (preempted.append((s.sample_index, engine.scheduler.num_forks)), preempt(s))
    run(engine)
    assert (0, 0) in preempted and first.finish_reason is FinishReason.LENGTH
    assert outputs(seq) == [alone(model_dir, prompt_of(4), params, i) for i in range(3)]


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("at", [1, 2, 3, 6])
def test_abort_mid_run_frees_everything(model_dir, depth, at):
    engine, dp = make_engine(model_dir, depth=depth)
    keep = engine.add_request(prompt_of(7, 3), SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    gone = engine.add_request(prompt_of(10), SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=20,
                                                            ignore_eos=True))
    run(engine, lambda step: engine.abort(gone.seq_id) if step == at else None)
    assert all(s.finish_reason is FinishReason.ABORT for s in gone.group)
    assert keep.finish_reason is FinishReason.LENGTH and len(keep.completion_token_ids) == 20
    assert sorted(engine.scheduler.free_slots) == list(range(8))


def test_sample_0_ending_first_sends_its_forks_through_the_prefix_cache(model_dir):
    """max_tokens=1 and every step waited for: sample 0 is done before its forks can join it; they
    then run as requests of their own, their prompt's full blocks found in the prefix cache."""
    engine, dp = make_engine(model_dir)
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=1)
    seq = engine.add_request(prompt_of(10), params)
    run(engine)
    assert engine.scheduler.num_forks == 0
    assert engine.scheduler.block_manager.num_cache_hits == 2 * 2  # two full blocks for each fork
    assert outputs(seq) == [alone(model_dir, prompt_of(10), params, i) for i in range(3)]


def test_expired_request_takes_its_forks_along(model_dir):
    engine, _ = make_engine(model_dir, max_num_seqs=1)
    engine.add_request(prompt_of(5), SamplingParams(max_tokens=30, ignore_eos=True))
    late = engine.add_request(prompt_of(5, 1), SamplingParams(n=3), deadline=0.0)
    engine.step()
    assert engine.take_expired() == [late] and not engine.scheduler.forks
    run(engine)
    assert all(s.finish_reason is FinishReason.ABORT and not s.block_table for s in late.group)


def test_fork_shares_full_blocks_and_balances_ref_counts():
    bm = BlockManager(10, BS)
    params = SamplingParams(n=2)
    parent, child = Sequence(list(range(1, 11)), params, BS), Sequence(list(range(1, 11)), params, BS)
    bm.allocate(parent, 0)
    parent.num_computed_tokens = 10
    bm.hash_blocks(parent)
    src, dst = bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2] and src == parent.block_table[2] != dst
    assert child.block_table[2] == dst and child.num_computed_tokens == 9
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1] and bm.num_used_blocks == 4
    bm.deallocate(parent)
    assert bm.num_used_blocks == 3
    bm.deallocate(child)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10


def test_forks_draw_with_their_own_seed_and_leave_prompt_logprobs_to_sample_0(model_dir):
    engine, dp = make_engine(model_dir)
    seq = engine.add_request(prompt_of(6), SamplingParams(temperature=1.0, seed=20, n=3, prompt_logprobs=2))
    run(engine)
    specs = {r.request_id: r.sampling for d in dp.descriptors for r in d.new_requests}
    assert [specs[s.seq_id].seed for s in seq.group] == [20, 21, 22]
    assert [specs[s.seq_id].prompt_logprobs for s in seq.group] == [2, -1, -1]
    assert [s.prompt_logprobs is None for s in seq.group] == [False, True, True]


@pytest.mark.parametrize("policy", ["prefill-first", "mixed"])
def test_more_samples_than_slots(model_dir, policy):
    """Two slots for five samples: forks join as slots free up, the rest run on their own after sample 0."""
    engine, dp = make_engine(model_dir, max_num_seqs=2, scheduling_policy=policy, max_num_batched_tokens=8)
    params = SamplingParams(temperature=1.0, seed=30, n=5, max_tokens=6, ignore_eos=True)
    seq = engine.add_request(prompt_of(11), params)
    run(engine)
    assert all(d.num_rows <= 2 and int(d.num_scheduled.sum()) <= 8 for d in dp.descriptors)
    assert outputs(seq) == [alone(model_dir, prompt_of(11), params, i) for i in range(5)]
