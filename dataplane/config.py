"""What a data-plane rank needs to start; the control plane has its own config and sends no policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DataPlaneConfig:
    model: str  # HuggingFace model folder
    device: str = "cpu"  # "cpu", "cuda" (rank r takes cuda:r) or "cuda:N"
    dtype: str = "auto"  # auto, float32, float16, bfloat16
    rank: int = 0
    world_size: int = 1  # tensor-parallel size
    dist_init: str = ""  # torch.distributed init method (tcp://host:port); launchers pick one when empty
    max_num_seqs: int = 256  # persistent batch slots
    max_num_batched_tokens: int = 16384  # sizes the activation profile
    max_model_len: int = 4096
    block_size: int = 0  # tokens per KV block; 0: 256 on GPU, 16 on CPU
    num_kvcache_blocks: int = 0  # 0: size the cache from memory
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_gib: float = 2.0
    enforce_eager: bool = False
    attention_backend: str = "auto"
    seed: int = 0
    epoch: int = 0
    dist_timeout_s: float = 120.0  # how long ranks wait for each other in torch.distributed

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")
