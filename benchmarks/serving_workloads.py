"""The request streams of `benchmarks/serving.py`: what each workload sends, and when, from a seed.

Every length is multiplied by `scale` (at least one token), so the same shapes run at toy size on a
CPU. Prompts are random token ids below `vocab` (id 0 left out), drawn from a generator seeded by the
workload, the seed and the rate, so a rerun sends the very same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("chat", "shared-prefix", "long")
MAX_ID = 10_000  # prompt ids stay below this (and the model's vocabulary): ordinary tokens of any tokenizer


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the run's start at which it is sent
    kind: str = "request"  # the long workload: "stream" (a steady decoding stream) or "long"


@dataclass(slots=True)
class Shapes:
    """The workloads' sizes at full scale (the issue's), scaled by `scale`."""

    scale: float = 1.0
    chat_prompt: tuple[float, float, int, int] = (256, 1.0, 16, 4096)  # lognormal median, sigma, clipped to [lo, hi]
    chat_output: tuple[float, float, int, int] = (200, 0.8, 16, 1024)
    num_system_prompts: int = 16
    system_prompt: int = 2000
    user_turn: int = 100
    shared_output: int = 128
    long_prompt: int = 32_000
    long_output: int = 16  # a long prompt's output: its first token is what is measured
    long_period_s: float = 2.0
    long_streams: int = 64
    stream_prompt: int = 256
    stream_output: int = 1024  # a steady stream's request; a new one follows when it ends

    def tokens(self, n: float) -> int:
        return max(1, round(n * self.scale))

    def max_model_len(self, workloads: tuple[str, ...]) -> int:
        """The longest prompt plus output the workloads send."""
        need = {"chat": self.tokens(self.chat_prompt[3]) + self.tokens(self.chat_output[3]),
                "shared-prefix": self.tokens(self.system_prompt) + self.tokens(self.user_turn)
                + self.tokens(self.shared_output),
                "long": max(self.tokens(self.long_prompt) + self.tokens(self.long_output),
                            self.tokens(self.stream_prompt) + self.tokens(self.stream_output))}
        return max(need[w] for w in workloads)


def rng_for(*key) -> random.Random:
    return random.Random("/".join(map(str, key)))  # a str seed is hashed the same way in every process


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    top = min(vocab, MAX_ID)
    return [rng.randrange(1, top) for _ in range(n)]


def lognormal(rng: random.Random, shape: tuple[float, float, int, int], sizes: Shapes) -> int:
    median, sigma, lo, hi = shape
    n = round(rng.lognormvariate(math.log(median), sigma))
    return sizes.tokens(min(hi, max(lo, n)))


def poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    """Open-loop arrivals: exponential gaps of mean 1/rate, whatever the server does."""
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def chat(rate: float, n: int, seed: int, vocab: int, sizes: Shapes) -> list[Request]:
    rng = rng_for("chat", seed, rate)
    times = poisson_times(rng, n, rate)
    return [Request(random_ids(rng, lognormal(rng, sizes.chat_prompt, sizes), vocab),
                    lognormal(rng, sizes.chat_output, sizes), at) for at in times]


def system_prompts(seed: int, vocab: int, sizes: Shapes) -> list[list[int]]:
    """The same system prompts at every rate: the prefix cache may keep them between rates."""
    rng = rng_for("system-prompts", seed)
    return [random_ids(rng, sizes.tokens(sizes.system_prompt), vocab) for _ in range(sizes.num_system_prompts)]


def shared_prefix(rate: float, n: int, seed: int, vocab: int, sizes: Shapes) -> list[Request]:
    systems = system_prompts(seed, vocab, sizes)
    rng = rng_for("shared-prefix", seed, rate)
    times = poisson_times(rng, n, rate)
    return [Request(rng.choice(systems) + random_ids(rng, sizes.tokens(sizes.user_turn), vocab),
                    sizes.tokens(sizes.shared_output), at) for at in times]


def long_prompts(n: int, start: float, seed: int, vocab: int, sizes: Shapes) -> list[Request]:
    """One long prompt every period from `start` on."""
    rng = rng_for("long", seed)
    return [Request(random_ids(rng, sizes.tokens(sizes.long_prompt), vocab), sizes.tokens(sizes.long_output),
                    start + i * sizes.long_period_s, "long") for i in range(n)]


def stream_request(rng: random.Random, vocab: int, sizes: Shapes) -> Request:
    return Request(random_ids(rng, sizes.tokens(sizes.stream_prompt), vocab), sizes.tokens(sizes.stream_output),
                   kind="stream")


def warmup(workload: str, seed: int, vocab: int, sizes: Shapes) -> list[Request]:
    """A few requests of the workload's shapes (other ids, so no prefix-cache hits later), sent at once
    before the timed runs, so that kernels are compiled and loaded outside them."""
    rng = rng_for("warmup", workload, seed)
    if workload == "long":
        return [Request(random_ids(rng, sizes.tokens(sizes.long_prompt), vocab), sizes.tokens(sizes.long_output))]
    if workload == "shared-prefix":
        n = sizes.tokens(sizes.system_prompt) + sizes.tokens(sizes.user_turn)
        return [Request(random_ids(rng, n, vocab), sizes.tokens(sizes.shared_output)) for _ in range(4)]
    return [Request(random_ids(rng, lognormal(rng, sizes.chat_prompt, sizes), vocab),
                    lognormal(rng, sizes.chat_output, sizes)) for _ in range(8)]
