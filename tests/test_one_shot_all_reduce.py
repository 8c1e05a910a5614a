"""kernels/one_shot_all_reduce.py on a CPU: two processes under Triton's interpreter stand in for two
GPUs, shared-memory segments for the symmetric buffers and signal pads (each process addresses both,
as peers address each other's buffers over NVLink). The flags are real atomic compare-and-swaps on
shared memory, so this runs the kernel's protocol (copy, meet, sum in rank order, meet again) across
processes, call after call, with one rank slower than the other; the GPU test (tests/test_allreduce.py)
runs it on two H200s.
"""

from __future__ import annotations

import contextlib
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

SIZES = (5, 4100, 1, 2049, 4096)  # elements: one program, a grid-stride loop over three, ...
BUFFER_BYTES = 64 << 10
PAD_BYTES = 4 << 10


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * n + rank)
    return torch.randn(n, generator=gen).to(dtype)


def _rank(rank: int, names: dict[str, list[str]], queue) -> None:
    from kernels.one_shot_all_reduce import one_shot_all_reduce

    if rank == 1:
        # Rank 1 reads slowly, so rank 0 runs ahead into its next call while rank 1 still reads rank
        # 0's buffer from the last one: only the kernel's second meet keeps that buffer unchanged.
        import time

        from triton.runtime.interpreter import InterpreterBuilder

        load = InterpreterBuilder.create_masked_load

        def slow_load(self, *args, **kwargs):
            time.sleep(0.01)
            return load(self, *args, **kwargs)

        InterpreterBuilder.create_masked_load = slow_load

    segments = [shared_memory.SharedMemory(name=name) for kind in ("buffers", "pads") for name in names[kind]]
    try:
        views = [torch.from_numpy(np.ndarray(s.size, dtype=np.uint8, buffer=s.buf)) for s in segments]
        buffers = torch.tensor([v.data_ptr() for v in views[:2]], dtype=torch.int64)
        pads = torch.tensor([v.data_ptr() for v in views[2:]], dtype=torch.int64)
        outs = {}
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                x = _inputs(rank, n, dtype)
                out = one_shot_all_reduce(x, torch.empty_like(x), buffers, pads, rank, 2)
                outs[str(dtype), n] = out.float().numpy().copy()  # bf16 -> fp32 is exact; numpy pickles plainly
        del views, buffers, pads
        queue.put((rank, outs))
    finally:
        for s in segments:
            with contextlib.suppress(BufferError):
                s.close()


def test_two_ranks_sum_call_after_call():
    names: dict[str, list[str]] = {"buffers": [], "pads": []}
    owned = []
    try:
        for kind, size in [("buffers", BUFFER_BYTES)] * 2 + [("pads", PAD_BYTES)] * 2:
            seg = shared_memory.SharedMemory(create=True, size=size)
            seg.buf[:size] = bytes(size)
            owned.append(seg)
            names[kind].append(seg.name)
        ctx = torch.multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(rank, names, queue)) for rank in (0, 1)]
        for p in procs:
            p.start()
        try:
            results = dict(queue.get(timeout=300) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs)
        outs0, outs1 = results[0], results[1]
        # Every flag posted was consumed: the pads are back to zero for the next call.
        assert not any(bytes(seg.buf).strip(b"\0") for seg in owned[2:])
        assert len(outs0) == len(outs1) == 2 * len(SIZES)
        for n in SIZES:
            exact = (_inputs(0, n, torch.float32) + _inputs(1, n, torch.float32)).numpy()
            assert np.array_equal(outs0["torch.float32", n], exact) and np.array_equal(outs1["torch.float32", n], exact)
            # bf16: the same bits on both ranks, each the fp32 sum rounded to bf16 (to nearest on a
            # GPU; the interpreter truncates, so either is accepted here, nothing else).
            got = torch.from_numpy(outs0["torch.bfloat16", n]).to(torch.bfloat16)
            assert np.array_equal(outs0["torch.bfloat16", n], outs1["torch.bfloat16", n])
            wide = _inputs(0, n, torch.bfloat16).float() + _inputs(1, n, torch.bfloat16).float()
            truncated = (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            assert bool(((got == wide.to(torch.bfloat16)) | (got == truncated)).all()), n
    finally:
        for seg in owned:
            seg.close()
            seg.unlink()


def test_the_launcher_checks_its_arguments():
    from kernels.one_shot_all_reduce import one_shot_all_reduce

    x = torch.zeros(4)
    table = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(5), table, table, 0, 2)  # out of another shape
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), table[:1], table, 0, 2)  # one buffer for two ranks
