"""CUDA graphs for decode steps: per batch-size bucket, captured at start-up, padded replay.

A decode step at a few rows is bound by fixed costs: a few hundred small kernels, and on the host
the uploads and small torch calls around them. So a bucket's graph holds as much of the step as
has a fixed shape:

- the model graph: the input tokens gathered from the token buffer, the model, and on a single
  rank the LM head, so its output is the logits;
- two tail graphs (single rank): greedy (argmax) or the fused sampler for rows without filters,
  each writing the sampled ids into the token buffer (the next step's inputs) and into an int32
  buffer the host copies back. Steps with top-k/top-p/min-p rows sample eagerly from the graph's
  output instead, and so do tensor-parallel steps (the LM head too: ModelRunner._head_and_sample).

Inputs land in static buffers with one host-to-device copy per dtype, laid out per bucket so that
each copy is contiguous. Padding rows read the token buffer's spare row, write the spare column,
store no KV (slot -1) and attend to nothing (context length 0).

The edges into cuBLAS's GEMMs stay full ones: made programmatic after capture, they would let each
GEMM's grid launch while its producer drains, but cuBLAS's kernels do not wait, so they would read
their input before it is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanoplane.dataplane.uploader import Uploader
from nanoplane.models.context import AttentionContext, reset_context, set_context

log = logging.getLogger(__name__)

# int64 rows of a bucket's static input block: token-buffer row, position, KV slot, position the
# sampled token is written to, sampler key, sampler offset.
_I64_ROWS = 6
# The int32 block: context lengths, temperatures (float32 bits), 0 in both for padding rows; then the
# rows longest context first (padding rows last).
_I32_ROWS = 3


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """Row indices by decreasing context length (ties in row order): the decode kernel's launch order."""
    return np.argsort(-context_lens, kind="stable").astype(np.int32)


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: nn.Module, token_buf: torch.Tensor, max_batch: int, max_blocks: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, with_head: bool,
                 sample: Callable | None = None):
        """`token_buf`: [slots + 1, max_len + 1] int64, the spare row and column for padding rows.
        `with_head`: the graph ends in the LM head and the tail graphs are captured (single rank);
        `sample(logits, temperature, keys, offsets)` is the fused sampler, None for argmax only."""
        self.model, self.token_buf, self.with_head = model, token_buf, with_head
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = n = self.sizes[-1]
        self.pad_row, self.pad_col = token_buf.shape[0] - 1, token_buf.shape[1] - 1
        # A padding row's int64 inputs: the spare row at position 0, no KV slot, the spare column.
        self.pad64 = np.array([self.pad_row, 0, -1, self.pad_col, 0, 0], dtype=np.int64)
        self.i64 = torch.zeros(_I64_ROWS * n, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(_I32_ROWS * n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = None if with_head else torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.sampled = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy_tails: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_tails: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # per bucket: logits (with_head) or hidden states
        began = time.perf_counter()
        self._capture(sample)
        if self.i64.is_cuda:
            log.info("captured decode graphs for %d batch sizes in %.1f s", len(self.sizes),
                     time.perf_counter() - began)

    def _inputs(self, bs: int) -> tuple[torch.Tensor, ...]:
        """Views of the static buffers as bucket `bs` lays them out (each dtype's block contiguous)."""
        rows = self.i64[: _I64_ROWS * bs].view(_I64_ROWS, bs)
        return (*rows, self.i32[:bs], self.i32[bs: 2 * bs].view(torch.float32), self.i32[2 * bs: 3 * bs])

    def _forward(self, bs: int) -> torch.Tensor:
        slots, positions, slot_mapping, _, _, _, context_lens, _, order = self._inputs(bs)
        set_context(AttentionContext(is_decode=True, slot_mapping=slot_mapping,
                                     cu_seqlens_q=self.cu_seqlens_q[:bs + 1], max_seqlen_q=1,
                                     context_lens=context_lens, max_context_len=0,
                                     block_tables=self.block_tables[:bs], decode_order=order))
        try:
            hidden = self.model(self.token_buf[slots, positions], positions)
            if self.with_head:
                return self.model.compute_logits(hidden)
            # Without the head the output goes to a buffer outside the graphs' pool, which the next
            # capture (or replay) of another bucket may overwrite.
            self.hidden[:bs] = hidden
            return self.hidden[:bs]
        finally:
            reset_context()

    def _tail(self, bs: int, tokens: torch.Tensor) -> None:
        slots, _, _, write_pos, *_ = self._inputs(bs)
        self.token_buf[slots, write_pos] = tokens
        self.sampled[:bs] = tokens

    @torch.inference_mode()
    def _capture(self, sample: Callable | None) -> None:
        pool = None

        def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
            nonlocal pool
            fn()  # warm-up outside the capture (compiles, autotunes, allocates workspaces)
            graph, out, pool = self._record(fn, pool)
            return graph, out

        # Largest first, so that smaller graphs fit into the memory pool the largest one reserved.
        # Each bucket's output stays referenced, so no later capture reuses its memory; it is read
        # right after its own replay, before any other bucket's graph runs.
        for bs in reversed(self.sizes):
            self._pad(bs)
            self.graphs[bs], self.outputs[bs] = capture(lambda bs=bs: self._forward(bs))
            if not self.with_head:
                continue
            logits = self.outputs[bs]
            _, _, _, _, keys, offsets, _, temperature, _ = self._inputs(bs)
            self.greedy_tails[bs], _ = capture(lambda bs=bs, lg=logits: self._tail(bs, lg.argmax(dim=-1)))
            if sample is not None:
                self.sample_tails[bs], _ = capture(
                    lambda bs=bs, lg=logits, t=temperature, k=keys, o=offsets: self._tail(bs, sample(lg, t, k, o)))
        if self.i64.is_cuda:
            torch.cuda.synchronize()

    def _record(self, fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object, object]:
        """Capture `fn` into a graph sharing `pool`: (graph, fn's output, the pool). Tests on a CPU
        replace this with a replay that calls `fn` again."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            out = fn()
        return graph, out, graph.pool()

    def _pack(self, bs: int, rows64: list[np.ndarray | None], context_lens: np.ndarray,
              temperature: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host images of bucket `bs`'s int64 and int32 blocks: the n given rows first, padding after
        (a None int64 row keeps its padding value)."""
        n = len(context_lens)
        i64 = np.repeat(self.pad64[:, None], bs, axis=1)
        for r, values in enumerate(rows64):
            if values is not None:
                i64[r, :n] = values
        i32 = np.zeros((_I32_ROWS, bs), dtype=np.int32)
        i32[0, :n] = context_lens
        i32[1, :n] = temperature.astype(np.float32).view(np.int32)
        i32[2] = longest_first(i32[0])
        return i64.ravel(), i32.ravel()

    def _pad(self, bs: int) -> None:
        """Make every row of bucket `bs`'s inputs a padding row (before its capture's warm-up run)."""
        i64, i32 = self._pack(bs, [], np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32))
        self.i64[: i64.size].copy_(torch.from_numpy(i64))
        self.i32[: i32.size].copy_(torch.from_numpy(i32))

    def scatter(self, tokens: torch.Tensor) -> None:
        """Write ids sampled outside the tail graphs [n] where the last `run`'s rows want them."""
        n = tokens.shape[0]
        slots, _, _, write_pos, *_ = self._inputs(self.bucket(n))
        self.token_buf[slots[:n], write_pos[:n]] = tokens

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, upload: Uploader, slots: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            write_pos: np.ndarray, context_lens: np.ndarray, tables: np.ndarray,
            temperature: np.ndarray | None = None, keys: np.ndarray | None = None,
            offsets: np.ndarray | None = None, between: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Replay the model graph for a decode batch of n rows; host arrays [n] (tables [n, width]).

        With the head and `temperature` given: also the tail (greedy when every temperature is 0,
        else the fused sampler, which then needs `keys` and `offsets`), and the result is the
        sampled ids [n] int32, already in the token buffer. Otherwise the result is the logits
        (with the head) or hidden states [n, ...] for the caller to finish the step. `between(logits
        [n, V])` runs between the model's replay and the tail's (the logits processors, in place).
        """
        n, width = len(slots), tables.shape[1]
        bs = self.bucket(n)
        sampling = temperature is not None and temperature.any()
        i64, i32 = self._pack(bs, [slots, positions, slot_mapping, write_pos, keys if sampling else None,
                                   offsets if sampling else None], context_lens,
                              temperature if temperature is not None else np.zeros(n, dtype=np.float32))
        # Block-table entries past a row's context are never read, so stale ones may stay.
        upload.into([(i64, self.i64[: i64.size]), (i32, self.i32[: i32.size]), (tables, self.block_tables[:n, :width])])
        self.graphs[bs].replay()
        if not self.with_head or temperature is None:
            return self.outputs[bs][:n]
        if between is not None:
            between(self.outputs[bs][:n])
        (self.sample_tails if sampling else self.greedy_tails)[bs].replay()
        return self.sampled[:n]
