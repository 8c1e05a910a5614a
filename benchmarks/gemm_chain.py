"""The decode step's linear layers as the model chains them, for the GEMM benchmarks (splitk_gemm.py,
cublaslt_algos.py, tma_gemm.py): Qwen3-0.6B's four projections, each candidate checked against fp32
first, then timed as 28 dependent `y += x @ w^T` calls (each layer its own weight) in one CUDA graph.
"""

from collections.abc import Callable

import torch
from timing import time_graph

LAYERS = 28
# (N, K): output and input features.
SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def layer_weights(names: tuple[str, ...] = tuple(SHAPES)) -> dict[str, list[torch.Tensor]]:
    """LAYERS bf16 weights of each named shape."""
    return {name: [torch.randn(*SHAPES[name], device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
            for name in names}


class Case:
    """One (rows, layer) of a sweep: its input x, the residual y0 it adds to, and the fp32 result."""

    def __init__(self, m: int, weights: list[torch.Tensor]):
        n, k = weights[0].shape
        self.weights = weights
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        self.y0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        self.want = self.y0.float() + self.x.float() @ weights[0].float().t()
        # cuBLAS's own rounding error sets the bar each candidate is held to.
        self.ref_err = self.error(self.y0.clone().addmm_(self.x, weights[0].t()))
        self.y = self.y0.clone()  # what the timed chains accumulate into

    def error(self, y: torch.Tensor) -> float:
        return (y.float() - self.want).abs().max().item()

    def wrong(self, y: torch.Tensor) -> bool:
        """Whether y (y0 plus one call on the first layer's weight) is off by more than cuBLAS's error allows."""
        return self.error(y) > self.bound()

    def wrong_product(self, product: torch.Tensor) -> bool:
        """Whether `product` (x @ w^T on the first layer's weight, no residual) is off by more than that."""
        want = self.x.float() @ self.weights[0].float().t()
        return (product.float() - want).abs().max().item() > self.bound()

    def bound(self) -> float:
        return 4 * self.ref_err + 1e-2

    def checks(self, addmm_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], object], label: str) -> bool:
        """Whether one call of `addmm_(y, x, weight, layer)` on the first layer gives y0 + x @ w^T within
        cuBLAS's error; prints the candidate's `label` and its error where it does not."""
        y = self.y0.clone()
        addmm_(y, self.x, self.weights[0], 0)
        torch.cuda.synchronize()
        if self.wrong(y):
            print(f"WRONG {label}: {self.error(y):.3g} vs cuBLAS {self.ref_err:.3g}", flush=True)
            return False
        return True

    def time(self, addmm_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], object]) -> float:
        """µs a call of `addmm_(y, x, weight, layer)` over the chain of LAYERS calls."""
        def chain():
            for i, w in enumerate(self.weights):
                addmm_(self.y, self.x, w, i)
        return time_graph(chain) / LAYERS * 1e3

    def time_cublas(self) -> float:
        return self.time(lambda y, x, w, i: y.addmm_(x, w.t()))
