"""The data plane's per-slot state: admitted prompts land in the token buffer in one upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoplane.dataplane.batch_state import BatchState, StepRefused
from nanoplane.proto.plane import NewRequest, SamplingSpec, StepDescriptor, int32_column


def request(slot: int, tokens: list[int], blocks: list[int]) -> NewRequest:
    return NewRequest(slot, slot, int32_column(tokens), int32_column(blocks), 0, SamplingSpec(temperature=0.0))


def descriptor(new: list[NewRequest], slots: list[int], scheduled: list[int]) -> StepDescriptor:
    return StepDescriptor(0, 1, new_requests=new, slots=int32_column(slots),
                          num_computed=int32_column([0] * len(slots)), num_scheduled=int32_column(scheduled),
                          appended_offsets=int32_column([0] * (len(slots) + 1)))


def test_admitted_prompts_arrive_in_one_upload():
    state = BatchState(num_slots=4, max_model_len=32, block_size=16, device=torch.device("cpu"))
    uploads = []

    def upload(*arrays: np.ndarray) -> list[torch.Tensor]:
        uploads.append(len(arrays))
        return [torch.from_numpy(a.copy()) for a in arrays]

    prompts = {2: [5, 6, 7], 0: list(range(100, 120))}
    state.apply(descriptor([request(s, p, [s * 2, s * 2 + 1]) for s, p in prompts.items()], [2, 0], [3, 20]), upload)
    assert uploads == [3]  # rows, columns, values: one upload whatever the number of prompts
    for slot, tokens in prompts.items():
        assert state.token_buf[slot, :len(tokens)].tolist() == tokens and state.num_known[slot] == len(tokens)
    assert not state.token_buf[1].any() and not state.token_buf[2, 3:].any()


def test_prompts_admitted_before_a_refusal_are_stored():
    state = BatchState(num_slots=2, max_model_len=32, block_size=16, device=torch.device("cpu"))
    bad = request(7, [1, 2], [0])  # slot 7 does not exist
    with pytest.raises(StepRefused, match="slot 7"):
        state.apply(descriptor([request(0, [9, 8, 7], [0]), bad], [0], [3]))
    assert state.token_buf[0, :3].tolist() == [9, 8, 7] and state.num_known[0] == 3
