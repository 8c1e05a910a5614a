"""Attention over the paged KV cache: one interface, several implementations.

- `torch`: plain PyTorch, the reference and the CPU path;
- `triton`: our kernels (`kernels/`), the default on GPU; also runs on a CPU under TRITON_INTERPRET=1;
- `flash-attn`: the flash-attn package, when it is importable.

Every backend stores this step's K/V into the cache first, then attends from the cache, so plain
prefill, prefill over a cached prefix, chunked prefill and decode are one operation.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from nanoplane.models.context import AttentionContext

BACKENDS = ("torch", "triton", "flash-attn")


class TorchBackend:
    name = "torch"

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
               scale: float) -> torch.Tensor:
        # Pad every row to the longest query and context, mask, and let SDPA do the rest.
        cu = ctx.cu_seqlens_q.long()
        num_rows, total = cu.numel() - 1, q.shape[0]
        q_lens = cu[1:] - cu[:-1]
        max_q, max_ctx = ctx.max_seqlen_q, ctx.max_context_len
        block_size = k_cache.shape[1]
        num_blocks = -(-max_ctx // block_size)
        tables = ctx.block_tables[:, :num_blocks].long().clamp(min=0)
        # index_select, not advanced indexing: same values, and no multi-threaded gather that stalls
        # a busy small CPU host for a whole scheduling slot.
        flat = tables.flatten()
        keys = k_cache.index_select(0, flat).view(*tables.shape, *k_cache.shape[1:])
        values = v_cache.index_select(0, flat).view(*tables.shape, *v_cache.shape[1:])
        keys = keys.flatten(1, 2)[:, :max_ctx].transpose(1, 2)  # [B, Hkv, max_ctx, D]
        values = values.flatten(1, 2)[:, :max_ctx].transpose(1, 2)
        row = torch.repeat_interleave(torch.arange(num_rows, device=q.device), q_lens, output_size=total)
        col = torch.arange(total, device=q.device) - cu[row]
        padded = q.new_zeros(num_rows, max_q, *q.shape[1:])
        padded[row, col] = q
        ctx_lens = ctx.context_lens.long()
        # Query i of a row sits at position ctx_len - q_len + i; padding queries look at key 0 only.
        q_pos = ctx_lens[:, None] - q_lens[:, None] + torch.arange(max_q, device=q.device)[None, :]
        q_pos = torch.where(torch.arange(max_q, device=q.device)[None, :] < q_lens[:, None], q_pos, 0)
        mask = torch.arange(max_ctx, device=q.device)[None, None, :] <= q_pos[:, :, None]
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=keys.shape[1] != q.shape[1])
        return out.transpose(1, 2)[row, col]


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self) -> None:
        from nanoplane import kernels

        self.k = kernels

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.k.store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, ctx, scale) -> torch.Tensor:
        if ctx.is_decode:
            return self.k.paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                                                 seq_order=ctx.decode_order)
        return self.k.paged_prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                              ctx.block_tables, ctx.max_seqlen_q, scale)


class FlashAttnBackend(TritonBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        super().__init__()
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def attend(self, q, k_cache, v_cache, ctx, scale) -> torch.Tensor:
        if ctx.is_decode:
            return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                     block_table=ctx.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        cu_k = F.pad(ctx.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self.varlen(q, k_cache, v_cache, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=cu_k,
                           max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_context_len,
                           softmax_scale=scale, causal=True, block_table=ctx.block_tables)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend_name(name: str, device: str) -> str:
    if name == "auto":
        if device.startswith("cuda"):
            return "flash-attn" if flash_attn_available() else "triton"
        return "torch"
    if name == "flash-attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash-attn' needs the flash-attn package, which is not installed")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


_BACKEND: TorchBackend = TorchBackend()


def set_backend(name: str) -> None:
    global _BACKEND
    _BACKEND = {"torch": TorchBackend, "triton": TritonBackend, "flash-attn": FlashAttnBackend}[name]()


def get_backend() -> TorchBackend:
    return _BACKEND
