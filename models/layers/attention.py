"""The attention layer: write this step's K/V into the paged cache, attend through the backend."""

from __future__ import annotations

import torch
from torch import nn

from nanoplane.models.attention_backend import get_backend
from nanoplane.models.context import get_context


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

    def forward_packed(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """The fused path from the QKV projection's output [T, (Hq + 2 Hkv) * D]: q/k norm (when
        weights are given), rotary and the cache store in one kernel, then attention -> [T, Hq, D].
        `row_norm`: the input norm's row scale, still to apply (kernels.qkv_prologue)."""
        from nanoplane import kernels

        ctx = get_context()
        q = kernels.qkv_prologue(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, ctx.slot_mapping,
                                 self.k_cache, self.v_cache, self.num_heads, self.num_kv_heads, row_norm)
        return get_backend().attend(q, self.k_cache, self.v_cache, ctx, self.scale)
