"""Qwen3ForCausalLM: the Llama decoder plus RMSNorm over each query and key head before rotary."""

from __future__ import annotations

from nanoplane.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
