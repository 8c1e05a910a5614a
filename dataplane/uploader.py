"""Host-to-device copies of a step's small index arrays: one pinned staging buffer, one copy per dtype.

A step needs a dozen small arrays on the device; a dozen separate copies cost more than the data.
"""

from __future__ import annotations

import numpy as np
import torch


class Uploader:
    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[np.dtype, torch.Tensor] = {}
        self.done: torch.cuda.Event | None = None

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if self.done is not None:
            self.done.synchronize()  # the last step's copies have left the staging buffers
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
        self.done = torch.cuda.Event()
        self.done.record()
        return out

    def _buffer(self, dtype: np.dtype, size: int) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < size:
            buf = torch.from_numpy(np.empty(max(size, 1 << 16), dtype=dtype)).pin_memory()
            self.buffers[dtype] = buf
        return buf
