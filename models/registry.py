"""Model classes keyed by config.json's `architectures`."""

from __future__ import annotations

from torch import nn

from nanoplane.models.llama import LlamaForCausalLM
from nanoplane.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(f"unsupported model architecture {', '.join(archs) or '(none given in config.json)'}; "
                     f"nanoplane supports {', '.join(sorted(MODELS))}")
