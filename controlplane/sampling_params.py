"""Per-request generation parameters, checked when they are made. Names and meanings follow vLLM's."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanoplane.proto.plane import SamplingSpec, int32_column

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (see is_greedy)
MAX_LOGPROBS = 20  # most alternatives logprobs / prompt_logprobs may ask for
MAX_N = 64  # most parallel samples of one prompt
MAX_STOPS = 64  # stop strings per request (each is matched against the text at every message)
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries in logit_bias
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as OpenAI's API does
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    max_tokens: int = 64  # output tokens at most
    min_tokens: int = 0  # end-of-sequence and stop ids cannot end the output before this many tokens
    seed: int | None = None  # makes sampling reproducible for this request alone (sample i of n uses seed + i)
    ignore_eos: bool = False  # keep going past the end-of-sequence token (benchmarks)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the output (kept in it)
    stop: list[str] = field(default_factory=list)  # strings that end the output (cut from it by default)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in its text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # put a space between a special token and its neighbours' text
    presence_penalty: float = 0.0  # in [-2, 2]: subtract from tokens the output already holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtract, times how often the output holds the token
    repetition_penalty: float = 1.0  # in (0, 2]: HuggingFace's penalty over prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, clamped to [-100, 100]
    logprobs: int | None = None  # the sampled token's logprob and the top N (N <= 20) per output token
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top N, from the second token on
    n: int = 1  # parallel samples of the prompt (prefilled once)
    # Structured output: a dict with exactly one key of STRUCTURED_KINDS: json_schema (a schema dict or
    # its JSON text), json_object (True), regex (a pattern), choice (a list of strings), grammar (EBNF).
    structured: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called again before a request is queued."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63) or None")
        if not isinstance(self.stop_token_ids, (list, tuple)) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS \
                or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOPS \
                or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"must be at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "must be in (0, 2] (1 disables)")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS \
                or any(not is_int(k) or k < 0 or not is_number(v) for k, v in self.logit_bias.items()):
            raise bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} non-negative token ids to finite numbers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.structured is not None:
            self._validate_structured()

    def _validate_structured(self) -> None:
        """The shape of `structured`; whether the grammar compiles is the compiler's to say (INVALID_ARGUMENT)."""
        s = self.structured
        if not isinstance(s, dict) or len(s) != 1 or next(iter(s)) not in STRUCTURED_KINDS:
            raise ValueError(f"invalid sampling parameter structured={s!r}: must be a dict with exactly one "
                             f"of the keys {', '.join(STRUCTURED_KINDS)}")
        kind, value = next(iter(s.items()))
        ok = {
            "json_schema": isinstance(value, (dict, str)) and bool(value),
            "json_object": value is True,
            "regex": isinstance(value, str) and bool(value),
            "choice": isinstance(value, (list, tuple)) and bool(value) and all(isinstance(c, str) for c in value),
            "grammar": isinstance(value, str) and bool(value),
        }[kind]
        if kind == "json_schema" and isinstance(value, str) and ok:
            try:
                ok = isinstance(json.loads(value), dict)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid sampling parameter structured.json_schema: not JSON ({e})") from None
        if not ok:
            want = {"json_schema": "a JSON schema (a dict or its JSON text)", "json_object": "True",
                    "regex": "a non-empty pattern", "choice": "a non-empty list of strings",
                    "grammar": "non-empty EBNF text"}[kind]
            raise ValueError(f"invalid sampling parameter structured.{kind}={value!r}: must be {want}")

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_BELOW, logits / temperature overflows float32 (inf - inf: NaN probabilities,
        # and argmax then returns token 0 every step); such a temperature is greedy in all but name.
        return self.temperature < GREEDY_BELOW

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of n: seed + index, so sample i equals an n=1 run with that seed."""
        return None if self.seed is None else (self.seed + index) % 2**63

    def to_spec(self, eos_token_ids: tuple[int, ...] | list[int] = (), index: int = 0) -> SamplingSpec:
        """The part of the parameters the data plane's sampler needs, for sample `index`.
        `eos_token_ids`: the model's; with the stop ids they are what min_tokens masks."""
        stop_ids: list[int] = []
        if self.min_tokens:
            stop_ids = sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))
        bias = sorted(self.logit_bias.items())
        return SamplingSpec(
            temperature=0.0 if self.is_greedy else float(self.temperature),
            top_k=max(self.top_k, 0),
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            seed=self.sample_seed(index),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            min_tokens=self.min_tokens,
            stop_ids=int32_column(stop_ids),
            logit_bias_ids=int32_column([k for k, _ in bias]),
            logit_bias_values=np.clip(np.array([v for _, v in bias], np.float32), -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT),
            logprobs=-1 if self.logprobs is None else self.logprobs,
            prompt_logprobs=-1 if self.prompt_logprobs is None else self.prompt_logprobs,
        )
