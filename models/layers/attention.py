"""The attention layer: write this step's K/V into the paged cache, attend through the backend."""

from __future__ import annotations

import torch
from torch import nn

from models.attention_backend import get_backend
from models.context import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # The data plane points these at this layer's slice of the KV cache.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
        ctx, backend = get_context(), get_backend()
        backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return backend.attend(q, self.k_cache, self.v_cache, ctx, self.scale)
