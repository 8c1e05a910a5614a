"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

import torch
import triton
import triton.language as tl

from nanoplane.kernels.pdl import pdl_args, pdl_prologue


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, residual_ptr, residual_out_ptr,
    stride_x, stride_out, stride_r, stride_ro, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    in_dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # HF adds in the model dtype; round here too so the norm sees the same (rounded) stream.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, 0) / HIDDEN
    h = h * tl.rsqrt(variance + eps)
    # HF casts back to the input dtype *before* the weight multiply; the round trip reproduces
    # that rounding (bf16 x bf16 is exact in fp32, so one final rounding matches torch's product).
    h = h.to(in_dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_inv_rms(rows_ptr, row, stride, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    """1 / rms of one row of a [T, HIDDEN] tensor (fp32): the scale of an RMSNorm whose weight the
    next linear layer holds (models/norm_fold.py), applied by the kernel after that layer."""
    cols = tl.arange(0, BLOCK)
    h = tl.load(rows_ptr + row * stride + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)


def row_norm_args(row_norm: tuple[torch.Tensor, float] | None, placeholder: torch.Tensor,
                  num_tokens: int) -> tuple[torch.Tensor, float, int]:
    """(rows, eps, hidden) for a kernel taking a folded norm's `row_norm` = (rows [T, hidden], eps):
    without one, the placeholder pointer and hidden 1 (ROW_NORM=False compiles them away; a fixed 1
    makes no variant per placeholder width)."""
    if row_norm is None:
        return placeholder, 0.0, 1
    rows, eps = row_norm
    assert rows.dim() == 2 and rows.shape[0] == num_tokens and rows.stride(-1) == 1
    return rows, eps, rows.shape[1]


def _launch_rms_norm(x, weight, eps, residual, out, residual_out):
    num_rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        x, weight, out,
        residual if has_residual else x,  # placeholders: HAS_RESIDUAL=False compiles them away
        residual_out if has_residual else out,
        x.stride(0), out.stride(0),
        residual.stride(0) if has_residual else 0,
        residual_out.stride(0) if has_residual else 0,
        eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual,
        num_warps=min(16, max(1, block // 512)), **pdl_args(x.device),
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm(x) * weight, or with `residual`: (rmsnorm(x + residual) * weight, x + residual).

    x, residual: [T, H] with unit-stride rows; weight: [H]. Math in fp32, results in x's dtype,
    rounding as HF Llama/Qwen3 do. Out of place; `out` / `residual_out` may be preallocated
    (residual_out may alias residual to update it in place).
    """
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with unit-stride last dim"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        assert residual_out.stride(-1) == 1
    if x.shape[0] > 0:
        _launch_rms_norm(x, weight, eps, residual, out, residual_out)
    return out if residual is None else (out, residual_out)
