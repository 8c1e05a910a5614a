"""RMSNorm weights held by the linear layers after them; each row's 1 / rms applied after those.

At decode batch sizes a decoder layer's two RMSNorm launches cost more than the bytes they move
(~2 us each, 57 a step, and the gap each leaves between two cuBLAS GEMMs; BENCHMARKS.md). Row by
row, rmsnorm(x) * w projected through W is (x projected through W * w) / rms(x). So at load the
input norm's weight is multiplied into the QKV projection's columns and the post-attention norm's
into gate-up's, and the kernels that already read those projections' outputs (the QKV prologue,
silu * mul) compute each row's rms from the residual stream and scale by it. The residual adds
move into the row-parallel projections: o_proj and down_proj add their product to the residual
stream as they write it (Tensor.addmm_, skinny_gemm(accumulate=True)). A decoder layer then runs
no norm kernel; only the final norm before the head remains.

The rounding moves in the last place of the model dtype: the projection sees the un-normalised
row and a weight rounded once after the multiply, its output is rounded before the scale, and a
residual sum is rounded once instead of twice. tests/test_engine_correctness.py holds the folded
engine to transformers' tokens in fp32, tests/test_gpu_engine.py to its bf16 logits.

It applies where the data plane runs the fused kernels on one rank, in bf16 or fp32 (not fp16:
see foldable), to layers without biases. Under tensor parallelism the row-parallel outputs are
summed by the fused all-reduce + RMSNorm kernel instead. NANOPLANE_FOLD_NORMS=0 keeps the norms.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from models.layers.fused import fused_kernels_enabled
from models.layers.parallel import tp_size

FOLD_ENV = "NANOPLANE_FOLD_NORMS"


def foldable(model: nn.Module) -> bool:
    """Whether fold_norms applies to this loaded model as the data plane runs it."""
    choice = os.environ.get(FOLD_ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{FOLD_ENV}={choice!r}: expected '0' (keep the norms) or '1' (fold them)")
    decoder = getattr(model, "model", None)
    if choice == "0" or not fused_kernels_enabled() or tp_size() > 1 or not hasattr(decoder, "folded"):
        return False
    if decoder.embed_tokens.weight.dtype == torch.float16:
        # The projections see the un-normalised residual stream, whose large entries (hundreds and
        # more in trained models) could overflow fp16's 65,504 where the normed rows would not.
        return False
    for layer in decoder.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(linear.bias is not None for linear in linears):
            return False
    return True


def fold_norms(model: nn.Module) -> bool:
    """Multiply each decoder layer's norm weights into the projections after them and switch the
    decoder to the folded forward; False (and nothing changed) where foldable() says no."""
    if not foldable(model) or model.model.folded:
        return False
    for layer in model.model.layers:
        _scale_columns(layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight)
        _scale_columns(layer.mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight)
    model.model.folded = True
    return True


def _scale_columns(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    # In fp32, rounded once: W * w is what the projection of the un-normalised row needs.
    weight.data.copy_((weight.data.float() * norm_weight.data.float()[None, :]).to(weight.dtype))
