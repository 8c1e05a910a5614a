"""Attention metadata for the current step, so that model code stays `forward(input_ids, positions)`.

The data plane fills the context before each forward (and points it at static buffers while a CUDA
graph is captured); attention layers read it. Nothing else in the model sees batch structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionContext:
    is_decode: bool = False  # every row computes exactly one token (the decode kernels apply)
    slot_mapping: torch.Tensor | None = None  # [T] int: cache slot of each token's K/V; -1 skips
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32: row boundaries in the packed tokens
    max_seqlen_q: int = 0  # longest row this step
    context_lens: torch.Tensor | None = None  # [B] int32: keys per row, this step's tokens included
    max_context_len: int = 0  # longest context_lens entry (host copy, for the torch backend)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32: KV blocks of each row
    decode_order: torch.Tensor | None = None  # [B] int32: rows longest context first (decode kernel's
    # launch order; None: row order)


_CONTEXT = AttentionContext()


def get_context() -> AttentionContext:
    return _CONTEXT


def set_context(context: AttentionContext) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    set_context(AttentionContext())
