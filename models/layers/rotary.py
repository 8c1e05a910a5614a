"""Rotary position embedding (neox layout: the two halves of each head rotate together)."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanoplane.models.layers.fused import fused_kernels_enabled


def inverse_frequencies(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, base, rope_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        # [max_position, head_dim]: cos of each frequency, then sin (fp32; cast at use, as HF does).
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fused_kernels_enabled():
            from nanoplane import kernels

            return kernels.apply_rotary(q, k, positions, self.cos_sin_cache)  # in place
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
