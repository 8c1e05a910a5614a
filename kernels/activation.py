"""The gated activation of Llama-family MLPs, silu(gate) * up, in one pass.

Unfused it is two launches and a [T, I] intermediate written and read back, a large share of a long
prefill step's GPU time; fused, the intermediate never reaches memory.
Rounding follows torch: silu in fp32 rounded to the model dtype, then the product rounded.
"""

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue
from nanoplane.kernels.rmsnorm import row_inv_rms, row_norm_args


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, rows_ptr, stride_x, stride_out, stride_rows, row_eps,
                         INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, ROW_NORM: tl.constexpr,
                         HIDDEN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    # One axis, column blocks fastest: a token's programs run side by side, so with ROW_NORM its
    # row is read from memory once and from L2 after (Qwen3-8B: 12 blocks a token).
    pid = tl.program_id(0)
    blocks = tl.cdiv(INTERMEDIATE, BLOCK)
    token = (pid // blocks).to(tl.int64)
    cols = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    if ROW_NORM:  # gate and up projected the un-normalised row (see silu_and_mul)
        scale = row_inv_rms(rows_ptr, token, stride_rows, row_eps, HIDDEN, BLOCK_HIDDEN)
        gate = (gate.to(tl.float32) * scale).to(gate.dtype)
        up = (up.to(tl.float32) * scale).to(up.dtype)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None,
                 row_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, 2 I] (gate, then up, unit-stride rows) -> [T, I] silu(gate) * up in x's dtype.

    `row_norm` = (rows [T, hidden], eps): x is the projection of the un-normalised rows through a
    weight that holds the RMSNorm's scale (models/norm_fold.py); gate and up are first multiplied
    by each row's 1 / rms and rounded, which makes them the projection of the normed rows.
    """
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, intermediate) and out.stride(-1) == 1
    if num_tokens:
        block = min(1024, triton.next_power_of_2(intermediate))
        rows, row_eps, hidden = row_norm_args(row_norm, x, num_tokens)
        _silu_and_mul_kernel[(num_tokens * triton.cdiv(intermediate, block),)](
            x, out, rows, x.stride(0), out.stride(0), rows.stride(0), row_eps, INTERMEDIATE=intermediate,
            BLOCK=block, ROW_NORM=row_norm is not None, HIDDEN=hidden,
            BLOCK_HIDDEN=triton.next_power_of_2(hidden), num_warps=4 if block >= 512 else 1,
            **pdl_args(x.device),
        )
    return out
