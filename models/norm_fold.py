"""RMSNorm weights held by the linear layers after them; each row's 1 / rms applied after those.

At decode batch sizes a decoder layer's two RMSNorm launches cost more than the bytes they move, and
each leaves a gap between two GEMMs. Row by row, rmsnorm(x) * w projected through W is
(x projected through W * w) / rms(x). So at load the input norm's weight is multiplied into the QKV
projection's columns and the post-attention norm's into gate-up's, and the kernels that already read
those projections' outputs (the QKV prologue, silu * mul) compute each row's rms from the residual
stream and scale by it. The residual adds move into the row-parallel projections: o_proj and
down_proj add their product to the residual stream as they write it (Tensor.addmm_,
skinny_gemm(accumulate=True)). A decoder layer then runs no norm kernel; only the final norm before
the head remains.

The fold only flips the layers' state, the model keeps its one forward: a folded RMSNorm hands the
stream on unchanged, a projection holding a norm's weight hands its readers the row scale
(ColumnParallelLinear.row_norm), and a row-parallel projection that adds to the residual returns
None (RowParallelLinear.add_to_residual).

The rounding moves in the last place of the model dtype: the projection sees the un-normalised
row and a weight rounded once after the multiply, its output is rounded before the scale, and a
residual sum is rounded once instead of twice. tests/engine/test_engine_correctness.py holds the folded
engine to transformers' tokens in fp32, tests/engine/test_gpu_engine.py to its bf16 logits.

It applies where the data plane runs the fused kernels on one rank, in bf16 or fp32 (not fp16:
see foldable), to layers without biases. Under tensor parallelism the row-parallel outputs are
summed by the fused all-reduce + RMSNorm kernel instead.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoplane.models.layers.fused import fused_kernels_enabled
from nanoplane.models.layers.parallel import tp_size
from nanoplane.models.llama import DecoderModel


def foldable(model: nn.Module, enabled: bool = True) -> bool:
    """Whether fold_norms applies to this loaded model as the data plane runs it; `enabled=False`
    keeps the norms."""
    decoder = getattr(model, "model", None)
    if not enabled or not fused_kernels_enabled() or tp_size() > 1 or not isinstance(decoder, DecoderModel):
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


def folded(model: nn.Module) -> bool:
    """Whether fold_norms has folded this model's norms."""
    decoder = getattr(model, "model", None)
    return isinstance(decoder, DecoderModel) and all(layer.input_layernorm.folded for layer in decoder.layers)


def fold_norms(model: nn.Module, enabled: bool = True) -> bool:
    """Multiply each decoder layer's norm weights into the projections after them and set the layers
    to run folded; False (and nothing changed) where foldable() says no or it is folded already."""
    if not foldable(model, enabled) or folded(model):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        folds = ((layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj))
        for norm, projection in folds:
            _scale_columns(projection.weight, norm.weight)
            projection.folded_norm_eps = norm.eps
            norm.folded = True
        attn.o_proj.add_to_residual()
        mlp.down_proj.add_to_residual()
    return True


def _scale_columns(weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    # In fp32, rounded once: W * w is what the projection of the un-normalised row needs.
    weight.data.copy_((weight.data.float() * norm_weight.data.float()[None, :]).to(weight.dtype))
