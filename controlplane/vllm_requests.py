"""vllm.grpc.engine's Generate in nanoplane's terms: the request's prompt and sampling parameters in
(each field the engine cannot honour refused by name), each sample's outputs out as vLLM's servicer
(smg_grpc_servicer.vllm) shapes them: delta chunks, then a GenerateComplete per sample.

Stop strings, finish and stop reasons come from grpc_sampling.SampleStreams, the one place that
turns engine outputs into samples for either protocol; this module only reshapes its answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from nanoplane.controlplane.front import EngineFacts, Output
from nanoplane.controlplane.grpc_sampling import _f32
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import Logprob
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb

# nanoplane.v1's finish reasons as vLLM names them (end-of-sequence is vLLM's "stop", without a matched stop).
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_ABORT: "abort"}
_PLAIN = ("top_k", "min_tokens", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
          "include_stop_str_in_output")
_FLOATS = ("min_p", "presence_penalty", "frequency_penalty")


def refuse_unsupported(request: vpb.GenerateRequest) -> None:
    """What this engine cannot do is refused by name, never ignored."""
    if request.HasField("mm_inputs") or request.extra_mm_inputs or request.HasField("media_refs"):
        field = "mm_inputs" if request.HasField("mm_inputs") else \
            "extra_mm_inputs" if request.extra_mm_inputs else "media_refs"
        raise NotImplementedError(f"{field}: multimodal input is not supported by this engine (a text-only model)")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise NotImplementedError("kv_transfer_params: KV transfer (prefill/decode disaggregation) is not "
                                  "supported by this engine")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise ValueError(f"data_parallel_rank={request.data_parallel_rank}: this engine has one data-parallel "
                         "rank, 0")
    if request.sampling_params.WhichOneof("constraint") == "structural_tag":
        raise NotImplementedError("structural_tag: structural-tag structured output is not supported by this "
                                  "engine; use json_schema, regex, grammar, choice or json_object")


def truncate_prompt(token_ids: list[int], sp: vpb.SamplingParams, facts: EngineFacts | None) -> list[int]:
    """truncate_prompt_tokens: keep the last k tokens (-1: the last max_model_len), as vLLM does."""
    if not sp.HasField("truncate_prompt_tokens"):
        return token_ids
    k = sp.truncate_prompt_tokens
    if k == -1 and facts is not None:
        k = facts.max_model_len
    if k < 1:
        raise ValueError(f"invalid sampling parameter truncate_prompt_tokens={sp.truncate_prompt_tokens}: must be "
                         ">= 1, or -1 for max_model_len")
    return token_ids[-k:]


def _count(name: str, value: int) -> int | None:
    if value < 0:
        raise ValueError(f"invalid sampling parameter {name}={value}: -1 (every token's logprob) is not "
                         "supported; ask for at most 20")
    return value


def sampling_from_vllm(sp: vpb.SamplingParams, num_prompt_tokens: int, facts: EngineFacts | None) -> SamplingParams:
    """nanoplane's SamplingParams with vLLM's defaults for unset fields (temperature 1, top_p and
    repetition_penalty 1 when 0, n 1 when 0, max_tokens up to the context); ValueError naming the field."""
    kwargs: dict = {name: getattr(sp, name) for name in _PLAIN}
    kwargs.update((name, _f32(getattr(sp, name))) for name in _FLOATS)
    kwargs.update(temperature=_f32(sp.temperature) if sp.HasField("temperature") else 1.0,
                  top_p=_f32(sp.top_p) if sp.top_p != 0 else 1.0,
                  repetition_penalty=_f32(sp.repetition_penalty) if sp.repetition_penalty != 0 else 1.0,
                  n=sp.n or 1, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                  logit_bias={token: _f32(bias) for token, bias in sp.logit_bias.items()})
    if sp.HasField("max_tokens"):
        kwargs["max_tokens"] = sp.max_tokens
    elif facts is not None:  # vLLM's default: as many as the context (and here the KV cache) leaves
        room = min(facts.max_model_len, facts.kv_capacity_tokens) - num_prompt_tokens
        if room < 1:
            raise ValueError(f"the prompt ({num_prompt_tokens} tokens) leaves no room for output within "
                             f"max_model_len {facts.max_model_len}")
        kwargs["max_tokens"] = room
    if sp.HasField("seed"):
        kwargs["seed"] = sp.seed % 2**63  # a negative int32 seed stays distinct and reproducible
    for name in ("logprobs", "prompt_logprobs"):
        if sp.HasField(name):
            kwargs[name] = _count(name, getattr(sp, name))
    kind = sp.WhichOneof("constraint")
    if kind == "choice":
        kwargs["structured"] = {"choice": list(sp.choice.choices)}
    elif kind == "json_object":
        kwargs["structured"] = {"json_object": True} if sp.json_object else None
    elif kind is not None:  # json_schema, regex, grammar (structural_tag is refused before)
        kwargs["structured"] = {kind: getattr(sp, kind)}
    return SamplingParams(**kwargs)


def output_logprobs(entries: Sequence[Logprob] | None, top: int | None) -> vpb.OutputLogProbs | None:
    if not entries:
        return None
    proto = vpb.OutputLogProbs(token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries])
    if top:
        proto.top_logprobs.extend(vpb.TopLogProbs(values=[lp for _, lp in e.top[:top]],
                                                  token_ids=[t for t, _ in e.top[:top]]) for e in entries)
    return proto


def input_logprobs(entries: Sequence[Logprob | None] | None, prompt_ids: Sequence[int],
                   top: int | None) -> vpb.InputLogProbs | None:
    """The prompt's logprobs, one per prompt token (the first has no value)."""
    if not entries:
        return None
    proto = vpb.InputLogProbs(token_ids=prompt_ids)
    for e in entries:
        proto.token_logprobs.append(vpb.InputTokenLogProb() if e is None else vpb.InputTokenLogProb(value=e.logprob))
        if top:
            proto.top_logprobs.append(vpb.TopLogProbs() if e is None else vpb.TopLogProbs(
                values=[lp for _, lp in e.top[:top]], token_ids=[t for t, _ in e.top[:top]]))
    return proto


@dataclasses.dataclass(slots=True)
class _Sample:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    sent_prompt_logprobs: bool = False


class VllmResponses:
    """One Generate call's messages: per engine output, the chunk (streaming) and, when its sample
    ends, its GenerateComplete; without streaming every sample's GenerateComplete at the end."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, stream: bool):
        self.prompt_ids, self.params, self.stream = list(prompt_ids), params, stream
        self.samples = [_Sample() for _ in range(params.n)]
        self.completes: list[vpb.GenerateResponse | None] = [None] * params.n
        self.cached_tokens = 0

    def messages(self, out: Output, response: pb.GenerateResponse) -> list[vpb.GenerateResponse]:
        """The messages for engine output `out`, whose sample SampleStreams answered with `response`."""
        sample = self.samples[out.index]
        self.cached_tokens = out.num_cached_tokens
        sample.token_ids.extend(out.token_ids)
        sample.logprobs.extend(out.logprobs or ())
        sample.prompt_logprobs = sample.prompt_logprobs or out.prompt_logprobs
        messages = []
        if self.stream:
            chunk = vpb.GenerateStreamChunk(
                token_ids=out.token_ids, prompt_tokens=len(self.prompt_ids), completion_tokens=len(out.token_ids),
                cached_tokens=out.num_cached_tokens, index=out.index,
                output_logprobs=output_logprobs(out.logprobs, self.params.logprobs))
            if out.prompt_logprobs and not sample.sent_prompt_logprobs:
                sample.sent_prompt_logprobs = True
                chunk.input_logprobs.CopyFrom(input_logprobs(out.prompt_logprobs, self.prompt_ids,
                                                             self.params.prompt_logprobs))
            messages.append(vpb.GenerateResponse(chunk=chunk))
        if response.finish_reason:
            complete = self._complete(out.index, response, out.token_ids if self.stream else sample.token_ids,
                                      out.logprobs if self.stream else sample.logprobs)
            if self.stream:
                messages.append(complete)
            else:
                self.completes[out.index] = complete
        return messages

    def finals(self) -> list[vpb.GenerateResponse]:
        """Without streaming: every sample's GenerateComplete, in index order, once all have ended."""
        return [] if self.stream else [c for c in self.completes if c is not None]

    def _complete(self, index: int, response: pb.GenerateResponse, token_ids: list[int],
                  logprobs: list[Logprob]) -> vpb.GenerateResponse:
        # Streaming: the last delta, as vLLM's servicer sends it (the gateway accumulates the chunks).
        complete = vpb.GenerateComplete(
            output_ids=token_ids, finish_reason=FINISH_REASONS[response.finish_reason],
            prompt_tokens=len(self.prompt_ids), completion_tokens=len(token_ids), cached_tokens=self.cached_tokens,
            index=index, output_logprobs=output_logprobs(logprobs, self.params.logprobs),
            input_logprobs=input_logprobs(self.samples[index].prompt_logprobs, self.prompt_ids,
                                          self.params.prompt_logprobs))
        if response.HasField("stop_string"):
            complete.matched_stop_str = response.stop_string
        elif response.HasField("stop_token_id"):
            complete.matched_token_id = response.stop_token_id
        return vpb.GenerateResponse(complete=complete)
