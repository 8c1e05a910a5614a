"""The waiting queue's bounds and deadlines, in the scheduler and the engine (fake data plane, no model)."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.errors import DeadlineExceeded, failure_error, failure_kind, status_for
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.scheduler import QueueFull
from nanoplane.controlplane.sequence import FinishReason, SequenceStatus
from nanoplane.proto import engine_link as link
from tests.unit.test_scheduler import make_engine, run


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Fake"], "max_position_embeddings": 512}))
    return str(tmp_path)


def test_the_request_bound_refuses_the_one_past_it_and_queues_nothing(model_dir):
    engine, _ = make_engine(model_dir, max_queued_requests=2)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull, match=r"2 requests are waiting \(--max-queued-requests 2\); retry later"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert len(engine.scheduler.waiting) == 2 and len(engine.seqs) == 2
    engine.step()  # both admitted: the queue has room again
    assert not engine.scheduler.waiting
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    run(engine)
    assert engine.scheduler.block_manager.num_used_blocks == 0 and not engine.seqs


def test_the_token_bound_counts_waiting_prompts_and_takes_any_prompt_into_an_empty_queue(model_dir):
    engine, _ = make_engine(model_dir, max_queued_tokens=10)
    engine.add_request(list(range(1, 31)), SamplingParams(max_tokens=2))  # 30 > 10, but nothing waits
    with pytest.raises(QueueFull, match="30 prompt tokens are waiting and this request's 1 would pass "
                                        "--max-queued-tokens 10"):
        engine.add_request([1], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.scheduler.waiting.num_prompt_tokens == 0
    engine.add_request(list(range(1, 7)), SamplingParams(max_tokens=2))
    engine.add_request(list(range(1, 5)), SamplingParams(max_tokens=2))  # 6 + 4 = 10: at the bound, not past
    with pytest.raises(QueueFull):
        engine.add_request([1], SamplingParams(max_tokens=2))
    run(engine)
    assert engine.scheduler.waiting.num_prompt_tokens == 0


def test_negative_bounds_are_refused(model_dir):
    with pytest.raises(ValueError, match="max_queued_requests and max_queued_tokens must be >= 0"):
        EngineConfig(model_dir, max_queued_requests=-1)


def test_an_expired_waiting_request_is_dropped_before_prefill_and_frees_everything(model_dir):
    engine, dp = make_engine(model_dir, max_num_seqs=1)
    bm = engine.scheduler.block_manager
    long = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20))
    engine.step()  # long holds the only slot
    used = bm.num_used_blocks
    late = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=5), deadline=time.monotonic() + 0.05)
    kept = engine.add_request([4, 5], SamplingParams(max_tokens=2), deadline=time.monotonic() + 3600)
    engine.step()
    assert late.status is SequenceStatus.WAITING and not engine.take_expired()
    time.sleep(0.06)
    engine.step()
    assert late.finish_reason is FinishReason.ABORT and late.num_computed_tokens == 0 and not late.block_table
    assert engine.take_expired() == [late] and late.seq_id not in engine.seqs
    assert engine.take_expired() == []  # taken once
    assert late not in engine.scheduler.waiting and bm.num_used_blocks == used
    assert all(late.seq_id not in [r.request_id for r in d.new_requests] for d in dp.descriptors)
    run(engine)
    assert long.finish_reason is FinishReason.LENGTH and kept.finish_reason is FinishReason.LENGTH
    assert bm.num_used_blocks == 0 and engine.scheduler.num_expired == 1


def test_a_started_request_is_not_dropped_for_its_deadline(model_dir):
    engine, _ = make_engine(model_dir)
    seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5), deadline=time.monotonic() + 0.02)
    engine.step()  # admitted and prefilled
    time.sleep(0.03)
    run(engine)
    assert seq.finish_reason is FinishReason.LENGTH and not engine.take_expired()


def test_requests_without_deadlines_keep_no_deadline_entries(model_dir):
    engine, _ = make_engine(model_dir)
    for _ in range(3):
        engine.add_request([1, 2], SamplingParams(max_tokens=1))
    assert not engine.scheduler._deadlines
    run(engine)


def test_deadline_entries_of_ended_requests_are_swept(model_dir):
    engine, _ = make_engine(model_dir, max_num_seqs=8)
    for _ in range(200):
        engine.add_request([1, 2], SamplingParams(max_tokens=1), deadline=time.monotonic() + 3600)
    run(engine)
    assert len(engine.scheduler._deadlines) <= 64


@pytest.mark.parametrize("error, kind, code", [
    (QueueFull("the server's queue is full"), link.EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded("the request's deadline passed"), link.DEADLINE, grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_refusals_cross_the_link_and_map_to_their_status(error, kind, code):
    assert failure_kind(error) == kind
    again = failure_error(kind, str(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert status_for(again) == (code, str(error))
