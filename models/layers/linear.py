"""Linear layers split over tensor-parallel ranks, each parameter with a loader that takes its shard.

Column-parallel layers split the output features (no communication); row-parallel layers split the
input features and all-reduce the partial sums. Merged layers (QKV, gate-up) hold several
checkpoint tensors in one weight; their loader is told which part (`shard_id`) it is given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoplane.models.layers.fused import fused_kernels_enabled
from nanoplane.models.layers.parallel import all_reduce, divide, tp_rank, tp_size
from nanoplane.settings import Tuning

# Up to this many rows (a small- or mid-batch decode step) a linear layer mostly streams its weight,
# which kernels.skinny_gemm does in one launch and under programmatic dependent launch, unlike cuBLAS.
SKINNY_MAX_ROWS = Tuning().skinny_max_rows  # NANOPLANE_SKINNY_MAX_ROWS's default; the data plane sets its value


def set_skinny_max_rows(rows: int) -> None:
    """The most rows that go through kernels.skinny_gemm (0: cuBLAS always); the data plane sets it."""
    global SKINNY_MAX_ROWS
    if rows < 0:
        raise ValueError(f"skinny GEMM row limit {rows} is negative")
    SKINNY_MAX_ROWS = rows


def _skinny(x: torch.Tensor) -> bool:
    """Whether x's rows go through kernels.skinny_gemm rather than cuBLAS."""
    return fused_kernels_enabled() and x.dim() == 2 and 1 <= x.shape[0] <= SKINNY_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the kernel the data plane picks for this many rows (the benchmarks
    time the same choice)."""
    if _skinny(x):
        from nanoplane import kernels

        return kernels.skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_add_(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += x @ weight.T in the projection's own kernel, the sum rounded once."""
    if _skinny(x):
        from nanoplane import kernels

        return kernels.skinny_gemm(x, weight, out=out, accumulate=True)
    return out.addmm_(x, weight.t())


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim == 0:  # column-parallel: weight rows and bias entries are split alike
            size = param.size(0)
            loaded = loaded.narrow(0, self.tp_rank * size, size)
        _copy(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size(), "output features"), bias, 0)
        # The eps of an RMSNorm whose weight was multiplied into this one (models/norm_fold.py).
        self.folded_norm_eps: float | None = None

    def row_norm(self, x: torch.Tensor) -> tuple[torch.Tensor, float] | None:
        """(x, eps) when a norm is folded into this projection: the kernel reading its output scales
        each row by x's 1 / rms (kernels.qkv_prologue, kernels.silu_and_mul); None otherwise."""
        return None if self.folded_norm_eps is None else (x, self.folded_norm_eps)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs side by side (gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        _copy(target, loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "attention heads")
        self.num_kv_heads = divide(num_kv_heads, tp, "key/value heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size(), "input features"), output_size, bias, 1)
        # Set by models/norm_fold.py: the projection adds its product into the residual stream.
        self.adds_to_residual = False

    def add_to_residual(self) -> None:
        """From now on forward adds x @ weight.T into `residual` in its own kernel, the sum rounded once."""
        if self.tp_size > 1 or self.bias is not None:
            raise ValueError("only a single rank's bias-free projection adds itself to the residual")
        self.adds_to_residual = True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 2:
            size = param.size(1)
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        _copy(param, loaded)

    def forward(self, x: torch.Tensor, reduce: bool = True,
                residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """`reduce=False` leaves the sum over the ranks to the caller (the RMSNorm that follows can
        fold it into its kernel): this rank's partial product, for a layer without bias. Where it
        adds to the residual stream (add_to_residual), `residual` += the product and None is returned."""
        if self.adds_to_residual:
            linear_add_(x, self.weight, residual)
            return None
        y = linear(x, self.weight)
        if self.tp_size > 1:
            if reduce:
                y = all_reduce(y)
            elif self.bias is not None:
                raise ValueError("a row-parallel layer with a bias must sum its output itself")
        # The bias is added once, after the partial products are summed.
        return y + self.bias if self.bias is not None else y
