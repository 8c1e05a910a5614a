"""Size and allocate the paged KV cache of a rank, and hand each attention layer its slice."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanoplane.models.layers.attention import Attention


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes on this rank, K and V of every layer."""
    layers = attention_layers(model)
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in layers)
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


def allocate(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """One tensor for the whole cache; each layer gets views of its K and V planes.

    Zero-filled, so padded reads of never-written blocks stay finite (NaN times a zero attention
    weight is still NaN).
    """
    layers = attention_layers(model)
    a = layers[0]
    cache = torch.zeros(2, len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache


def copy_blocks(cache: torch.Tensor, src: np.ndarray, dst: np.ndarray, upload: Callable) -> None:
    """Blocks src[i] -> dst[i] in every layer's K and V, all read before any is written;
    `upload(*arrays)` (dataplane.uploader) carries the ids to the device."""
    src_t, dst_t = upload(src.astype(np.int64), dst.astype(np.int64))
    cache[:, :, dst_t] = cache[:, :, src_t]


def gpu_blocks(model: nn.Module, block_size: int, dtype: torch.dtype, utilization: float) -> int:
    """Blocks that fit in `utilization` of the GPU after weights, other processes and the profiled peak."""
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    used_elsewhere_and_here = total - free
    # The peak of the profile run came and went; reserve it on top of what is held now.
    peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    budget = total * utilization - used_elsewhere_and_here - peak_extra
    return max(0, int(budget) // block_bytes(model, block_size, dtype))


def cpu_blocks(model: nn.Module, block_size: int, dtype: torch.dtype, gib: float) -> int:
    return max(1, int(gib * 2**30) // block_bytes(model, block_size, dtype))
