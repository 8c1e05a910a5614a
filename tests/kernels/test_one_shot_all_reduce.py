"""kernels/one_shot_all_reduce.py on a CPU: two or three processes under Triton's interpreter stand in
for GPUs, shared-memory segments for the symmetric buffers and signal pads (each process addresses
all of them, as peers address each other's buffers over NVLink). The flags are real atomic
compare-and-swaps on shared memory, so this runs the kernel's protocol (store into the peers' slots
of this call's set, meet, sum in rank order) across processes, call after call, with one rank slower
than the others; the GPU test (tests/kernels/test_allreduce.py) runs it on two H200s.
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
SLOT_BYTES = 32 << 10  # a buffer holds two sets of one such slot for each rank
PAD_BYTES = 4 << 10


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * n + rank)
    return torch.randn(n, generator=gen).to(dtype)


# The fused all-reduce + residual add + RMSNorm: (rows, hidden); hidden 100 is not a power of two.
# The first follows the 8192-element sum, and its program 0 stores row 9 into the bytes that the
# slow rank's program 2 is still reading from that sum: with one set of slots, that sum comes out wrong.
NORM_SHAPES = ((10, 512), (3, 64), (5, 100), (1, 128))
EPS = 1e-6


def _norm_inputs(rows: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and the norm's weight: the same on every rank."""
    gen = torch.Generator().manual_seed(31 * rows + hidden)
    return torch.randn(rows, hidden, generator=gen).to(dtype), (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)


def _rank(rank: int, world: int, names: dict[str, list[str]], queue) -> None:
    from nanoplane.kernels.one_shot_all_reduce import Peers, one_shot_all_reduce, one_shot_all_reduce_rms_norm

    if rank == 0:
        # Rank 0 reads slowly, so its peers run ahead into their next call while rank 0 still reads
        # their parts of the last one: only the alternating sets keep what rank 0 reads unchanged.
        # (Rank 0, not another: with three ranks, rank 1's next-call slot in rank 0's buffer would
        # land on rank 2's last-call slot if the sets were not world_size slots apart.)
        from triton.runtime.interpreter import InterpreterBuilder

        load = InterpreterBuilder.create_masked_load

        def slow_load(self, *args, **kwargs):
            time.sleep(0.01)
            return load(self, *args, **kwargs)

        InterpreterBuilder.create_masked_load = slow_load

    segments = [shared_memory.SharedMemory(name=name) for kind in ("buffers", "pads") for name in names[kind]]
    try:
        views = [torch.from_numpy(np.ndarray(s.size, dtype=np.uint8, buffer=s.buf)) for s in segments]
        peers = Peers(buffers=torch.tensor([v.data_ptr() for v in views[:world]], dtype=torch.int64),
                      pads=torch.tensor([v.data_ptr() for v in views[world:]], dtype=torch.int64),
                      phase=torch.zeros(3, dtype=torch.int32), slot_bytes=SLOT_BYTES, rank=rank, world_size=world)
        outs = {}
        for dtype in (torch.float32, torch.bfloat16):
            for n in SIZES:
                x = _inputs(rank, n, dtype)
                out = one_shot_all_reduce(x, torch.empty_like(x), peers)
                if (dtype, n) == (torch.float32, SIZES[0]):
                    outs["phase after one call"] = peers.phase.tolist()
                outs[str(dtype), n] = out.float().numpy().copy()  # bf16 -> fp32 is exact; numpy pickles plainly
            for rows, hidden in NORM_SHAPES:
                x = _inputs(rank, rows * hidden, dtype).view(rows, hidden)
                residual, weight = _norm_inputs(rows, hidden, dtype)
                alias = rows == 5  # residual_out may be the residual itself
                normed, summed = one_shot_all_reduce_rms_norm(x, residual, weight, EPS, peers,
                                                              residual_out=residual if alias else None)
                assert (summed is residual) == alias
                outs[str(dtype), "norm", rows] = (normed.float().numpy().copy(), summed.float().numpy().copy())
        outs["phase"] = peers.phase.tolist()
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


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sum_call_after_call(world):
    names: dict[str, list[str]] = {"buffers": [], "pads": []}
    owned = []
    try:
        for kind, size in [("buffers", 2 * world * SLOT_BYTES)] * world + [("pads", PAD_BYTES)] * world:
            seg = shared_memory.SharedMemory(create=True, size=size)
            seg.buf[:size] = bytes(size)
            owned.append(seg)
            names[kind].append(seg.name)
        ctx = torch.multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(rank, world, names, queue)) for rank in range(world)]
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
        # Every flag posted was consumed: the pads are back to zero for the next call.
        assert not any(bytes(seg.buf).strip(b"\0") for seg in owned[world:])
        calls = 2 * (len(SIZES) + len(NORM_SHAPES))
        for outs in results.values():
            # Every program flipped its set at every call, the ones with nothing to sum too.
            assert outs.pop("phase after one call") == [1] * 3 and outs.pop("phase") == [calls % 2] * 3
            assert len(outs) == calls
        ranks = range(world)
        for n in SIZES:
            exact = sum(_inputs(r, n, torch.float32) for r in ranks).numpy()  # fp32, in rank order
            assert all(np.array_equal(results[r]["torch.float32", n], exact) for r in ranks)
            # bf16: the same bits on every rank, each the fp32 sum rounded to bf16 (to nearest on a
            # GPU; the interpreter truncates, so either is accepted here, nothing else).
            assert all(np.array_equal(results[r]["torch.bfloat16", n], results[0]["torch.bfloat16", n]) for r in ranks)
            got = torch.from_numpy(results[0]["torch.bfloat16", n]).to(torch.bfloat16)
            wide = sum(_inputs(r, n, torch.bfloat16).float() for r in ranks)
            truncated = (wide.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            assert bool(((got == wide.to(torch.bfloat16)) | (got == truncated)).all()), n
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            for rows, hidden in NORM_SHAPES:
                normed, summed = results[0][str(dtype), "norm", rows]
                for r in ranks:  # the same bits everywhere
                    other_normed, other_summed = results[r][str(dtype), "norm", rows]
                    assert np.array_equal(other_normed, normed) and np.array_equal(other_summed, summed)
                # Reference in fp32: all-reduce, residual add, RMSNorm (HF's order of operations).
                x = sum(_inputs(r, rows * hidden, dtype).float().view(rows, hidden) for r in ranks)
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

    from nanoplane.kernels.one_shot_all_reduce import Peers, one_shot_all_reduce

    x = torch.zeros(4)
    table = torch.zeros(2, dtype=torch.int64)
    peers = Peers(buffers=table, pads=table, phase=torch.zeros(3, dtype=torch.int32), slot_bytes=16, rank=0,
                  world_size=2)
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(5), peers)  # out of another shape
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), replace(peers, buffers=table[:1]))  # one buffer for two ranks
    with pytest.raises(AssertionError):
        one_shot_all_reduce(torch.zeros(5), torch.zeros(5), peers)  # 20 bytes: more than a slot
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), replace(peers, phase=torch.zeros(2, dtype=torch.int32)))
    with pytest.raises(AssertionError):
        one_shot_all_reduce(x, torch.zeros(4), replace(peers, rank=2))  # no such rank
    # Nothing to sum: no launch on any rank, so no program's set flips and the ranks stay in step.
    empty = torch.zeros(0)
    assert one_shot_all_reduce(empty, empty, peers) is empty and peers.phase.tolist() == [0, 0, 0]
