"""The uploader's packing: every array of a step starts 16-byte aligned in the staging buffer, so
the kernels fed from it see one alignment pattern whatever the batch size."""

from __future__ import annotations

import numpy as np
import pytest

from nanoplane.dataplane.uploader import ALIGN_BYTES, layout


@pytest.mark.parametrize("itemsize", [1, 4, 8])
def test_layout_aligns_every_array_and_keeps_them_apart(itemsize):
    sizes = [3, 1, 0, 7, 16, 5]
    offsets, total = layout(sizes, itemsize)
    assert all(o * itemsize % ALIGN_BYTES == 0 for o in offsets)
    ends = [o + s for o, s in zip(offsets, sizes, strict=True)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:], strict=False))  # no overlap
    assert ends[-1] <= total < ends[-1] + ALIGN_BYTES


def test_layout_packs_aligned_sizes_back_to_back():
    assert layout([2, 4, 6], 8) == ([0, 2, 6], 12)
    assert layout([5, 1], np.dtype(np.int64).itemsize) == ([0, 6], 8)


def test_staging_packs_each_dtype_aligned_and_intact(monkeypatch):
    """The staging step the CUDA path copies from (run here on host buffers, without pinning)."""
    import torch

    from nanoplane.dataplane.uploader import Uploader

    up = Uploader(torch.device("cpu"))
    monkeypatch.setattr(up, "_buffer", lambda dtype, size: torch.from_numpy(np.zeros(max(size, 1), dtype=dtype)))
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 99, n).astype(np.int64) for n in (3, 5, 1)] + [rng.random((2, 3)).astype(np.float32)]
    seen = set()
    for host, members, offsets in up._stage(arrays):
        for i, start in zip(members, offsets, strict=True):
            seen.add(i)
            assert start * host.element_size() % ALIGN_BYTES == 0
            got = host[start:start + arrays[i].size].numpy().reshape(arrays[i].shape)
            assert np.array_equal(got, arrays[i])
    assert seen == set(range(len(arrays)))
