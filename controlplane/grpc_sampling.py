"""Generate's conversions between nanoplane.v1 and the engine: the request's sampling parameters in
(each bad value refused with its field named), each sample's outputs out (its own text stream and stop
matcher, logprobs, finish and stop reason, usage over every sample).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from nanoplane.controlplane.detokenizer import TextStream, ended_by_token
from nanoplane.controlplane.front import EngineFront, Output
from nanoplane.controlplane.metrics import RequestMetrics
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason, Logprob
from nanoplane.controlplane.tokenizer import Tokenizer
from nanoplane.proto.nanoplane.v1 import generation_pb2 as pb

# Bounds on what one request may ask of the event loop that serves every stream (each stop string
# is matched against the text at every message, on the event loop).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
FINISH_REASONS = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.EOS: pb.FINISH_REASON_EOS,
                  FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.ABORT: pb.FINISH_REASON_ABORT}
# Proto fields copied as they are when set (optional) or always (plain); floats go through _f32.
_OPTIONAL = ("temperature", "top_p", "max_tokens", "seed", "repetition_penalty", "logprobs", "prompt_logprobs", "n",
             "skip_special_tokens", "spaces_between_special_tokens")
_FLOATS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
_PLAIN = ("top_k", "min_p", "min_tokens", "ignore_eos", "presence_penalty", "frequency_penalty",
          "include_stop_str_in_output")


def _f32(x: float) -> float:
    # proto floats are float32: 0.7 arrives as 0.699999988. Seven significant digits give back
    # the number the client wrote, for sampling and for error messages alike.
    return float(f"{x:.7g}") if math.isfinite(x) else x


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Engine sampling parameters; raises ValueError naming the field (INVALID_ARGUMENT)."""
    if any(not s for s in sp.stop):
        raise ValueError("invalid sampling parameter stop: stop strings must not be empty")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"invalid sampling parameter stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids "
                         f"(got {len(sp.stop_token_ids)})")
    if len(sp.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in sp.stop):
        raise ValueError(f"invalid sampling parameter stop: at most {MAX_STOP_STRINGS} stop strings of at most "
                         f"{MAX_STOP_STRING_CHARS} characters each (got {len(sp.stop)}, the longest "
                         f"{max(map(len, sp.stop))} characters)")
    kwargs: dict = {name: getattr(sp, name) for name in _PLAIN}
    kwargs.update((name, getattr(sp, name)) for name in _OPTIONAL if sp.HasField(name))
    for name in _FLOATS.intersection(kwargs):
        kwargs[name] = _f32(kwargs[name])
    kwargs.update(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                  logit_bias={token: _f32(bias) for token, bias in sp.logit_bias.items()})
    kind = sp.WhichOneof("structured")
    if kind is not None:
        value = getattr(sp, kind)
        kwargs["structured"] = {kind: list(value.choices) if kind == "choice" else value}
    return SamplingParams(**kwargs)


def logprobs_to_proto(entries: Sequence[Logprob | None]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries if e is not None]


@dataclasses.dataclass(slots=True)
class _Sample:
    text: TextStream
    ended: bool = False  # its last message is sent (the engine may still be producing past a stop string)
    completion_tokens: int = 0


class SampleStreams:
    """One Generate call's n samples, turned message by message into GenerateResponses."""

    def __init__(self, request_id: str, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.request_id, self.params = request_id, params
        self.samples = [_Sample(TextStream.for_params(tokenizer, prompt_ids, params)) for _ in range(params.n)]
        self.left = params.n  # samples whose last message is still to come
        self.first = True

    async def run(self, front: EngineFront, token_ids: Sequence[int], timeout_s: float | None,
                  measure: RequestMetrics) -> AsyncIterator[tuple[Output, pb.GenerateResponse]]:
        """Run the request on `front`: each engine output with its sample's message, until every sample
        has ended (either protocol's servicer reshapes the message). Closing this early (client gone,
        error) closes the engine stream, which aborts the request and frees its blocks within a step;
        a stop string that ends one sample of several ends it in the engine while the others go on."""
        async with aclosing(front.generate(token_ids, self.params, self.request_id, timeout_s)) as outputs:
            async for out in outputs:
                response, stopped = self.response(out)
                if response is None:  # a sample a stop string ended: the engine's tokens past it are dropped
                    continue
                # The request's metrics end with its last sample.
                measure.output(out if self.done or not response.finish_reason
                               else dataclasses.replace(out, finished=False), stopped and self.done)
                yield out, response
                if self.done:
                    return
                if stopped:  # one sample of several: the others go on, this one ends in the engine now
                    front.stop_sample(self.request_id, out.index, response.stop_string)

    @property
    def done(self) -> bool:
        """Every sample's last message is sent: the stream ends (and the request is aborted if the
        engine still runs a sample that a stop string ended)."""
        return not self.left

    def response(self, out: Output) -> tuple[pb.GenerateResponse | None, bool]:
        """The message for `out` (None: its sample has ended already) and whether a stop string ended it."""
        sample = self.samples[out.index]
        if sample.ended:
            return None, False
        # An end-of-sequence or stop id that ended the sample stays in token_ids; its text is left out.
        text = sample.text.push(out.token_ids, out.finished,
                                out.finished and ended_by_token(out.finish_reason, out.stop_reason))
        stopped = sample.text.stopped
        response = pb.GenerateResponse(request_id=self.request_id, token_ids=out.token_ids, index=out.index)
        if out.logprobs:
            response.logprobs.extend(logprobs_to_proto(out.logprobs))
        if out.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
        sample.completion_tokens = out.num_completion_tokens
        if stopped:
            response.finish_reason, response.stop_string = pb.FINISH_REASON_STOP, sample.text.stop_reason
        elif out.finished:
            response.finish_reason = FINISH_REASONS[out.finish_reason or FinishReason.STOP]
            if isinstance(out.stop_reason, str):
                response.stop_string = out.stop_reason
            elif out.stop_reason is not None:
                response.stop_token_id = out.stop_reason
        response.text = text
        if response.finish_reason:
            sample.ended = True
            self.left -= 1
        if self.first or self.done:
            response.usage.CopyFrom(pb.Usage(
                prompt_tokens=out.num_prompt_tokens, cached_prompt_tokens=out.num_cached_tokens,
                completion_tokens=sum(s.completion_tokens for s in self.samples)))
        self.first = False
        return response, stopped
