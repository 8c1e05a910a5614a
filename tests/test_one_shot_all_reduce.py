"""kernels/one_shot_all_reduce.py on a CPU: two processes under Triton's interpreter stand in for two
GPUs, shared-memory segments for the symmetric buffers and signal pads (each process addresses both,
as peers address each other's buffers over NVLink). The flags are real atomic compare-and-swaps on
shared memory, so this runs the kernel's protocol (copy into this call's slot, meet, sum in rank
order) across processes, call after call, with one rank slower than the other; the GPU test
(tests/test_allreduce.py) runs it on two H200s.
"""

from __future__ import annotations

import contextlib
import queue as queue_module
import time
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

# Elements: one program, a grid-stride loop over three, ..., and last a whole slot of fp32.
SIZES = (5, 4100, 1, 2049, 4096, 8192)
BUFFER_BYTES = 128 << 10  # two sets of a 32 KiB slot for each of the two ranks
PAD_BYTES = 4 << 10


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * n + rank)
    return torch.randn(n, generator=gen).to(dtype)


# The fused all-reduce + residual add + RMSNorm: (rows, hidden); hidden 100 is not a power of two.
# The first follows the 8192-element sum, and its program 0 copies row 9 into the bytes that the
# slow rank's program 2 is still reading from that sum: with one slot, the sum would come out wrong.
NORM_SHAPES = ((10, 512), (3, 64), (5, 100), (1, 128))
EPS = 1e-6


def _norm_inputs(rows: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and the norm's weight: the same on every rank."""
    gen = torch.Generator().manual_seed(31 * rows + hidden)
    return torch.randn(rows, hidden, generator=gen).to(dtype), (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)


def _rank(rank: int, names: dict[str, list[str]], queue) -> None:
    from kernels.one_shot_all_reduce import Peers, one_shot_all_reduce, one_shot_all_reduce_rms_norm

    if rank == 1:
        # Rank 1 reads slowly, so rank 0 runs ahead into its next call while rank 1 still reads rank
        # 0's part of the last one: only the alternating slots keep what rank 1 reads unchanged.
        from triton.runtime.interpreter import InterpreterBuilder

        load = InterpreterBuilder.create_masked_load

        def slow_load(self, *args, **kwargs):
            time.sleep(0.01)
            return load(self, *args, **kwargs)

        InterpreterBuilder.create_masked_load = slow_load

    segments = [shared_memory.SharedMemory(name=name) for kind in ("buffers", "pads") for name in names[kind]]
    try:
        views = [torch.from_numpy(np.ndarray(s.size, dtype=np.uint8, buffer=s.buf)) for s in segments]
        peers = Peers(buffers=torch.tensor([v.data_ptr() for v in views[:2]], dtype=torch.int64),
                      pads=torch.tensor([v.data_ptr() for v in views[2:]], dtype=torch.int64),
                      calls=torch.zeros(3, dtype=torch.int32), slot_bytes=BUFFER_BYTES // 4, rank=rank, world_size=2)
        outs = {}
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                x = _inputs(rank, n, dtype)
                out = one_shot_all_reduce(x, torch.empty_like(x), peers)
                outs[str(dtype), n] = out.float().numpy().copy()  # bf16 -> fp32 is exact; numpy pickles plainly
            for rows, hidden in NORM_SHAPES:
                x = _inputs(rank, rows * hidden, dtype).view(rows, hidden)
                residual, weight = _norm_inputs(rows, hidden, dtype)
                alias = rows == 5  # residual_out may be the residual itself
                normed, summed = one_shot_all_reduce_rms_norm(x, residual, weight, EPS, peers,
                                                              residual_out=residual if alias else None)
                assert (summed is residual) == alias
                outs[str(dtype), "norm", rows] = (normed.float().numpy().copy(), summed.float().numpy().copy())
        # Every program of every call counted it (the slot's parity is in step on every program).
        outs["calls"] = peers.calls.tolist()
        del views, peers
        queue.put((rank, outs))
    finally:
        for s in segments:
            with contextlib.suppress(BufferError):
                s.close()


def _get(queue, procs, timeout: float = 300.0):
    """The next result; a rank that died (its peer then spins at a meet forever) fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(queue_module.Empty):
            return queue.get(timeout=1.0)
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        assert not dead, f"a rank exited with {dead} (its traceback is above)"
    raise TimeoutError("no result from the ranks")


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
            results = dict(_get(queue, procs) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs)
        outs0, outs1 = results[0], results[1]
        # Every flag posted was consumed: the pads are back to zero for the next call.
        assert not any(bytes(seg.buf).strip(b"\0") for seg in owned[2:])
        calls = 2 * (len(SIZES) + len(NORM_SHAPES))
        assert outs0.pop("calls") == outs1.pop("calls") == [calls] * 3
        assert len(outs0) == len(outs1) == calls
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
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            for rows, hidden in NORM_SHAPES:
                (normed, summed), (normed1, summed1) = outs0[str(dtype), "norm", rows], outs1[str(dtype), "norm", rows]
                assert np.array_equal(normed, normed1) and np.array_equal(summed, summed1)  # the same bits everywhere
                # Reference in fp32: all-reduce, residual add, RMSNorm (HF's order of operations).
                x = sum(_inputs(r, rows * hidden, dtype).float().view(rows, hidden) for r in (0, 1))
                residual, weight = (t.float() for t in _norm_inputs(rows, hidden, dtype))
                h = x + residual
                expected = weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
                assert np.allclose(summed, h.numpy(), rtol=tol, atol=tol), (dtype, rows)
                assert np.allclose(normed, expected.numpy(), rtol=tol, atol=tol), (dtype, rows)
    finally:
        for seg in owned:
            seg.close()
            seg.unlink()


def test_the_launcher_checks_its_arguments():
    from dataclasses import replace

    from kernels.one_shot_all_reduce import Peers, one_shot_all_reduce

    x = torch.zeros(4)
    table = torch.zeros(2, dtype=torch.int64)
    peers = Peers(buffers=table, pads=table, calls=torch.zeros(3, dtype=torch.int32), slot_bytes=16, rank=0,
                  world_size=2)
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(5), peers)  # out of another shape
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), replace(peers, buffers=table[:1]))  # one buffer for two ranks
    with pytest.raises(AssertionError):
        one_shot_all_reduce(torch.zeros(5), torch.zeros(5), peers)  # 20 bytes: more than a slot
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), replace(peers, calls=torch.zeros(2, dtype=torch.int32)))
