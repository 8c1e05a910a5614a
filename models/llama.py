"""Llama-family decoder (LlamaForCausalLM); Qwen3 is the same with per-head q/k RMSNorm.

Model math only: tensor parallelism lives in the layers (`models/layers/`; the decoder layer only
says which RMSNorm sums the row-parallel outputs), batch structure in the attention context, and a
norm folded into the projection after it in the layers' state (models/norm_fold.py).
`forward(input_ids, positions)` takes the step's tokens packed into one row.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoplane.models.layers.activation import SiluAndMul
from nanoplane.models.layers.attention import Attention
from nanoplane.models.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoplane.models.layers.fused import fused_kernels_enabled
from nanoplane.models.layers.layernorm import RMSNorm
from nanoplane.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoplane.models.layers.parallel import tp_size
from nanoplane.models.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        theta, scaling = _rope(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _qk_norm(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """The per-head q/k norm's (q weight, k weight, eps) for the fused prologue; Nones without one."""
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                reduce: bool = True) -> torch.Tensor | None:
        """Attention of x (the normed rows; the stream itself under a folded norm, models/norm_fold.py);
        None where o_proj has added its output to `residual` itself."""
        qkv = self.qkv_proj(x)
        if fused_kernels_enabled():
            out = self.attn.forward_packed(qkv, positions, self.rotary_emb.cos_sin_cache, *self._qk_norm(),
                                           row_norm=self.qkv_proj.row_norm(x))
            return self.o_proj(out.flatten(1), reduce, residual)
        if self.qkv_proj.folded_norm_eps is not None:
            raise ValueError("a folded norm's row scale needs the fused kernels")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1), reduce, residual)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        if config.hidden_act != "silu":
            raise ValueError(f"activation {config.hidden_act!r} is not supported (only silu)")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, reduce: bool = True) -> torch.Tensor | None:
        """MLP of x (the normed rows; the stream itself under a folded norm, models/norm_fold.py); None
        where down_proj has added its output to `residual` itself."""
        act = self.act_fn(self.gate_up_proj(x), row_norm=self.gate_up_proj.row_norm(x))
        return self.down_proj(act, reduce, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool, defer_sums: bool = False):
        super().__init__()
        # Tensor parallelism: the row-parallel projections hand their partial products to the next
        # RMSNorm, which sums them over the ranks (with its residual add, in one kernel where it can).
        self.defer_sums = defer_sums
        self.self_attn = SelfAttention(config, qk_norm)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | None,
                residual: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x: what the block before hands to the residual stream (None: added already). Returns the
        MLP's output and the stream before it."""
        defer = self.defer_sums
        x, residual = self.input_layernorm(x, residual, reduce=defer)
        x = self.self_attn(positions, x, residual, reduce=not defer)
        x, residual = self.post_attention_layernorm(x, residual, reduce=defer)
        return self.mlp(x, residual, reduce=not defer), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Biased row-parallel layers add their bias after the sum, so they keep summing themselves.
        biased = getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
        self.defer_sums = tp_size() > 1 and not biased
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm, self.defer_sums)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = None, self.embed_tokens(input_ids)  # the embedding starts the stream, whole
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual, reduce=self.defer_sums)[0]


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # checkpoint name -> (parameter holding it, part of that parameter)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config):
        super().__init__()
        self.model = DecoderModel(config, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor | None:
        """Logits of the given hidden states; None on ranks other than 0 under tensor parallelism.
        With gather=False, every rank's own slice of the vocabulary (ParallelLMHead)."""
        return self.lm_head(hidden, gather)


def _rope(config) -> tuple[float, dict | None]:
    """Rotary base and scaling: transformers 5 keeps both in rope_parameters, older ones apart."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = params if params else getattr(config, "rope_scaling", None)
    return float(theta), scaling
