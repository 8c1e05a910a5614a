"""The embedded engine: `LLM(model).generate(prompts, params)`, nano-vllm's API.

The same engine loop as the service, wired to an in-process data plane instead of ZeroMQ. This is
the one control-plane module allowed to bring in torch (through the data plane).
"""

from __future__ import annotations

import atexit
import gc
from time import perf_counter

from tqdm.auto import tqdm

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.detokenizer import TextStream, ended_by_token
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import Logprob, Sequence
from nanoplane.controlplane.tokenizer import Tokenizer
from nanoplane.settings import ENGINE_OPTIONS, dataplane_fields


class LLM:
    def __init__(self, model: str, **kwargs):
        """`kwargs`: the engine options of nanoplane.settings (ENGINE_OPTIONS), as EngineConfig takes them."""
        unknown = sorted(set(kwargs) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(f"LLM() got unknown engine options {unknown}; it takes {', '.join(ENGINE_OPTIONS)}")
        import torch

        from nanoplane.dataplane.config import DataPlaneConfig
        from nanoplane.dataplane.local import LocalDataPlane

        if kwargs.get("device", "auto") == "auto":
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        self.config = cfg = EngineConfig(model, **kwargs)
        self.tokenizer = Tokenizer(cfg.model)
        data_plane = LocalDataPlane(DataPlaneConfig(**dataplane_fields(cfg)))
        self.engine = Engine(cfg, data_plane, self.tokenizer.eos_token_ids)
        atexit.register(self.close)
        # Start-up leaves hundreds of thousands of objects (torch, the model, Triton's kernels, CUDA
        # graphs) that a full collection would walk mid-run, stalling a step: they go to the permanent
        # generation while this LLM lives, and back at close().
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
        """Run prompts to completion; returns one dict per prompt, in input order: "text", "token_ids",
        "finish_reason" ("stop", "eos", "length" or "abort"), "stop_reason" (the stop token id or stop
        string that ended it, else None), "logprobs" (with SamplingParams.logprobs: one {token id:
        logprob} per output token, its own token included; else None) and "prompt_logprobs" (with
        SamplingParams.prompt_logprobs: the same per prompt token, None for the first; else None).
        With n > 1 these are sample 0's, and "outputs" holds a dict per sample (text, token_ids,
        finish_reason, stop_reason, logprobs), in sample order.

        One bad prompt raises ValueError ("prompt i: ...") and the call leaves no request behind. With
        a step kept in flight, prompts are checked and queued a step's worth ahead of the scheduler
        (each group checked whole before any of it is queued), so the first step starts after one
        step's worth of prompts' host work, not all of theirs. Without prefix-cache hits (which take no
        budget) every step is the one it would be with all of them queued at once.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling parameter sets")
        ids = [self._prompt_ids(p) for p in prompts]
        budget = self.engine.scheduler.max_num_batched_tokens if self.engine.overlap else None
        seqs: list = []
        queued_tokens = steps = 0
        pbar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        texts: dict[int, str] = {}  # seq_id -> its final text
        streams: dict[int, tuple[TextStream, list[str]]] = {}  # requests with stop strings: text as it comes
        while True:
            if len(seqs) < len(ids):
                # Steps 0..steps take at most (steps + 1) * budget prompt tokens: with more queued, the
                # scheduler (which admits in order) makes the same choice as with every prompt queued.
                stop, tokens = len(seqs), queued_tokens
                while stop < len(ids) and (budget is None or tokens <= (steps + 1) * budget):
                    tokens += len(ids[stop])
                    stop += 1
                try:
                    queued = self._queue(ids, sampling_params, len(seqs), stop)
                except ValueError:
                    self._abandon(seqs)
                    pbar.close()
                    raise
                seqs += queued
                queued_tokens = tokens
                for seq in queued:
                    if seq.params.stop:
                        for sample in seq.group:  # each sample has its own text and its own stop
                            streams[sample.seq_id] = (TextStream.for_params(self.tokenizer, sample.token_ids,
                                                                            sample.params), [])
            if not self.engine.has_work():
                break
            t = perf_counter()
            out = self.engine.step()
            dt = perf_counter() - t
            steps += 1
            # A stop string must end its request at once (the rest of its generation is wasted work):
            # requests with stop strings are detokenized as their tokens come.
            stopped = self._follow_stops(out.produced, streams, texts) if streams else []
            # With a step in flight the GPU is busy now: a finished request is detokenized here rather
            # than all of them after the last step, when nothing would hide the time.
            for seq in out.finished:
                if seq.seq_id not in texts:
                    texts[seq.seq_id] = self._text(seq)
            if out.is_prefill:
                prefill_tps = out.num_tokens / dt
            elif out.num_tokens:
                decode_tps = out.num_tokens / dt
            pbar.set_postfix(Prefill=f"{int(prefill_tps)}tok/s", Decode=f"{int(decode_tps)}tok/s")
            # A request is done once all its samples are.
            pbar.update(len({s.group[0].seq_id for s in out.finished + stopped if all(x.is_finished for x in s.group)}))
        pbar.close()
        results = []
        for seq in seqs:
            result = self._result(seq, texts)
            if seq.params.n > 1:
                result["outputs"] = [self._result(s, texts) for s in seq.group]
                for sample in result["outputs"]:
                    del sample["prompt_logprobs"]  # the prompt's are the request's, at the top level
            results.append(result)
        return results

    def _follow_stops(self, produced: list[tuple[Sequence, int]], streams: dict[int, tuple[TextStream, list[str]]],
                      texts: dict[int, str]) -> list[Sequence]:
        """Detokenize the new tokens of requests with stop strings; end each whose text reached one.
        Returns those that ended by a stop string and had not ended otherwise."""
        stopped = []
        for seq, token_id in produced:
            entry = streams.get(seq.seq_id)
            if entry is None:
                continue
            stream, pieces = entry
            pieces.append(stream.push([token_id], seq.is_finished, ended_by_token(seq.finish_reason, seq.stop_reason)))
            if stream.stopped:
                if not seq.is_finished:
                    stopped.append(seq)
                self.engine.stop_on_string(seq, stream.stop_reason)
            if seq.is_finished:
                texts[seq.seq_id] = "".join(pieces)
                del streams[seq.seq_id]
        return stopped

    def _text(self, seq: Sequence) -> str:
        """A finished request's text, with its text options."""
        p = seq.params
        ids = seq.completion_token_ids
        if ended_by_token(seq.finish_reason, seq.stop_reason) and not p.include_stop_str_in_output:
            ids = ids[:-1]  # vLLM leaves the ending token's text out
        return self.tokenizer.decode(ids, p.skip_special_tokens, p.spaces_between_special_tokens)

    def _result(self, seq: Sequence, texts: dict[int, str]) -> dict:
        """One sample's result: text, token_ids, finish_reason, stop_reason, logprobs, prompt_logprobs
        (the last two None unless asked)."""
        return {"text": texts[seq.seq_id] if seq.seq_id in texts else self._text(seq),
                "token_ids": seq.completion_token_ids,
                "finish_reason": None if seq.finish_reason is None else seq.finish_reason.value,
                "stop_reason": seq.stop_reason,
                "logprobs": None if seq.logprobs is None else [_as_dict(e) for e in seq.logprobs],
                "prompt_logprobs": None if seq.prompt_logprobs is None else
                [None if e is None else _as_dict(e) for e in seq.prompt_logprobs]}

    def _queue(self, ids: list[list[int]], params: list[SamplingParams], start: int, stop: int) -> list:
        """Check prompts [start, stop), then queue them: none of them is queued if one is bad.
        Their grammars compile together on the compiler's pool while the prompts are checked."""
        compiles = {i: self.engine.grammars.submit(params[i].structured) for i in range(start, stop)
                    if params[i].structured is not None}
        for i in range(start, stop):
            try:
                self.engine.validate(ids[i], params[i])
                if i in compiles:
                    compiles[i] = compiles[i].result()
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return [self.engine.add_request(ids[i], params[i], validated=True, grammar=compiles.get(i))
                for i in range(start, stop)]

    def _abandon(self, seqs: list) -> None:
        """Abort the call's requests. The step still in flight is collected by the engine's next step,
        which skips aborted rows; requests queued before the call stay as they were."""
        for seq in seqs:
            self.engine.abort(seq.seq_id)


def _as_dict(entry: Logprob) -> dict[int, float]:
    """{token id: logprob} of the top alternatives, most likely first, and the position's own token."""
    d = dict(entry.top)
    d[entry.token_id] = entry.logprob
    return d
