"""Engine configuration, checked when it is made."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from proto.plane import MAX_STEPS_IN_FLIGHT


@dataclass(slots=True)
class EngineConfig:
    model: str  # HuggingFace model folder: config.json, *.safetensors, tokenizer files
    device: str = "auto"  # "cuda", "cuda:N", "cpu", or "auto" (cuda when available)
    dtype: str = "auto"  # "auto" (bf16 on GPU unless the checkpoint says fp16; fp32 on CPU), float32, float16, bfloat16
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256  # requests in one step, and data-plane slots
    max_num_batched_tokens: int = 16384  # tokens in one step; longer prompts are prefilled in chunks
    max_model_len: int = 4096  # prompt + output; capped by the model's max_position_embeddings
    kvcache_block_size: int = 0  # tokens per KV block; 0: the data plane's default (256 on GPU, 16 on CPU)
    num_kvcache_blocks: int = 0  # set by hand: overrides the memory profile; 0 sizes the cache from memory
    gpu_memory_utilization: float = 0.9  # share of GPU memory the data plane may use in all
    cpu_kvcache_gib: float = 2.0  # KV cache budget on a CPU data plane
    enforce_eager: bool = False  # no decode CUDA graphs (torch.compile is not used at all: BENCHMARKS.md)
    attention_backend: str = "auto"  # "torch", "triton", "flash-attn" or "auto"
    seed: int = 0  # seeds the shared sampling generator of rank 0
    # Steps sent ahead of the result the engine waits for (proto.plane.MAX_STEPS_IN_FLIGHT at most);
    # 0: the data plane's own choice (2 for GPU ranks over ZeroMQ, else 1: BENCHMARKS.md, "One served stream").
    steps_in_flight: int = 0
    scheduling_policy: str = "prefill-first"  # "prefill-first" (the seeds') or "mixed" (controlplane/scheduler.py)
    hf_config: dict = field(default_factory=dict, repr=False)  # config.json, read once

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {self.model!r} has no config.json")
        self.model = os.fspath(path)
        with open(path / "config.json") as f:
            self.hf_config = json.load(f)
        # "auto" stays "auto": the data plane, which has torch, resolves it.
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        bs = self.kvcache_block_size  # 0: the data plane picks (256 on GPU, 16 on CPU)
        if bs != 0 and (bs < 16 or bs & (bs - 1)):
            raise ValueError(f"kvcache_block_size must be a power of two >= 16, got {bs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kvcache_blocks < 0:
            raise ValueError(f"num_kvcache_blocks must be >= 0, got {self.num_kvcache_blocks}")
        limit = self.hf_config.get("max_position_embeddings")
        if limit:
            self.max_model_len = min(self.max_model_len, int(limit))
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.steps_in_flight <= MAX_STEPS_IN_FLIGHT:
            raise ValueError(f"steps_in_flight must be 0 (the data plane's choice) to {MAX_STEPS_IN_FLIGHT}, "
                             f"got {self.steps_in_flight}")
        if self.scheduling_policy not in ("prefill-first", "mixed"):
            raise ValueError(f"scheduling_policy must be prefill-first or mixed, got {self.scheduling_policy!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "flash-attn"):
            raise ValueError("attention_backend must be auto, torch, triton or flash-attn, "
                             f"got {self.attention_backend!r}")

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["?"]
        return archs[0]

