"""The gated activation of Llama-family MLPs, silu(gate) * up, in one pass.

Unfused it is two launches and a [T, I] intermediate written and read back; in a 16k-token prefill
step of Qwen3-0.6B that was 7.5 of the step's 46 ms of GPU time, fused it is 2.0 ms (BENCHMARKS.md).
Rounding follows torch: silu in fp32 rounded to the model dtype, then the product rounded.
"""

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_prologue


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2 I] (gate, then up, unit-stride rows) -> [T, I] silu(gate) * up in x's dtype."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, intermediate) and out.stride(-1) == 1
    if num_tokens:
        block = min(1024, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            x, out, x.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl_args(x.device),
        )
    return out
