"""What a data-plane rank needs to start; the control plane has its own config and sends no policy."""

from __future__ import annotations

from dataclasses import dataclass

from nanoplane.settings import dataplane_default as default


@dataclass(slots=True)
class DataPlaneConfig:
    """Each field's meaning and default: the option of nanoplane/settings.py that sets it."""

    model: str  # HuggingFace model folder
    device: str = default("device")  # "cpu", "cuda" (rank r takes cuda:r), "cuda:N" or "auto"
    dtype: str = default("dtype")
    rank: int = 0
    world_size: int = default("world_size")  # tensor-parallel size
    dist_init: str = default("dist_init")  # torch.distributed init method; launchers pick one when empty
    max_num_seqs: int = default("max_num_seqs")  # persistent batch slots
    max_num_batched_tokens: int = default("max_num_batched_tokens")  # sizes the activation profile
    max_model_len: int = default("max_model_len")
    block_size: int = default("block_size")  # tokens per KV block; 0: 256 on GPU, 16 on CPU
    num_kvcache_blocks: int = default("num_kvcache_blocks")  # 0: size the cache from memory
    gpu_memory_utilization: float = default("gpu_memory_utilization")
    cpu_kvcache_gib: float = default("cpu_kvcache_gib")
    enforce_eager: bool = default("enforce_eager")
    attention_backend: str = default("attention_backend")
    seed: int = default("seed")
    epoch: int = 0
    dist_timeout_s: float = default("dist_timeout_s")  # how long ranks wait for each other in torch.distributed

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")
