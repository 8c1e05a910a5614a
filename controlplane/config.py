"""Engine configuration, checked when it is made; the defaults and meanings are nanoplane.settings'."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT
from nanoplane.settings import BY_NAME, engine_default


@dataclass(slots=True)
class EngineConfig:
    """Each field but the model and hf_config is an engine option of nanoplane.settings (its help says
    what it does)."""

    model: str  # HuggingFace model folder: config.json, *.safetensors, tokenizer files
    device: str = engine_default("device")
    dtype: str = engine_default("dtype")
    tensor_parallel_size: int = engine_default("tensor_parallel_size")
    max_num_seqs: int = engine_default("max_num_seqs")
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    max_model_len: int = engine_default("max_model_len")
    kvcache_block_size: int = engine_default("kvcache_block_size")
    num_kvcache_blocks: int = engine_default("num_kvcache_blocks")
    gpu_memory_utilization: float = engine_default("gpu_memory_utilization")
    cpu_kvcache_gib: float = engine_default("cpu_kvcache_gib")
    enforce_eager: bool = engine_default("enforce_eager")
    attention_backend: str = engine_default("attention_backend")
    seed: int = engine_default("seed")
    steps_in_flight: int = engine_default("steps_in_flight")
    scheduling_policy: str = engine_default("scheduling_policy")
    max_queued_requests: int = engine_default("max_queued_requests")
    max_queued_tokens: int = engine_default("max_queued_tokens")
    kv_events: str = engine_default("kv_events")
    kv_events_buffer: int = engine_default("kv_events_buffer")
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
        if self.dtype not in BY_NAME["dtype"].choices:
            raise ValueError(f"dtype must be {' or '.join(BY_NAME['dtype'].choices)}, got {self.dtype!r}")
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
        backends = BY_NAME["attention_backend"].choices
        if self.attention_backend not in backends:
            raise ValueError(f"attention_backend must be {' or '.join(backends)}, got {self.attention_backend!r}")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError(f"max_queued_requests and max_queued_tokens must be >= 0 (0: unbounded), got "
                             f"{self.max_queued_requests} and {self.max_queued_tokens}")
        if self.kv_events not in ("on", "off") or self.kv_events_buffer < 1:
            raise ValueError(f"kv_events must be 'on' or 'off' and kv_events_buffer >= 1, got {self.kv_events!r} and "
                             f"{self.kv_events_buffer}")
        policies = BY_NAME["scheduling_policy"].choices
        if self.scheduling_policy not in policies:
            raise ValueError(f"scheduling_policy must be {' or '.join(policies)}, got {self.scheduling_policy!r}")

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["?"]
        return archs[0]

