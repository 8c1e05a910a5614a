"""The embedded engine: `LLM(model).generate(prompts, params)`, nano-vllm's API.

The same engine loop as the service, wired to an in-process data plane instead of ZeroMQ. This is
the one control-plane module allowed to bring in torch (through the data plane).
"""

from __future__ import annotations

import atexit
import gc
from time import perf_counter

from tqdm.auto import tqdm

from controlplane.config import EngineConfig
from controlplane.engine import Engine
from controlplane.sampling_params import SamplingParams
from controlplane.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str, **kwargs):
        import torch

        from dataplane.config import DataPlaneConfig
        from dataplane.local import LocalDataPlane

        if kwargs.get("device", "auto") == "auto":
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        self.config = cfg = EngineConfig(model, **kwargs)
        self.tokenizer = Tokenizer(cfg.model)
        data_plane = LocalDataPlane(DataPlaneConfig(
            model=cfg.model, device=cfg.device, dtype=cfg.dtype, world_size=cfg.tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, block_size=cfg.kvcache_block_size,
            num_kvcache_blocks=cfg.num_kvcache_blocks, gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kvcache_gib=cfg.cpu_kvcache_gib, enforce_eager=cfg.enforce_eager,
            attention_backend=cfg.attention_backend, seed=cfg.seed,
        ))
        self.engine = Engine(cfg, data_plane, self.tokenizer.eos_token_ids)
        atexit.register(self.close)
        # Start-up left ~300k objects (torch, the model, Triton's kernels, CUDA graphs) that a full
        # collection would walk, 200-280 ms on the H200 hosts, mid-run (BENCHMARKS.md): they go to the
        # permanent generation while this LLM lives, and back at close().
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.engine = None
            gc.unfreeze()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Run prompts to completion; returns [{"text", "token_ids"}] in input order.

        Every prompt is checked before any is queued: one bad prompt raises ValueError and runs nothing.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling parameter sets")
        ids = [self._prompt_ids(p) for p in prompts]
        for i, (tokens, sp) in enumerate(zip(ids, sampling_params, strict=True)):
            try:
                self.engine.validate(tokens, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        seqs = [self.engine.add_request(tokens, sp, validated=True)
                for tokens, sp in zip(ids, sampling_params, strict=True)]
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        texts: dict[int, str] = {}
        while self.engine.has_work():
            t = perf_counter()
            out = self.engine.step()
            dt = perf_counter() - t
            # With a step in flight the GPU is busy now: a finished request is detokenized here rather
            # than all of them after the last step, when nothing would hide the time.
            for seq in out.finished:
                texts[seq.seq_id] = self.tokenizer.decode(seq.completion_token_ids)
            if out.is_prefill:
                prefill_tps = out.num_tokens / dt
            elif out.num_tokens:
                decode_tps = out.num_tokens / dt
            pbar.set_postfix(Prefill=f"{int(prefill_tps)}tok/s", Decode=f"{int(decode_tps)}tok/s")
            pbar.update(len(out.finished))
        pbar.close()
        return [{"text": texts[s.seq_id] if s.seq_id in texts else self.tokenizer.decode(s.completion_token_ids),
                 "token_ids": s.completion_token_ids} for s in seqs]
