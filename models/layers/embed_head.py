"""Token embedding and output head, split over tensor-parallel ranks along the vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size; padded rows are never
selected (embedding) and are cut from the logits (head).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanoplane.models.layers.parallel import all_reduce, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.per_partition * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding of shape {tuple(loaded.shape)} does not fit vocab "
                             f"{self.num_embeddings} x {param.shape[1]}")
        part = loaded[self.vocab_start:self.vocab_start + self.per_partition]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mine = (local >= 0) & (local < self.per_partition)
        y = F.embedding(local.clamp(0, self.per_partition - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary: gathered whole on rank 0 only (the only rank that samples them
    whole), or each rank's own slice of columns for a sampler that draws from the slices
    (kernels.sample_partial)."""

    def forward(self, x: torch.Tensor, gather: bool = True) -> torch.Tensor | None:
        """Logits [.., V] (None on other ranks); with gather=False this rank's columns
        [vocab_start, vocab_start + per_partition), padding included, on every rank."""
        logits = F.linear(x, self.weight)
        if not gather:
            return logits
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, dst=0)
            if self.tp_rank != 0:
                return None
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]
