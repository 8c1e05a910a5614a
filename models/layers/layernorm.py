"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer, or folded
into the projection after it (models/norm_fold.py)."""

from __future__ import annotations

import torch
from torch import nn

from nanoplane.models.layers.fused import fused_kernels_enabled
from nanoplane.models.layers.parallel import all_reduce, all_reduce_add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # Set by models/norm_fold.py once the weight lives in the projection after this norm.
        self.folded = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as HuggingFace: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor | None = None, reduce: bool = False):
        """norm(x), or with a residual stream (norm(x + residual), x + residual). x None: the block
        before has added itself to `residual` already (or there was none). `reduce`: x is a
        row-parallel layer's partial product (tensor parallelism), to be summed over the ranks first;
        where the fast all-reduce offers it, the sum, the residual add and the norm are one kernel.
        Folded, the norm hands the stream on unchanged: the projection after it holds the weight and
        the kernel reading that projection's output applies each row's 1 / rms."""
        if self.folded:
            if x is not None:
                raise ValueError("a folded norm takes a stream the block before has added itself to")
            return residual, residual
        if x is None:
            return self._normed(residual), residual
        if reduce:
            if residual is not None:
                shape = x.shape
                fused = all_reduce_add_rms_norm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]),
                                                self.weight, self.eps)
                if fused is not None:
                    return fused[0].view(shape), fused[1].view(shape)
            x = all_reduce(x)
        if residual is None:
            return self._normed(x)
        if fused_kernels_enabled():
            from nanoplane import kernels

            shape = x.shape
            out, residual = kernels.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps,
                                             residual.reshape(-1, shape[-1]))
            return out.view(shape), residual.view(shape)
        residual = x + residual
        return self._norm(residual), residual

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) alone, in the fused kernel where enabled."""
        if fused_kernels_enabled():
            from nanoplane import kernels

            shape = x.shape
            return kernels.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        return self._norm(x)
