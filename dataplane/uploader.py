"""Host-to-device copies of a step's small index arrays: one pinned staging buffer, one copy per dtype.

A step needs a dozen small arrays on the device; a dozen separate copies cost more than the data.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT

# Each array starts at a multiple of this many bytes. Triton compiles a kernel once per pattern of its
# pointer arguments' 16-byte alignment: packed back to back, an odd number of int64s would leave the
# next array misaligned, and a kernel launched outside CUDA graphs (the sampler under tensor
# parallelism) would compile a new variant mid-run, a step of hundreds of milliseconds, when a batch
# first has such a size.
ALIGN_BYTES = 16


def layout(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of arrays of `sizes` packed in one buffer, each aligned to ALIGN_BYTES; the total."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += -(-size // step) * step
    return offsets, offset


class Uploader:
    # Staging buffers in turn: a buffer is reused only after the copies of RING uploads ago left it.
    # A step uploads up to six times (admitted prompts, penalty counts, block copies, inputs, sampling
    # parameters, the sampling tail's indices) and up to MAX_STEPS_IN_FLIGHT steps may be launched
    # ahead of it, so the oldest copy waited on belongs to a step that has started, its inputs long
    # copied: the host never waits for the GPU's work here.
    RING = 6 * (MAX_STEPS_IN_FLIGHT + 1)

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[dict[np.dtype, torch.Tensor]] = [{} for _ in range(self.RING)]
        self.done: list[torch.cuda.Event | None] = [None] * self.RING
        self.turn = 0

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Fresh device tensors holding `arrays`: one copy per dtype."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for host, members, offsets in self._stage(arrays):
            device = host.to(self.device, non_blocking=True)
            for i, start in zip(members, offsets, strict=True):
                out[i] = device[start:start + arrays[i].size].view(arrays[i].shape)
        self._record()
        return out

    def into(self, pairs: list[tuple[np.ndarray, torch.Tensor]]) -> None:
        """Copy each host array into its device tensor (same dtype and shape; a contiguous target
        takes a straight copy from the staging buffer, a strided one an extra device copy)."""
        arrays = [a for a, _ in pairs]
        if self.device.type != "cuda":
            for a, dst in pairs:
                dst.copy_(torch.from_numpy(np.ascontiguousarray(a)).view(dst.shape))
            return
        for host, members, offsets in self._stage(arrays):
            for i, start in zip(members, offsets, strict=True):
                dst = pairs[i][1]
                dst.copy_(host[start:start + arrays[i].size].view(dst.shape), non_blocking=True)
        self._record()

    def _stage(self, arrays) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """Pack the arrays into this turn's pinned buffers: (host block, member indices, offsets) per dtype."""
        self.turn = (self.turn + 1) % self.RING
        if self.done[self.turn] is not None:
            self.done[self.turn].synchronize()
        groups = []
        for dtype in {a.dtype for a in arrays}:
            members = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            offsets, total = layout([arrays[i].size for i in members], np.dtype(dtype).itemsize)
            host = self._buffer(dtype, total)
            flat = host.numpy()
            for i, offset in zip(members, offsets, strict=True):
                flat[offset:offset + arrays[i].size] = arrays[i].ravel()
            groups.append((host[:total], members, offsets))
        return groups

    def _record(self) -> None:
        # One event a turn, recorded again each time round: creating a fresh one costs more than the record.
        event = self.done[self.turn]
        if event is None:
            event = self.done[self.turn] = torch.cuda.Event()
        event.record()

    def _buffer(self, dtype: np.dtype, size: int) -> torch.Tensor:
        buffers = self.buffers[self.turn]
        buf = buffers.get(dtype)
        if buf is None or buf.numel() < size:
            buf = torch.from_numpy(np.empty(max(size, 1 << 16), dtype=dtype)).pin_memory()
            buffers[dtype] = buf
        return buf
