"""Tensor-parallel rank and size, read from torch.distributed when a data plane initialised it, and
the all-reduce the row-parallel layers call."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# A faster all-reduce for the sizes it takes (the data plane may install one, dataplane/allreduce.py):
# it returns the sum as a new tensor, or None for a tensor it does not take, which NCCL then sums.
_fast_all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def set_fast_all_reduce(fn: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
    """`fn` may also offer `add_rms_norm(x, residual, weight, eps)`: the sum, residual add and RMSNorm
    in one go (all_reduce_add_rms_norm)."""
    global _fast_all_reduce
    _fast_all_reduce = fn


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel ranks (x itself, summed in place, on the NCCL path)."""
    if _fast_all_reduce is not None:
        out = _fast_all_reduce(x)
        if out is not None:
            return out
    dist.all_reduce(x)
    return x


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(sum(x) + residual) * weight, sum(x) + residual) in one kernel, if the installed fast
    all-reduce offers it for this tensor; None: the caller sums with all_reduce and norms itself."""
    fused = getattr(_fast_all_reduce, "add_rms_norm", None)
    return None if fused is None else fused(x, residual, weight, eps)
