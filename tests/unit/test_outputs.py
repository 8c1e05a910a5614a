"""The control plane's outputs of one sample, on CPU with a scripted data plane (vLLM v1's way: step
results made by hand): logprobs and prompt logprobs into the sequence, finish reasons, stop_reason,
min_tokens, and prompt logprobs bypassing the prefix cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.logprobs import take_prompt_logprobs
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob, Sequence
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult, int32_column

VOCAB, EOS, BLOCK = 100, 0, 16


def token_at(req: int, pos: int) -> int:
    """The token a request 'samples' at position pos: never EOS, never the stop ids the tests use (90+)."""
    return 1 + (req * 31 + pos * 7) % 89


def row_logprobs(token: int, pos: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """What the plane says about a position: the token's logprob and rank and the top k."""
    return -0.01 * token - 0.001 * pos, 1 + token % 3, [(token + j) % VOCAB for j in range(k)], \
        [-0.1 * (j + 1) - 0.001 * pos for j in range(k)]


class ScriptedPlane:
    """A data plane that samples token_at(request, position), or a scripted token, and fills the
    logprob arrays as proto/plane.py's StepResult describes them; keeps steps in flight if asked."""

    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 8):
        self.num_blocks, self.max_num_seqs = num_blocks, max_num_seqs
        self.slots: dict[int, tuple[int, list[int], int, object]] = {}  # slot -> (request, tokens, prompt, spec)
        self.script: dict[tuple[int, int], int] = {}  # (request, position) -> token sampled there
        self.new_requests = []
        self.queue: list[StepResult] = []

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, self.num_blocks, BLOCK, self.max_num_seqs, 512, VOCAB, "Fake", "cpu", "float32")]

    def execute(self, desc: StepDescriptor) -> StepResult:
        for slot in desc.free_slots.tolist():
            self.slots.pop(slot, None)
        for req in desc.new_requests:
            prompt = req.num_prompt_tokens if req.num_prompt_tokens >= 0 else len(req.token_ids)
            self.slots[req.slot] = (req.request_id, req.token_ids.tolist(), prompt, req.sampling)
            self.new_requests.append(req)
        tokens, lp_rows, p_rows = [], [], []
        for r, slot in enumerate(desc.slots.tolist()):
            req, ids, prompt, spec = self.slots[slot]
            start, end = int(desc.num_computed[r]), int(desc.num_computed[r] + desc.num_scheduled[r])
            token = self.script.get((req, end), token_at(req, end))
            tokens.append(token)
            if end >= len(ids):  # the row samples: its token joins the slot's tokens
                ids.append(token)
                if spec.logprobs >= 0:
                    lp_rows.append((r, token, end, spec.logprobs))
            last = min(end, prompt - 1)
            if spec.prompt_logprobs >= 0 and start + 1 <= last:
                p_rows.append((r, start + 1, [(ids[p], p) for p in range(start + 1, last + 1)], spec.prompt_logprobs))
        return self._result(desc.step_id, tokens, lp_rows, p_rows)

    def _result(self, step_id, tokens, lp_rows, p_rows) -> StepResult:
        res = StepResult(step_id, np.asarray(tokens, np.int32))
        if lp_rows:
            k = max(n for *_, n in lp_rows)
            res.logprob_rows = int32_column([r for r, *_ in lp_rows])
            cols = [row_logprobs(t, pos, k) for _, t, pos, _ in lp_rows]
            res.sampled_logprobs = np.asarray([c[0] for c in cols], np.float32)
            res.sampled_ranks = int32_column([c[1] for c in cols])
            # A row that asked fewer than k is padded with id -1.
            res.top_ids = np.asarray([c[2][:n] + [-1] * (k - n) for c, (*_, n) in zip(cols, lp_rows, strict=True)],
                                     np.int32).reshape(len(lp_rows), k)
            res.top_logprobs = np.asarray([c[3] for c in cols], np.float32).reshape(len(lp_rows), k)
        if p_rows:
            k = max(n for *_, n in p_rows)
            cols = [row_logprobs(t, p, k) for *_, given, _ in p_rows for t, p in given]
            res.prompt_rows = int32_column([r for r, *_ in p_rows])
            res.prompt_starts = int32_column([s for _, s, *_ in p_rows])
            res.prompt_offsets = int32_column(np.cumsum([0] + [len(g) for _, _, g, _ in p_rows]))
            res.prompt_token_logprobs = np.asarray([c[0] for c in cols], np.float32)
            res.prompt_token_ranks = int32_column([c[1] for c in cols])
            res.prompt_top_ids = np.asarray([c[2] for c in cols], np.int32).reshape(len(cols), k)
            res.prompt_top_logprobs = np.asarray([c[3] for c in cols], np.float32).reshape(len(cols), k)
        return res

    def submit(self, desc: StepDescriptor) -> None:
        self.queue.append(self.execute(desc))

    def collect(self, step_id: int) -> StepResult:
        result = self.queue.pop(0)
        assert result.step_id == step_id
        return result

    def close(self) -> None:
        pass


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    return str(tmp_path)


def make_engine(model_dir, depth: int = 0, num_blocks: int = 64, **kw) -> tuple[Engine, ScriptedPlane]:
    plane = ScriptedPlane(num_blocks)
    cfg = EngineConfig(model_dir, device="cpu", kvcache_block_size=BLOCK, max_num_seqs=8, steps_in_flight=depth, **kw)
    return Engine(cfg, plane, (EOS,), overlap=depth > 0), plane


def run(engine: Engine) -> None:
    for _ in range(2000):
        if not engine.has_work():
            assert engine.scheduler.block_manager.num_used_blocks == 0
            return
        engine.step()
    raise AssertionError("engine did not finish")


def expected_logprob(token: int, pos: int, n: int) -> Logprob:
    lp, rank, ids, lps = row_logprobs(token, pos, n)
    top = [(i, float(np.float32(x))) for i, x in zip(ids, lps, strict=True)]
    return Logprob(token, float(np.float32(lp)), rank, top)


def check_logprobs(seq: Sequence) -> None:
    """Entry i is output token i's, at its position, with the request's own number of alternatives."""
    n, out = seq.params.logprobs, seq.completion_token_ids
    assert len(seq.logprobs) == len(out)
    for i, (token, entry) in enumerate(zip(out, seq.logprobs, strict=True)):
        assert entry == expected_logprob(token, seq.num_prompt_tokens + i, n)


def check_prompt_logprobs(seq: Sequence) -> None:
    """Entry p is prompt position p's (None for the first), each position once."""
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        assert seq.prompt_logprobs[p] == expected_logprob(prompt[p], p, seq.params.prompt_logprobs)


@pytest.mark.parametrize("depth", [0, 2])
def test_logprobs_reach_the_rows_that_asked_and_only_those(model_dir, depth):
    engine, plane = make_engine(model_dir, depth, max_num_batched_tokens=24)  # prompts chunked
    seqs = [engine.add_request(list(range(5, 5 + 40 + i)), SamplingParams(max_tokens=9, logprobs=n))
            for i, n in enumerate([None, 0, 3, 20, None])]
    run(engine)
    assert seqs[0].logprobs is None and seqs[4].logprobs is None
    for seq in seqs[1:4]:
        assert seq.finish_reason is FinishReason.LENGTH
        check_logprobs(seq)
    assert seqs[1].logprobs[0].top == [] and len(seqs[3].logprobs[0].top) == 20
    assert [r.sampling.logprobs for r in plane.new_requests] == [-1, 0, 3, 20, -1]


@pytest.mark.parametrize("depth", [0, 2])
def test_prompt_logprobs_cover_each_prompt_position_once_across_chunks(model_dir, depth):
    engine, _ = make_engine(model_dir, depth, max_num_batched_tokens=20)
    seqs = [engine.add_request(list(range(3, 3 + length)), SamplingParams(max_tokens=4, prompt_logprobs=n))
            for length, n in [(1, 2), (17, 0), (55, 5), (30, None)]]
    run(engine)
    assert seqs[0].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    check_prompt_logprobs(seqs[1])
    check_prompt_logprobs(seqs[2])
    assert seqs[3].prompt_logprobs is None and seqs[2].logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache(model_dir):
    engine, plane = make_engine(model_dir)
    prompt = list(range(10, 10 + 3 * BLOCK + 5))
    engine.add_request(prompt, SamplingParams(max_tokens=2))
    run(engine)
    cached = engine.add_request(prompt, SamplingParams(max_tokens=2))
    scored = engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    run(engine)
    assert cached.num_cached_prompt_tokens == 3 * BLOCK  # the prefix cache holds the prompt ...
    assert scored.num_cached_prompt_tokens == 0 and plane.new_requests[-1].num_cached_tokens == 0  # ... unused
    check_prompt_logprobs(scored)


def test_preempted_request_keeps_one_entry_per_position(model_dir):
    """Preemption recomputes prompt and output: logprobs stay one per output token, prompt logprobs
    are not asked for again, and the outputs equal an unpreempted run's."""
    def go(num_blocks: int) -> tuple[list[Sequence], Engine, ScriptedPlane]:  # 10 blocks force preemption
        engine, plane = make_engine(model_dir, 1, num_blocks=num_blocks, max_num_batched_tokens=64)
        seqs = [engine.add_request(list(range(7 + i, 7 + i + 30)),
                                   SamplingParams(max_tokens=40, logprobs=2, prompt_logprobs=1, ignore_eos=True))
                for i in range(3)]
        run(engine)
        return seqs, engine, plane

    for num_blocks in (64, 10):
        seqs, engine, plane = go(num_blocks)
        assert (engine.scheduler.num_preemptions > 0) == (num_blocks == 10)
        readmitted = [r for r in plane.new_requests if len(r.token_ids) > 30]
        assert all(r.sampling.prompt_logprobs == -1 and r.num_prompt_tokens == 30 for r in readmitted)
        assert len(readmitted) == engine.scheduler.num_preemptions
        for seq in seqs:
            assert seq.completion_token_ids == [token_at(seq.seq_id, 30 + i) for i in range(40)]
            check_logprobs(seq)
            check_prompt_logprobs(seq)


def test_prompt_logprobs_given_again_are_not_duplicated():
    seq = Sequence(list(range(20, 40)), SamplingParams(prompt_logprobs=1), BLOCK)
    plane = ScriptedPlane()

    def result(start: int, stop: int) -> StepResult:
        given = [(seq.token_ids[p], p) for p in range(start, stop)]
        return plane._result(0, [0], [], [(0, start, given, 1)])

    take_prompt_logprobs([seq], result(1, 10))
    take_prompt_logprobs([seq], result(1, 14))  # a recompute from the start: 10..13 are new
    take_prompt_logprobs([seq], result(14, 20))
    check_prompt_logprobs(seq)
    with pytest.raises(RuntimeError, match="from position 15"):  # a gap: positions 1..14 never came
        take_prompt_logprobs([Sequence(list(range(20, 40)), SamplingParams(prompt_logprobs=1), BLOCK)],
                             result(15, 16))


def test_prompt_ranks_from_the_top_list_when_the_plane_does_not_report_them():
    seq = Sequence([20, 21, 22], SamplingParams(prompt_logprobs=2), BLOCK)
    result = StepResult(0, int32_column([0]), prompt_rows=int32_column([0]), prompt_starts=int32_column([1]),
                        prompt_offsets=int32_column([0, 2]), prompt_token_logprobs=np.array([-1, -2], np.float32),
                        prompt_top_ids=np.array([[5, 21], [6, 7]], np.int32),
                        prompt_top_logprobs=np.array([[-0.5, -1], [-0.2, -0.3]], np.float32))
    take_prompt_logprobs([seq], result)
    assert [(e.token_id, e.rank) for e in seq.prompt_logprobs[1:]] == [(21, 2), (22, 0)]  # 0: not known


def finish(model_dir, params: SamplingParams, script: dict[int, int], depth: int = 0) -> Sequence:
    """Run one 10-token prompt whose output token i is script[i] where given."""
    engine, plane = make_engine(model_dir, depth)
    seq = engine.add_request(list(range(1, 11)), params)
    plane.script = {(seq.seq_id, 10 + i): t for i, t in script.items()}
    run(engine)
    return seq


@pytest.mark.parametrize("depth", [0, 1])
def test_finish_reasons_and_stop_reason(model_dir, depth):
    eos = finish(model_dir, SamplingParams(max_tokens=20, stop_token_ids=[95]), {3: EOS, 5: 95}, depth)
    assert (eos.finish_reason, eos.stop_reason, eos.completion_token_ids[-1]) == (FinishReason.EOS, None, EOS)
    assert eos.num_completion_tokens == 4
    stop = finish(model_dir, SamplingParams(max_tokens=20, stop_token_ids=[91, 95]), {2: 95, 5: EOS}, depth)
    assert (stop.finish_reason, stop.stop_reason, stop.completion_token_ids[-1]) == (FinishReason.STOP, 95, 95)
    assert stop.num_completion_tokens == 3  # the stop id is kept in the output
    length = finish(model_dir, SamplingParams(max_tokens=6, stop_token_ids=[95]), {}, depth)
    assert (length.finish_reason, length.stop_reason, length.num_completion_tokens) == (FinishReason.LENGTH, None, 6)
    # The last token allowed being EOS: the end-of-sequence token is the reason, not the length.
    last = finish(model_dir, SamplingParams(max_tokens=6), {5: EOS}, depth)
    assert (last.finish_reason, last.num_completion_tokens) == (FinishReason.EOS, 6)
    # ignore_eos: EOS does not end it, unless it is a stop id too.
    ignored = finish(model_dir, SamplingParams(max_tokens=8, ignore_eos=True), {1: EOS}, depth)
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.completion_token_ids[1] == EOS
    listed = finish(model_dir, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[EOS]), {1: EOS}, depth)
    assert (listed.finish_reason, listed.stop_reason) == (FinishReason.STOP, EOS)


@pytest.mark.parametrize("depth", [0, 1])
def test_min_tokens_holds_off_eos_and_stop_ids(model_dir, depth):
    # Output tokens 1-3 (indices 0-2) are EOS or a stop id: with min_tokens=4 none of them ends it.
    seq = finish(model_dir, SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=[95]),
                 {0: EOS, 1: 95, 2: EOS, 3: 95, 6: EOS}, depth)
    assert (seq.finish_reason, seq.stop_reason, seq.num_completion_tokens) == (FinishReason.STOP, 95, 4)
    seq = finish(model_dir, SamplingParams(max_tokens=20, min_tokens=3), {0: EOS, 1: EOS, 4: EOS}, depth)
    assert (seq.finish_reason, seq.num_completion_tokens) == (FinishReason.EOS, 5)
    seq = finish(model_dir, SamplingParams(max_tokens=5, min_tokens=5, stop_token_ids=[95]), {2: 95}, depth)
    assert (seq.finish_reason, seq.num_completion_tokens) == (FinishReason.LENGTH, 5)


def test_min_tokens_reaches_the_data_plane_with_the_ids_it_masks(model_dir):
    engine, plane = make_engine(model_dir)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[95, 91]))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, min_tokens=3, ignore_eos=True, stop_token_ids=[95]))
    run(engine)
    specs = [r.sampling for r in plane.new_requests]
    assert [s.min_tokens for s in specs] == [3, 3]
    assert specs[0].stop_ids.tolist() == [EOS, 91, 95] and specs[1].stop_ids.tolist() == [95]


def test_abort_and_stop_string_end_a_request_and_free_its_blocks(model_dir):
    engine, _ = make_engine(model_dir, 1)
    aborted = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50))
    stopped = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, stop=["x"]))
    for _ in range(4):
        engine.step()
    engine.abort(aborted.seq_id)
    engine.stop_on_string(stopped, "x")
    assert (aborted.finish_reason, aborted.stop_reason) == (FinishReason.ABORT, None)
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, "x")
    tokens = stopped.completion_token_ids
    run(engine)  # the step still in flight is collected and changes neither
    assert stopped.completion_token_ids == tokens and engine.scheduler.block_manager.num_used_blocks == 0
    # A stop string found in the text of the token that also ended the request takes over its reason.
    ended = finish(model_dir, SamplingParams(max_tokens=3), {})
    engine.stop_on_string(ended, "y")
    assert (ended.finish_reason, ended.stop_reason) == (FinishReason.STOP, "y")
