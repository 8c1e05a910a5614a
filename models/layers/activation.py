"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoplane.models.layers.fused import fused_kernels_enabled


class SiluAndMul(nn.Module):
    """silu(gate) * up, with gate and up side by side in the last dimension."""

    def forward(self, x: torch.Tensor, row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """`row_norm`: the post-attention norm's row scale, still to apply (kernels.silu_and_mul;
        only with the fused kernels)."""
        if fused_kernels_enabled() and x.dim() == 2:
            from nanoplane import kernels

            return kernels.silu_and_mul(x, row_norm=row_norm)
        if row_norm is not None:
            raise ValueError("a folded norm's row scale needs the fused kernels")
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
