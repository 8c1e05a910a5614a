"""Structured output in the engine, with a fake data plane that obeys the masks: masks for the rows
that sample under a grammar, a grammar row sitting out steps while its token is in flight (other rows
go on), the end of a complete grammar, and the matcher released on preemption, abort and finish."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
from support.tiny_models import VOCAB, make_tokenizer

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.engine_loop import EngineLoop
from nanoplane.controlplane.front import Stream, read_stream
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason
from nanoplane.proto.plane import PlaneInfo, StepDescriptor, StepResult

MODEL_VOCAB = VOCAB + 64
WIDTH = (MODEL_VOCAB + 31) // 32


class MaskingDataPlane:
    """Keeps steps in flight (submit/collect). A masked row samples the highest allowed id (EOS only when
    nothing else is allowed); an unmasked row samples a token fixed by its request and position."""

    def __init__(self, eos: int, num_blocks: int = 64, obey: bool = True):
        self.eos, self.num_blocks, self.obey = eos, num_blocks, obey
        self.descriptors: list[StepDescriptor] = []
        self.queue: list[StepResult] = []
        self.slot_req: dict[int, int] = {}
        self.collected: set[int] = set()
        self.masked_at: dict[int, int] = {}  # slot -> the last step that sampled it under a mask
        self.held_back = 0  # masked rows whose previous token was still in flight (must stay 0)

    def start(self) -> list[PlaneInfo]:
        return [PlaneInfo(0, 1, 0, self.num_blocks, 16, 8, 512, MODEL_VOCAB, "Fake", "cpu", "float32")]

    def execute(self, desc: StepDescriptor) -> StepResult:
        self.submit(desc)
        return self.collect(desc.step_id)

    def _run(self, desc: StepDescriptor) -> StepResult:
        self.descriptors.append(desc)
        for req in desc.new_requests:
            self.slot_req[req.slot] = req.request_id
            self.masked_at.pop(req.slot, None)
        rows = desc.bitmask_rows.tolist()
        for r in rows:
            slot = int(desc.slots[r])
            self.held_back += self.masked_at.get(slot, -1) not in self.collected | {-1}
            self.masked_at[slot] = desc.step_id
        assert rows == sorted(rows) and desc.bitmask.shape == (len(rows), WIDTH if rows else 0)
        tokens = []
        for r, slot in enumerate(desc.slots.tolist()):
            pos = int(desc.num_computed[r] + desc.num_scheduled[r])
            token = 40 + (self.slot_req[slot] * 7 + pos) % 200
            if r in rows and self.obey:
                bits = np.unpackbits(desc.bitmask[rows.index(r)].view(np.uint8), bitorder="little")
                allowed = [t for t in np.flatnonzero(bits).tolist() if t != self.eos]
                token = allowed[-1] if allowed else self.eos
            tokens.append(token)
        return StepResult(desc.step_id, np.asarray(tokens, dtype=np.int32))

    def submit(self, desc: StepDescriptor) -> None:
        self.queue.append(self._run(desc))

    def collect(self, step_id: int) -> StepResult:
        self.collected.add(step_id)
        result = self.queue.pop(0)
        assert result.step_id == step_id
        return result

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir)


def make_engine(model_dir, tok, depth=2, **kw) -> tuple[Engine, MaskingDataPlane]:
    plane = MaskingDataPlane(tok.eos_token_id, kw.pop("num_blocks", 64), kw.pop("obey", True))
    cfg = EngineConfig(str(model_dir), device="cpu", kvcache_block_size=16, max_num_seqs=8, steps_in_flight=depth,
                       **kw)
    return Engine(cfg, plane, (tok.eos_token_id,), overlap=depth > 0), plane


def run(engine: Engine) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 2000
    return steps


DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_grammar_rows_get_masks_and_sit_out_while_their_token_is_in_flight(model_dir, tok, depth):
    engine, plane = make_engine(model_dir, tok, depth)
    grammar = [engine.add_request(tok.encode("the fox"), SamplingParams(max_tokens=20, structured=s))
               for s in ({"regex": DATE}, {"choice": ["quick brown", "lazy dog"]},
                         {"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                          "required": ["ok"], "additionalProperties": False}})]
    plain = engine.add_request(tok.encode("the dog"), SamplingParams(max_tokens=12, ignore_eos=True))
    run(engine)
    texts = [tok.decode(s.completion_token_ids) for s in grammar]
    assert re.fullmatch(DATE, texts[0]) and texts[1] in ("quick brown", "lazy dog")
    assert json.loads(texts[2]) in ({"ok": True}, {"ok": False})
    # A complete grammar ends the output at once (its forced end-of-sequence unsampled): STOP, no stop_reason.
    assert all(s.finish_reason is FinishReason.STOP and s.stop_reason is None for s in grammar)
    assert plain.finish_reason is FinishReason.LENGTH and plain.num_completion_tokens == 12
    slot_of = {r.request_id: r.slot for d in plane.descriptors for r in d.new_requests}
    prompt = len(tok.encode("the fox"))
    for d in plane.descriptors:
        for r, slot in enumerate(d.slots.tolist()):
            if slot in (slot_of[s.seq_id] for s in grammar):  # a grammar row that samples has a mask
                assert (d.num_computed[r] + d.num_scheduled[r] < prompt) != (r in d.bitmask_rows.tolist())
    assert plane.held_back == 0  # never masked from a state that missed its previous token
    if depth == 2:  # the plain row was not held back by the grammar rows' pauses
        plain_steps = [d.step_id for d in plane.descriptors if slot_of[plain.seq_id] in d.slots.tolist()]
        assert plain_steps == list(range(plain_steps[0], plain_steps[0] + len(plain_steps)))
    assert engine.num_mask_steps > 0 and engine.num_mask_rows >= sum(len(t) for t in texts) // 4
    assert all(s.grammar.matcher is None for s in grammar)  # released at finish
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_preemption_releases_the_matcher_and_readmission_replays_it(model_dir, tok):
    # 6 blocks of 16 tokens for four requests that each grow past two blocks: some are preempted.
    engine, plane = make_engine(model_dir, tok, 2, num_blocks=6)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20},
                                               "b": {"type": "integer"}}, "required": ["a", "b"]}
    seqs = [engine.add_request(tok.encode("the lazy dog " * 2), SamplingParams(max_tokens=24, structured={
        "json_schema": schema})) for _ in range(4)]
    released = []
    preempt = engine.scheduler.preempt

    def spy(seq):
        preempt(seq)
        released.append(seq.grammar.matcher is None)

    engine.scheduler.preempt = spy
    run(engine)
    assert released and all(released)
    for s in seqs:
        text = tok.decode(s.completion_token_ids)
        assert s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), s.finish_reason
        if s.finish_reason is FinishReason.STOP:
            assert set(json.loads(text)) == {"a", "b"}
        else:  # a prefix the grammar allows: the replayed matcher took every token
            assert s.grammar.num_tokens == 0 and text.startswith('{"a":"')


def test_a_preempted_request_whose_token_is_in_flight_catches_up(model_dir, tok):
    engine, plane = make_engine(model_dir, tok, 2)
    seq = engine.add_request(tok.encode("the fox"), SamplingParams(max_tokens=20, structured={"regex": DATE}))
    while not seq.num_completion_tokens:
        engine.step()
    engine.step()  # sends its next token's step
    assert seq.num_pending == 1
    engine.scheduler.running.remove(seq)  # as the scheduler does when the KV cache is full
    engine.scheduler.preempt(seq)
    assert seq.grammar.matcher is None
    run(engine)
    assert re.fullmatch(DATE, tok.decode(seq.completion_token_ids)) and seq.finish_reason is FinishReason.STOP
    assert plane.held_back == 0


def test_abort_mid_output_frees_blocks_and_grammar_state(model_dir, tok):
    engine, plane = make_engine(model_dir, tok, 2)
    seq = engine.add_request(tok.encode("the fox"), SamplingParams(max_tokens=40, structured={
        "json_schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}))
    for _ in range(9):
        engine.step()
    assert seq.num_completion_tokens > 3 and not seq.is_finished and seq.grammar.matcher is not None
    engine.abort(seq.seq_id)
    assert seq.finish_reason is FinishReason.ABORT and seq.grammar.matcher is None
    run(engine)
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_token_outside_the_mask_aborts_the_request(model_dir, tok):
    engine, plane = make_engine(model_dir, tok, 0, obey=False)
    seq = engine.add_request(tok.encode("the fox"), SamplingParams(max_tokens=10, structured={"regex": "[0-9]+"}))
    run(engine)
    assert seq.finish_reason is FinishReason.ABORT and seq.num_completion_tokens == 1
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_grammar_that_does_not_compile_queues_nothing(model_dir, tok):
    engine, _ = make_engine(model_dir, tok)
    with pytest.raises(ValueError, match=r"(?s)structured\.regex.*unclosed character class"):
        engine.add_request(tok.encode("the fox"), SamplingParams(structured={"regex": "[0-9"}))
    assert not engine.has_work() and not engine.seqs


def test_the_engine_loop_compiles_before_the_add_and_reports_errors_to_the_stream(model_dir, tok):
    engine, _ = make_engine(model_dir, tok)

    async def main():
        deliveries = []
        loop = asyncio.get_running_loop()

        def deliver(batch):
            for stream, item in batch:
                loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            deliveries.extend(batch)

        engine_loop = EngineLoop(engine, deliver)
        engine_loop.start()
        good = Stream("good", tok.encode("the fox"),
                      SamplingParams(max_tokens=20, structured={"choice": ["yes", "no"]}))
        bad = Stream("bad", tok.encode("the fox"), SamplingParams(structured={"grammar": "start: nothing_defined"}))
        engine_loop.add_stream(good)
        engine_loop.add_stream(bad)
        outs = [o async for o in read_stream(good)]
        with pytest.raises(ValueError, match="structured.grammar"):
            async for _ in read_stream(bad):
                pass
        engine_loop.shutdown()
        return outs

    outs = asyncio.run(main())
    text = tok.decode([t for o in outs for t in o.token_ids])
    assert text in ("yes", "no") and outs[-1].finish_reason is FinishReason.STOP


def test_a_request_aborted_while_its_grammar_compiles_never_runs(model_dir, tok):
    from concurrent.futures import Future

    engine, _ = make_engine(model_dir, tok)
    compiled = engine.grammars.compile({"regex": "[0-9]+"})
    pending: Future = Future()
    engine.grammars.submit = lambda structured: pending  # a compile that takes its time
    added = []
    add_request = engine.add_request
    engine.add_request = lambda *a, **kw: added.append(add_request(*a, **kw))

    async def main():
        loop = asyncio.get_running_loop()

        def deliver(batch):
            for stream, item in batch:
                loop.call_soon_threadsafe(stream.queue.put_nowait, item)

        engine_loop = EngineLoop(engine, deliver)
        engine_loop.start()
        stream = Stream("s", tok.encode("the fox"), SamplingParams(structured={"regex": "[0-9]+"}))
        engine_loop.add_stream(stream)
        engine_loop.abort_stream(stream, True)
        outs = [o async for o in read_stream(stream)]
        pending.set_result(compiled)
        for _ in range(100):  # the add that follows the compile is dropped on the engine thread
            if not engine_loop._aborted_compiling:
                break
            await asyncio.sleep(0.01)
        assert not engine_loop._compiling and not engine_loop._aborted_compiling
        engine_loop.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [(o.finished, o.finish_reason, o.token_ids) for o in outs] == [(True, FinishReason.ABORT, [])]
    assert not added and not engine.has_work()

