"""The per-slot processor state a rank takes from NewRequest: what it keeps, what it refuses, and the
penalty counts rebuilt on the device from a preempted request's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoplane.dataplane.batch_state import BatchState, StepRefused
from nanoplane.dataplane.logits_processing import POOL_GROWTH, PenaltyState
from nanoplane.proto.plane import NewRequest, SamplingSpec, StepDescriptor, int32_column

VOCAB = 50


def admit(state: BatchState, spec: SamplingSpec, tokens=(1, 2, 3, 4), prompt: int = -1, slot: int = 0) -> None:
    req = NewRequest(slot, slot, int32_column(tokens), int32_column([0]), 0, spec, prompt)
    state.apply(StepDescriptor(0, new_requests=[req]))


def fresh() -> BatchState:
    return BatchState(num_slots=4, max_model_len=32, block_size=16, device=torch.device("cpu"), vocab_size=VOCAB)


def test_processor_fields_are_kept_per_slot():
    state = fresh()
    spec = SamplingSpec(0.0, presence_penalty=0.5, min_tokens=3, stop_ids=int32_column([7]),
                        logit_bias_ids=int32_column([4]), logit_bias_values=np.array([2.0], np.float32), logprobs=2)
    admit(state, spec, prompt=3, slot=2)
    assert state.num_prompt[2] == 3 and state.presence[2] == 0.5 and state.min_tokens[2] == 3
    assert state.penalised[2] and state.processes[2] and state.has_bias[2] and state.tail[2]
    assert state.logprobs[2] == 2 and state.prompt_logprobs[2] == -1
    admit(state, SamplingSpec(0.0), slot=1)
    assert state.num_prompt[1] == 4 and not state.tail[1]  # -1: the whole of token_ids is the prompt


@pytest.mark.parametrize("spec,prompt,match", [
    (SamplingSpec(logit_bias_ids=int32_column([VOCAB]), logit_bias_values=np.array([1.0], np.float32)), -1,
     "outside the vocabulary"),
    (SamplingSpec(min_tokens=2, stop_ids=int32_column([-1])), -1, "outside the vocabulary"),
    (SamplingSpec(logit_bias_ids=int32_column([3, 3]), logit_bias_values=np.array([1.0, 2.0], np.float32)), -1,
     "once each"),
    (SamplingSpec(logit_bias_ids=int32_column([3]), logit_bias_values=np.zeros(2, np.float32)), -1, "pair up"),
    (SamplingSpec(repetition_penalty=0.0), -1, "out of range"),
    (SamplingSpec(frequency_penalty=float("nan")), -1, "out of range"),
    (SamplingSpec(logprobs=VOCAB + 1), -1, "logprobs"),
    (SamplingSpec(prompt_logprobs=-2), -1, "prompt_logprobs"),
    (SamplingSpec(), 5, "prompt tokens"),
    (SamplingSpec(), 0, "prompt tokens"),
])
def test_bad_processor_fields_are_refused(spec, prompt, match):
    with pytest.raises(StepRefused, match=match):
        admit(fresh(), spec, prompt=prompt)


def test_penalty_counts_rebuilt_from_a_preempted_requests_tokens():
    state = fresh()
    pen = PenaltyState(4, VOCAB, torch.device("cpu"))
    upload = (lambda *arrays: [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
    spec = SamplingSpec(0.0, frequency_penalty=1.0, repetition_penalty=1.2)
    req = NewRequest(0, 1, int32_column([5, 6, 5, 9, 9, 9, 5]), int32_column([0]), 0, spec, 3)
    state.apply(StepDescriptor(0, new_requests=[req]))
    pen.admit([req], state, upload)
    row = pen.row_of[1]
    assert pen.counts.shape[0] == POOL_GROWTH
    assert pen.counts[row].nonzero().flatten().tolist() == [5, 9]
    assert pen.counts[row, 9] == 3 and pen.counts[row, 5] == 1  # the output after the 3 prompt tokens
    assert pen.seen[row].nonzero().flatten().tolist() == [5, 6]
    # A slot freed and taken again starts from zero.
    pen.release(int32_column([1]))
    plain = NewRequest(1, 1, int32_column([1, 2]), int32_column([0]), 0, SamplingSpec(0.0, presence_penalty=1.0))
    state.apply(StepDescriptor(1, free_slots=int32_column([1]), new_requests=[plain]))
    pen.admit([plain], state, upload)
    assert pen.row_of[1] == row and not pen.counts[row].any() and not pen.seen[row].any()
