"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.

A decode step launches a few hundred small kernels; replaying a captured graph launches them as one.
Inputs go through static buffers that the graphs were captured on; a batch is padded up to the next
bucket with rows that write nothing (slot -1) and attend to nothing (context length 0).
"""

from __future__ import annotations

import torch
from torch import nn

from models.context import AttentionContext, reset_context, set_context


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _context(self, bs: int) -> AttentionContext:
        # max_context_len is a host value only the torch backend reads, and it never runs in a graph.
        return AttentionContext(is_decode=True, slot_mapping=self.slot_mapping[:bs],
                                cu_seqlens_q=self.cu_seqlens_q[:bs + 1], max_seqlen_q=1,
                                context_lens=self.context_lens[:bs], max_context_len=0,
                                block_tables=self.block_tables[:bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first, so that smaller graphs fit into the memory pool the largest one reserved.
        for bs in reversed(self.sizes):
            set_context(self._context(bs))
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up (autotune, caches)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
            reset_context()
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Hidden states of a decode batch of n <= max_batch rows (all arguments on the device)."""
        n, width = input_ids.shape[0], block_tables.shape[1]
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = context_lens
        self.context_lens[n:bs] = 0
        # Entries past a row's context are never read, so stale ones may stay.
        self.block_tables[:n, :width] = block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]
