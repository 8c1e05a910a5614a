"""The SM partitions of benchmarks/green_contexts.py: on a GPU, work on each stream runs only on its
own SMs, and the two sets are disjoint and cover the device."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from benchmarks.green_contexts import Partition

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _record_sm(out_ptr, spin):
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(spin):  # long enough that the programs spread over every SM the stream may use
        acc = acc * 0.999 + 1.0
    tl.store(out_ptr + tl.program_id(0), tl.where(acc > -1.0, sm, -1))


@pytest.mark.gpu
@gpu
def test_the_two_streams_run_on_disjoint_sms_that_cover_the_device():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("green contexts are tested on Hopper and later")
    part = Partition(100)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    assert part.sms[0] >= 100 and sum(part.sms) == part.device_sms == total
    seen = []
    for stream, sms in zip(part.streams, part.sms, strict=True):
        out = torch.full((16 * total,), -1, dtype=torch.int32, device="cuda")
        with torch.cuda.stream(stream):
            _record_sm[(out.numel(),)](out, 20_000)
        stream.synchronize()
        used = set(out.tolist())
        assert -1 not in used
        assert len(used) == sms  # every program on the partition's SMs, and all of them used
        seen.append(used)
    assert not seen[0] & seen[1]
