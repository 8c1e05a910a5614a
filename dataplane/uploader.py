"""Host-to-device copies of a step's small index arrays: one pinned staging buffer, one copy per dtype.

A step needs a dozen small arrays on the device; a dozen separate copies cost more than the data.
"""

from __future__ import annotations

import numpy as np
import torch


class Uploader:
    # Staging buffers in turn: a buffer is reused only after the copies of RING uploads ago left it.
    # A step uploads twice and one step may be in flight, so the oldest copy waited on is two steps
    # back and long done: the host never waits for the GPU's current work here.
    RING = 4

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[dict[np.dtype, torch.Tensor]] = [{} for _ in range(self.RING)]
        self.done: list[torch.cuda.Event | None] = [None] * self.RING
        self.turn = 0

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        self.turn = (self.turn + 1) % self.RING
        if self.done[self.turn] is not None:
            self.done[self.turn].synchronize()
        out: list[torch.Tensor | None] = [None] * len(arrays)
        for dtype in {a.dtype for a in arrays}:
            members = [i for i, a in enumerate(arrays) if a.dtype == dtype]
            total = sum(arrays[i].size for i in members)
            host = self._buffer(dtype, total)
            flat = host.numpy()
            offsets, offset = [], 0
            for i in members:
                flat[offset:offset + arrays[i].size] = arrays[i].ravel()
                offsets.append(offset)
                offset += arrays[i].size
            device = host[:total].to(self.device, non_blocking=True)
            for i, start in zip(members, offsets, strict=True):
                out[i] = device[start:start + arrays[i].size].view(arrays[i].shape)
        event = torch.cuda.Event()
        event.record()
        self.done[self.turn] = event
        return out

    def _buffer(self, dtype: np.dtype, size: int) -> torch.Tensor:
        buffers = self.buffers[self.turn]
        buf = buffers.get(dtype)
        if buf is None or buf.numel() < size:
            buf = torch.from_numpy(np.empty(max(size, 1 << 16), dtype=dtype)).pin_memory()
            buffers[dtype] = buf
        return buf
