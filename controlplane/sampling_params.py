"""Per-request generation parameters, checked when they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanoplane.proto.plane import SamplingSpec

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (see is_greedy)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    max_tokens: int = 64  # output tokens at most
    seed: int | None = None  # makes sampling reproducible for this request alone
    ignore_eos: bool = False  # keep going past the end-of-sequence token (benchmarks)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the output

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called again before a request is queued."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer in [0, 2**63) or None")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_BELOW, logits / temperature overflows float32 (inf - inf: NaN probabilities,
        # and argmax then returns token 0 every step); such a temperature is greedy in all but name.
        return self.temperature < GREEDY_BELOW

    def to_spec(self) -> SamplingSpec:
        """The part of the parameters the data plane's sampler needs."""
        return SamplingSpec(
            temperature=0.0 if self.is_greedy else float(self.temperature),
            top_k=max(self.top_k, 0),
            top_p=float(self.top_p),
            min_p=float(self.min_p),
            seed=self.seed,
        )
