"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.fused import fused_kernels_enabled


class SiluAndMul(nn.Module):
    """silu(gate) * up, with gate and up side by side in the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_kernels_enabled() and x.dim() == 2:
            import kernels

            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
