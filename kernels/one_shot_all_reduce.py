"""All-reduce of a decode-sized tensor over GPUs that can write each other's memory, in one kernel.

Each rank owns a buffer every rank can address (torch symmetric memory) and a pad of int32 signal
slots. The buffer holds a slot for each rank's part, twice over: calls alternate between the two
sets. Program p of the grid, on every rank at once:

1. stores its share of x into this rank's slot in every peer's buffer (NVLink writes, which need
   no round trip, where reading the peers' memory waits for each load to come back);
2. meets program p of every other rank: posts a flag into each peer's pad (a release at system
   scope, after a block barrier, so the stores are visible before the flag is), then waits for and
   consumes each peer's flag in its own pad (an acquire);
3. sums its share over the ranks in rank order (its own x, the parts the peers stored in its own
   buffer, local reads), in fp32, and writes the sum: every rank gets the same bits.

Why one meet a call is enough: a rank may still be reading what its peers stored for call n when a
peer runs ahead into call n + 1, so call n + 1 writes the other set of slots. Call n + 2 writes the
first set again only after call n + 1 has met that rank, whose call n + 1 started after its call n
had ended (one stream, and these kernels are not launched early by PDL). So no second meet guards
the buffer's reuse: that is a cross-GPU round trip less in each of a TP decode step's 72 sums. Which
set a call uses is kept on the device, one bit a program that the program flips, so that CUDA graph
replays and eager calls keep alternating whatever their order; that is why every call launches the
full grid (a bit only flips when its program runs).

Program p only ever waits for program p of the peers, whose share is the same, so there is no
grid-wide barrier; the grid is small enough (128 programs) for every program to be resident. A flag
is posted with compare-and-swap 0 -> 1 and consumed with 1 -> 0: a rank that runs ahead waits at
the post until its previous flag has been consumed, so back-to-back calls (as a CUDA graph replays
them) cannot lose one. (torch's own one-shot kernel reads the peers' buffers with at most 24 blocks
and meets them twice a call: two round trips where this kernel has one write and one meet.)

`one_shot_all_reduce_rms_norm` runs the same protocol row by row and then does what the decoder layer
does next to the sum (kernels/rmsnorm.py's residual add and RMSNorm, same roundings), in the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Elements a program moves per iteration: 16 bytes a thread at 8 warps for 2-byte types (the buffer
# addresses are loaded from a table, so the kernel declares them 16-byte aligned, which the launcher's
# caller guarantees: without that Triton moves the peers' data 2 bytes at a time).
_BLOCK = 2048
_NUM_WARPS = 8
# Programs of the grid on a GPU: the same on every rank whatever its SM count (the ranks' grids must
# match, program for program), and at most one per SM of an H100/H200 (132 SMs), so all are resident
# at once and none waits for a peer's program that cannot start. A GPU with fewer SMs needs several
# programs (8 warps each) resident per SM: not tried.
_GPU_PROGRAMS = 128
# On a CPU (Triton's interpreter, for tests): a few, so that more than one slot is used.
_CPU_PROGRAMS = 3


@triton.jit
def _meet(pads_ptr, rank, slot, WORLD: tl.constexpr):
    """Program `slot` of every rank reaches this point before any goes on (module docstring, step 2)."""
    tl.debug_barrier()  # every thread's writes before the flag
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_pad = tl.load(pads_ptr + r).to(tl.pointer_type(tl.int32))
            seen = tl.atomic_cas(peer_pad + slot * WORLD + rank, 0, 1, sem="release", scope="sys")
            while seen != 0:
                seen = tl.atomic_cas(peer_pad + slot * WORLD + rank, 0, 1, sem="release", scope="sys")
    own_pad = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_cas(own_pad + slot * WORLD + r, 1, 0, sem="acquire", scope="sys")
            while seen != 1:
                seen = tl.atomic_cas(own_pad + slot * WORLD + r, 1, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # no thread reads what the peers stored before their flags are in


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 `v` in dtype, rounded to nearest even as NCCL's sum and torch's ops are (Triton's CPU
    interpreter truncates instead)."""
    if dtype == tl.float32:
        return v
    return v.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _slot(buffers_ptr, r, shift, dtype: tl.constexpr):
    """Rank r's buffer slot of this call: its address plus `shift` bytes."""
    return tl.multiple_of((tl.load(buffers_ptr + r) + shift).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _post(x_ptr, buffers_ptr, first, slot_bytes, offs, mask, rank, WORLD: tl.constexpr):
    """Stores x at `offs` into this rank's slot of every peer's buffer (NVLink writes)."""
    part = tl.load(x_ptr + offs, mask=mask)
    for r in tl.static_range(WORLD):
        if r != rank:
            tl.store(_slot(buffers_ptr, r, first + rank * slot_bytes, x_ptr.dtype.element_ty) + offs, part,
                     mask=mask)


@triton.jit
def _sum_over_ranks(x_ptr, buffers_ptr, first, slot_bytes, offs, mask, rank, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """fp32 sum of x over the ranks at `offs`, in rank order: this rank's x, what the peers posted."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            part = tl.load(x_ptr + offs, mask=mask, other=0.0)
        else:
            posted = _slot(buffers_ptr, rank, first + r * slot_bytes, x_ptr.dtype.element_ty)
            # .cv: never a line an earlier call left in this SM's L1 (the peer wrote past it).
            part = tl.load(posted + offs, mask=mask, other=0.0, cache_modifier=".cv")
        acc += part.to(tl.float32)
    return acc


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, buffers_ptr, pads_ptr, phase_ptr, n, rank, slot_bytes,
                                WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    lanes = tl.arange(0, BLOCK)
    phase = tl.load(phase_ptr + pid)
    first = phase.to(tl.int64) * WORLD * slot_bytes
    for start in range(pid * BLOCK, n, step):
        offs = start + lanes
        _post(x_ptr, buffers_ptr, first, slot_bytes, offs, offs < n, rank, WORLD)
    _meet(pads_ptr, rank, pid, WORLD)
    for start in range(pid * BLOCK, n, step):
        offs = start + lanes
        mask = offs < n
        acc = _sum_over_ranks(x_ptr, buffers_ptr, first, slot_bytes, offs, mask, rank, WORLD, BLOCK)
        tl.store(out_ptr + offs, _round(acc, out_ptr.dtype.element_ty), mask=mask)
    tl.store(phase_ptr + pid, 1 - phase)


@triton.jit
def _one_shot_all_reduce_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                                         buffers_ptr, pads_ptr, phase_ptr, rows, rank, slot_bytes, eps,
                                         HIDDEN: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr):
    """The all-reduce of x [rows, HIDDEN], then kernels/rmsnorm.py's residual add and RMSNorm, row by
    row, with the same roundings: one kernel where a decoder layer had two."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < HIDDEN
    dtype = x_ptr.dtype.element_ty
    phase = tl.load(phase_ptr + pid)
    first = phase.to(tl.int64) * WORLD * slot_bytes
    for row in range(pid, rows, nprog):
        _post(x_ptr, buffers_ptr, first, slot_bytes, row * HIDDEN + cols, cmask, rank, WORLD)
    _meet(pads_ptr, rank, pid, WORLD)
    w = tl.load(weight_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for row in range(pid, rows, nprog):
        offs = row * HIDDEN + cols  # decode-sized: far from int32's limit
        summed = _round(_sum_over_ranks(x_ptr, buffers_ptr, first, slot_bytes, offs, cmask, rank, WORLD, BLOCK),
                        dtype)
        r = tl.load(residual_ptr + offs, mask=cmask, other=0.0)
        h = _round(summed.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(residual_out_ptr + offs, h, mask=cmask)
        hf = h.to(tl.float32)
        hf = hf * tl.rsqrt(tl.sum(hf * hf, 0) / HIDDEN + eps)
        hf = _round(hf, dtype).to(tl.float32)
        tl.store(out_ptr + offs, _round(w * hf, out_ptr.dtype.element_ty), mask=cmask)
    tl.store(phase_ptr + pid, 1 - phase)


def max_programs(device: torch.device) -> int:
    """Programs of every launch: the signal pads need this many x world_size int32 slots, and
    Peers.phase this many entries."""
    return _GPU_PROGRAMS if device.type == "cuda" else _CPU_PROGRAMS


@dataclass(frozen=True)
class Peers:
    """How a rank reaches the others' memory (dataplane/allreduce.py sets it up from symmetric memory)."""

    # int64 [world_size] on the GPU: each rank's buffer address, 16-byte aligned, 2 x world_size slots
    buffers: torch.Tensor
    pads: torch.Tensor  # int64 [world_size]: each rank's signal pad, max_programs() x world_size int32, zero at first
    phase: torch.Tensor  # int32 [max_programs()]: the set of slots each program's next call uses, 0 or 1; 0 at first
    slot_bytes: int  # one slot's bytes, a multiple of 16: the largest input a call takes
    rank: int
    world_size: int

    def check(self, x: torch.Tensor) -> None:
        assert 0 <= self.rank < self.world_size and self.buffers.shape == self.pads.shape == (self.world_size,)
        assert self.buffers.dtype == self.pads.dtype == torch.int64
        assert self.phase.shape == (max_programs(x.device),) and self.phase.dtype == torch.int32
        assert self.buffers.device == self.pads.device == self.phase.device == x.device
        assert self.slot_bytes % 16 == 0 and x.numel() * x.element_size() <= self.slot_bytes


def one_shot_all_reduce(x: torch.Tensor, out: torch.Tensor, peers: Peers) -> torch.Tensor:
    """out = the sum of x over the ranks (x contiguous; out like x, may not alias it).

    Every rank must make the same calls with the same sizes, in the same order, on one stream.
    """
    assert x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype
    peers.check(x)
    n = x.numel()
    if n == 0:
        return out
    _one_shot_all_reduce_kernel[(max_programs(x.device),)](
        x, out, peers.buffers, peers.pads, peers.phase, n, peers.rank, peers.slot_bytes,
        WORLD=peers.world_size, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    return out


def one_shot_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 peers: Peers, *, residual_out: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum + residual) * weight, sum + residual), sum = x summed over the ranks: what
    kernels.rms_norm(all_reduce(x), weight, eps, residual) gives, in one kernel. x, residual: [T, H]
    contiguous, same dtype; weight [H]; the calls as for one_shot_all_reduce. residual_out may alias
    residual."""
    assert x.dim() == 2 and x.is_contiguous() and residual.shape == x.shape and residual.is_contiguous()
    assert residual.dtype == x.dtype and weight.shape == (x.shape[1],) and weight.is_contiguous()
    peers.check(x)
    rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    assert residual_out.shape == x.shape and residual_out.dtype == x.dtype and residual_out.is_contiguous()
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _one_shot_all_reduce_rms_norm_kernel[(max_programs(x.device),)](
        x, residual, weight, out, residual_out, peers.buffers, peers.pads, peers.phase, rows, peers.rank,
        peers.slot_bytes, eps, HIDDEN=hidden, BLOCK=block, WORLD=peers.world_size,
        num_warps=min(16, max(4, block // 512)))
    return out, residual_out
