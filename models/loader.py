"""Load safetensors checkpoints (one file or a sharded index) through per-parameter weight loaders."""

from __future__ import annotations

from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                         f"parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_model(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob(str(Path(model_dir) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names: set[str] = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target, shard = name, None
                for ckpt_name, (param_name, shard_id) in packed.items():
                    if f".{ckpt_name}." in name:
                        target, shard = name.replace(ckpt_name, param_name), shard_id
                        break
                param = params.get(target)
                if param is None:
                    continue  # buffers such as rotary inv_freq, or heads this model does not use
                loader = getattr(param, "weight_loader", _default_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
                loaded_names.add(target)
    if getattr(model, "tie_word_embeddings", False):
        loaded_names.add("lm_head.weight")
    missing = sorted(set(params) - loaded_names)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
