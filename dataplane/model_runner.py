"""One data-plane rank: the model, its KV cache, the persistent batch state and the sampler.

It obeys descriptors and holds no scheduling policy: each `execute` applies a descriptor's deltas,
builds the attention context, runs the model and samples, so that every rank holds the next input
tokens on its device; rank 0 returns them. Under tensor parallelism each rank draws from its slice of
the vocabulary and the ranks swap their best candidates (`_sample_slices`); steps with top-k, top-p
or min-p rows, logits processors, bitmasks or logprobs gather the logits to rank 0, which samples
and broadcasts the ids. The processors and logprobs are dataplane/sampling_tail.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from nanoplane.dataplane import kv_cache
from nanoplane.dataplane.allreduce import make_fast_all_reduce
from nanoplane.dataplane.batch_state import BatchState, StepRefused
from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.cuda_graphs import DecodeGraphs, longest_first
from nanoplane.dataplane.logprobs import HostArrays, fill_result
from nanoplane.dataplane.sampler import Sampler, filtered_rows
from nanoplane.dataplane.sampling_tail import SamplingTail, TailStep
from nanoplane.dataplane.uploader import Uploader
from nanoplane.kernels import decode_attention
from nanoplane.kernels.pdl import set_pdl
from nanoplane.models.attention_backend import resolve_backend_name, set_backend
from nanoplane.models.context import AttentionContext, reset_context, set_context
from nanoplane.models.layers.fused import enable_fused_kernels
from nanoplane.models.layers.linear import set_skinny_max_rows
from nanoplane.models.layers.parallel import set_fast_all_reduce
from nanoplane.models.loader import load_model
from nanoplane.models.norm_fold import fold_norms
from nanoplane.models.registry import model_class
from nanoplane.proto.plane import MAX_STEPS_IN_FLIGHT, PlaneInfo, StepDescriptor, StepResult
from nanoplane.settings import read_tuning


@dataclass(slots=True)
class Launched:
    """A step whose GPU work is queued; `ModelRunner.wait` turns it into a StepResult."""

    step_id: int
    start: float
    host: np.ndarray | torch.Tensor | None = None  # where the sampled ids land (rank 0)
    done: torch.cuda.Event | None = None  # recorded after the copy to `host`
    error: str = ""
    tail: TailStep | None = None  # the step's logprobs plans and their arrays on the way to the host (rank 0)


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str, hf_config) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device == "cpu":
        return torch.float32
    declared = str(getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", "")).replace("torch.", "")
    return torch.float16 if declared == "float16" else torch.bfloat16


class ModelRunner:
    def __init__(self, cfg: DataPlaneConfig):
        self.cfg = cfg
        self.rank, self.world_size = cfg.rank, cfg.world_size
        if cfg.device == "cuda":
            self.device = torch.device("cuda", cfg.rank)
        else:
            self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if cfg.world_size > 1:
            if not cfg.dist_init:
                raise ValueError("a tensor-parallel rank needs dist_init (e.g. tcp://127.0.0.1:29500)")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            # A bounded wait: a rank that died before joining turns into an error, not a hang.
            dist.init_process_group(backend, init_method=cfg.dist_init, rank=cfg.rank, world_size=cfg.world_size,
                                    timeout=timedelta(seconds=cfg.dist_timeout_s))
        try:
            self._setup(cfg)
        except BaseException:
            set_fast_all_reduce(None)
            # Leave no process group behind: a later runner in this process would inherit its size.
            if cfg.world_size > 1 and dist.is_initialized():
                dist.destroy_process_group()
            raise

    def _setup(self, cfg: DataPlaneConfig) -> None:
        self.hf_config = AutoConfig.from_pretrained(cfg.model)
        self.dtype = resolve_dtype(cfg.dtype, self.device.type, self.hf_config)
        self.backend = resolve_backend_name(cfg.attention_backend, self.device.type)
        set_backend(self.backend)
        enable_fused_kernels(self.backend != "torch")
        # The tuning variables are read here, at the rank's start-up, and handed to the kernels and models.
        self.tuning = tuning = read_tuning()
        set_pdl(tuning.pdl)
        decode_attention.configure(tuning.decode_order_waves, tuning.decode_two_split_waves, tuning.decode_early_setup)
        set_skinny_max_rows(tuning.skinny_max_rows)
        set_fast_all_reduce(make_fast_all_reduce(self.device, self.dtype, self.world_size, tuning.allreduce))
        self.max_model_len = min(cfg.max_model_len, self.hf_config.max_position_embeddings)
        self.block_size = cfg.block_size or (16 if self.device.type == "cpu" else 256)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.hf_config)(self.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, cfg.model)
        fold_norms(self.model, enabled=tuning.fold_norms)
        self.model.eval()
        self.sampler = Sampler(self.device, cfg.seed, fused=tuning.fused_sampler)
        # Before the KV cache takes the memory the scratch logits borrow. Every rank draws from its
        # slice of the vocabulary under tensor parallelism; rank 0 alone draws whole rows.
        head = self.model.lm_head
        self.sampler.warmup(self.hf_config.vocab_size, cfg.max_num_seqs, self.dtype, whole=self.rank == 0,
                            vocab_slice=(head.vocab_start, head.per_partition) if self.world_size > 1 else None)
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = kv_cache.allocate(self.model, self.num_kv_blocks, self.block_size, self.dtype, self.device)
        self.state = BatchState(cfg.max_num_seqs, self.max_model_len, self.block_size, self.device,
                                self.hf_config.vocab_size)
        self.upload = Uploader(self.device)
        self.tail = SamplingTail(self.state, self.hf_config.vocab_size, self.device, self.upload, self.rank,
                                 self.sampler.fused)
        self.tail.warmup(self.hf_config.vocab_size, self.dtype)
        self.result_slot = 0
        # One per step a rank may hold launched (proto.plane): each step's copy has a buffer of its own.
        self.result_buffers = [torch.zeros(cfg.max_num_seqs, dtype=torch.int32).pin_memory()
                               for _ in range(MAX_STEPS_IN_FLIGHT + 1)] if self.device.type == "cuda" else []
        # Each buffer's copy is marked done by an event of its own, recorded again when the buffer comes round.
        self.result_events = [torch.cuda.Event() for _ in self.result_buffers]
        self.graphs = self._capture_graphs()
        self.next_step_id = 0

    def _capture_graphs(self) -> DecodeGraphs | None:
        # The torch backend sizes its tensors from host values, which a graph would freeze.
        if self.cfg.enforce_eager or self.device.type != "cuda" or self.backend == "torch":
            return None
        # On a single rank the graphs also hold the LM head and the sampling tail; with tensor
        # parallelism the head and the sampling run outside them (_head_and_sample).
        single = self.world_size == 1
        sample = None
        if single and self.sampler.fused:
            from nanoplane import kernels

            sample = kernels.sample
        return DecodeGraphs(self.model, self.state.token_buf, self.cfg.max_num_seqs, self.state.max_blocks,
                            self.hf_config.hidden_size, self.dtype, self.device, with_head=single, sample=sample)

    def _size_kv_cache(self) -> int:
        if self.cfg.num_kvcache_blocks:
            return self.cfg.num_kvcache_blocks
        if self.device.type == "cpu":
            return kv_cache.cpu_blocks(self.model, self.block_size, self.dtype, self.cfg.cpu_kvcache_gib)
        self._profile_run()
        blocks = kv_cache.gpu_blocks(self.model, self.block_size, self.dtype, self.cfg.gpu_memory_utilization)
        if blocks < 1:
            raise RuntimeError("no GPU memory left for the KV cache: raise gpu_memory_utilization, lower "
                               "max_num_batched_tokens, or use more tensor-parallel ranks")
        return blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A forward over a full token budget, to measure the activation peak the KV cache must leave room for."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = min(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs * self.max_model_len)
        seq_len = min(self.max_model_len, num_tokens)
        num_seqs = max(1, num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = kv_cache.allocate(self.model, num_seqs * blocks_per_seq, self.block_size, self.dtype, self.device)
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=self.device).view(num_seqs, -1)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        slot_mapping = (tables.long()[:, :, None] * self.block_size
                        + torch.arange(self.block_size, device=self.device)).flatten(1)[:, :seq_len].flatten()
        set_context(AttentionContext(
            slot_mapping=slot_mapping,
            cu_seqlens_q=torch.arange(0, (num_seqs + 1) * seq_len, seq_len, dtype=torch.int32, device=self.device),
            max_seqlen_q=seq_len,
            context_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device),
            max_context_len=seq_len,
            block_tables=tables,
        ))
        hidden = self.model(torch.zeros_like(positions), positions)
        self.model.compute_logits(hidden[: min(num_seqs, self.cfg.max_num_seqs)])
        reset_context()
        del scratch, hidden
        torch.cuda.synchronize()

    def info(self) -> PlaneInfo:
        return PlaneInfo(
            rank=self.rank, world_size=self.world_size, epoch=self.cfg.epoch, num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size, max_num_seqs=self.cfg.max_num_seqs, max_model_len=self.max_model_len,
            vocab_size=self.hf_config.vocab_size, architecture=type(self.model).__name__,
            device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
        )

    def execute(self, desc: StepDescriptor) -> StepResult:
        return self.wait(self.launch(desc))

    def launch(self, desc: StepDescriptor) -> Launched:
        """Apply the descriptor and queue the step's GPU work; the sampled ids are copied back
        asynchronously, so the host can prepare the next step while this one runs."""
        start = time.perf_counter()
        try:
            if desc.step_id != self.next_step_id:
                raise StepRefused(f"expected step {self.next_step_id}, got step {desc.step_id}")
            SamplingTail.check(desc, self.num_kv_blocks)
            self.state.apply(desc, self.upload)
            self.tail.admit(desc)
        except StepRefused as e:
            return Launched(desc.step_id, start, error=f"rank {self.rank} refused: {e}")
        self.next_step_id += 1
        if len(desc.copy_src):  # a forked sample's own copy of a block: before the step reads it
            kv_cache.copy_blocks(self.kv_cache, desc.copy_src, desc.copy_dst, self.upload)
        sampled, tail = self._run(desc)
        if self.rank != 0:
            return Launched(desc.step_id, start)
        n = sampled.shape[0]
        if tail is not None:  # its arrays leave with the sampled ids, covered by the same event
            tail.host = HostArrays(tail.out)
        if self.device.type != "cuda":
            # A copy: the decode graphs' sampled ids live in a buffer the next step rewrites.
            return Launched(desc.step_id, start, host=sampled.to(torch.int32, copy=True).numpy(), tail=tail)
        # Pinned buffers in turn: the steps launched before this one may not have been read yet.
        self.result_slot = (self.result_slot + 1) % len(self.result_buffers)
        host = self.result_buffers[self.result_slot][:n]
        host.copy_(sampled.to(torch.int32), non_blocking=True)
        done = self.result_events[self.result_slot]
        done.record()
        return Launched(desc.step_id, start, host=host, done=done, tail=tail)

    def wait(self, launched: Launched) -> StepResult:
        if launched.error:
            return StepResult(launched.step_id, np.zeros(0, dtype=np.int32), error=launched.error)
        if launched.done is not None:
            launched.done.synchronize()
        host = launched.host
        if host is None:
            ids = np.zeros(0, dtype=np.int32)
        elif isinstance(host, torch.Tensor):  # a pinned buffer, reused two steps later: copy it out
            ids = host.numpy().copy()
        else:  # the CPU path's array, already the step's own
            ids = host
        result = StepResult(launched.step_id, ids, forward_time_s=time.perf_counter() - launched.start)
        if launched.tail is not None:
            fill_result(result, launched.tail.logprobs, launched.tail.prompt, launched.tail.host)
        return result

    @torch.inference_mode()
    def _run(self, desc: StepDescriptor) -> tuple[torch.Tensor, TailStep | None]:
        st, bs = self.state, self.block_size
        slots, computed, scheduled = desc.slots.astype(np.int64), desc.num_computed, desc.num_scheduled
        num_rows = len(slots)
        if not num_rows:  # a step of frees or block copies only
            return torch.zeros(0, dtype=torch.int64, device=self.device), None
        row_of_token = np.repeat(np.arange(num_rows), scheduled)
        cu = np.zeros(num_rows + 1, dtype=np.int32)
        np.cumsum(scheduled, out=cu[1:])
        positions = np.arange(cu[-1], dtype=np.int64) - cu[row_of_token] + computed[row_of_token]
        slot_of_token = slots[row_of_token]
        slot_mapping = st.block_tables[slot_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        context_lens = (computed + scheduled).astype(np.int32)
        max_blocks = int(-(-context_lens.max() // bs))
        tables = st.block_tables[slots, :max_blocks]
        # A row that computed its slot's last known token produced the next one; it becomes the
        # slot's next input. Mid-prompt chunks sample too, but that token is discarded.
        output = context_lens == st.num_known[slots]
        grew = np.flatnonzero(output & (context_lens < self.max_model_len))
        tail = self.tail.plan(desc, slots, output, computed, scheduled, cu)
        is_decode = bool((scheduled == 1).all())
        # Prompt logprobs need every position's hidden state, which the graphs do not keep.
        if is_decode and self.graphs is not None and num_rows <= self.graphs.max_batch and (
                tail is None or tail.prompt is None):
            sampled = self._run_graph(slots, positions, slot_mapping, context_lens, tables, grew, tail)
            st.num_computed[slots] = context_lens
            st.num_known[slots[grew]] += 1
            return sampled, tail
        (positions_t, slot_of_token_t, slot_mapping_t, last_rows_t, grew_t, grew_slots_t, grew_pos_t, cu_t,
         context_lens_t, tables_t, order_t) = self.upload(
            positions, slot_of_token, slot_mapping, (cu[1:] - 1).astype(np.int64), grew.astype(np.int64),
            slots[grew], context_lens[grew].astype(np.int64), cu, context_lens, tables,
            longest_first(context_lens) if is_decode else np.zeros(0, dtype=np.int32))
        input_ids = st.token_buf[slot_of_token_t, positions_t]
        set_context(AttentionContext(is_decode=is_decode, slot_mapping=slot_mapping_t, cu_seqlens_q=cu_t,
                                     max_seqlen_q=int(scheduled.max()), context_lens=context_lens_t,
                                     max_context_len=int(context_lens.max()), block_tables=tables_t,
                                     decode_order=order_t if is_decode else None))
        hidden = self.model(input_ids, positions_t)
        reset_context()
        if tail is not None and tail.prompt is not None:
            self.tail.prompt_logprobs(tail, hidden, self.model.compute_logits, st.token_buf)
        sampled = self._head_and_sample(hidden if is_decode else hidden[last_rows_t], slots, tail)
        st.num_computed[slots] = context_lens
        if len(grew):
            st.token_buf[grew_slots_t, grew_pos_t] = sampled[grew_t]
            st.num_known[slots[grew]] += 1
        return sampled, tail

    def _run_graph(self, slots: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                   context_lens: np.ndarray, tables: np.ndarray, grew: np.ndarray,
                   tail: TailStep | None) -> torch.Tensor:
        """A decode step through the captured graphs; the sampled ids, already in the token buffer.
        A step with a sampling tail runs its processors between the model's graph and the tail's."""
        st, graphs = self.state, self.graphs
        write_pos = np.full(len(slots), graphs.pad_col, dtype=np.int64)
        write_pos[grew] = context_lens[grew]
        args = (self.upload, slots, positions, slot_mapping, write_pos, context_lens, tables)
        if graphs.with_head:
            temperature = st.temperature[slots]
            filtered = filtered_rows(st.top_k[slots], st.top_p[slots], st.min_p[slots]).any()
            if not temperature.any() or (graphs.sample_tails and not filtered):
                keys = offsets = None
                if temperature.any():
                    keys, offsets = self.sampler.streams(st.seeds[slots], st.num_known[slots])
                if tail is None:
                    return graphs.run(*args, temperature, keys, offsets)
                sampled = graphs.run(*args, temperature, keys, offsets, between=lambda lg: self.tail.before(tail, lg))
                self.tail.after(tail, sampled)
                return sampled
            sampled = self._sample(graphs.run(*args), slots, tail)
        else:
            sampled = self._head_and_sample(graphs.run(*args), slots, tail)
        graphs.scatter(sampled)
        return sampled

    def _head_and_sample(self, hidden: torch.Tensor, slots: np.ndarray, tail: TailStep | None) -> torch.Tensor:
        """The LM head and the sampler over the rows' last hidden states: the ids, on every rank."""
        st = self.state
        # Tensor parallelism with the fused sampler draws from vocabulary slices unless a row filters
        # or the step has a sampling tail (processors, logprobs: they want whole rows).
        if (self.world_size > 1 and self.sampler.fused and (tail is None or not tail.samples)
                and not filtered_rows(st.top_k[slots], st.top_p[slots], st.min_p[slots]).any()):
            return self._sample_slices(hidden, slots)
        logits = self.model.compute_logits(hidden)
        if self.rank == 0:
            sampled = self._sample(logits, slots, tail)
        else:
            sampled = torch.empty(len(slots), dtype=torch.int64, device=self.device)
            self.sampler.advance(st.temperature[slots], st.top_k[slots], st.top_p[slots], st.min_p[slots])
        if self.world_size > 1:
            dist.broadcast(sampled, src=0)
        return sampled

    def _sample_slices(self, hidden: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """Tensor parallelism without gathering the logits: each rank draws from its slice of the
        vocabulary with the noise the whole row would get, and the ranks swap their best (score,
        column) pairs, 8 bytes a row instead of the row's logits (39 MB at 256 rows of Qwen3)."""
        from nanoplane import kernels

        st = self.state
        temperature = st.temperature[slots]
        if temperature.any():  # every rank takes the same streams: the slices' noise is the whole row's
            keys, offsets = self.sampler.streams(st.seeds[slots], st.num_known[slots])
        else:
            keys = offsets = np.zeros(len(slots), dtype=np.int64)
        t, keys_t, offsets_t = self.upload(temperature, keys, offsets)
        head = self.model.lm_head
        best, idx = kernels.sample_partial(self.model.compute_logits(hidden, gather=False), head.vocab_start,
                                           head.num_embeddings, t, keys_t, offsets_t)
        every = torch.empty(self.world_size * 2, len(slots), dtype=torch.int32, device=self.device)
        _all_gather_single(every, torch.stack([best.view(torch.int32), idx]))  # rank r's pair: rows 2r, 2r + 1
        return kernels.combine_partials(every[0::2].view(torch.float32), every[1::2])

    def _sample(self, logits: torch.Tensor, slots: np.ndarray, tail: TailStep | None = None) -> torch.Tensor:
        st = self.state
        if tail is not None and tail.samples:
            self.tail.before(tail, logits)
        temperature = st.temperature[slots]
        if not temperature.any():  # all greedy: no parameters to upload, no sync
            sampled = logits.argmax(dim=-1)
        else:
            # Raw logits: the fused path reads them once as they are; the torch path makes its fp32 copy.
            sampled = self.sampler.sample(logits, temperature, st.top_k[slots], st.top_p[slots], st.min_p[slots],
                                          st.seeds[slots], st.num_known[slots], upload=self.upload)
        if tail is not None and tail.samples:
            self.tail.after(tail, sampled)
        return sampled

    def close(self) -> None:
        """Release the GPU memory now, not whenever the garbage collector finds the model."""
        for layer in kv_cache.attention_layers(self.model):
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.model = self.state = self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        set_fast_all_reduce(None)
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); the device image has 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
