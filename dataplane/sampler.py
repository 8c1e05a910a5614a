"""Rank 0's sampler: greedy, temperature, top-k, top-p and min-p, with per-request seeds.

Sampling draws one exponential noise per vocabulary entry and takes argmax(p / noise), which is an
exact draw from p. A seeded request draws its noise from its own generator, so its tokens do not
depend on which other requests share the batch.
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, generators: list[torch.Generator | None], all_greedy: bool | None = None,
                 filtered: bool | None = None) -> torch.Tensor:
        """logits [R, V] float32; parameters [R] on logits' device; returns [R] int64 token ids.

        `all_greedy` and `filtered` may be given by a caller that knows them from host copies of the
        parameters; otherwise they are read from the device (a sync).
        """
        greedy = logits.argmax(dim=-1)
        if all_greedy if all_greedy is not None else bool((temperature == 0).all()):
            return greedy
        logits = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        if filtered is None or filtered:
            logits = apply_filters(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        seeded = [i for i, g in enumerate(generators) if g is not None]
        noise = torch.empty_like(probs).exponential_(generator=self.shared)
        for i in seeded:  # a seeded row's noise comes from its own generator alone
            noise[i].exponential_(generator=generators[i])
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0, greedy, sampled)

    def generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g


def apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit that top-k, top-p or min-p removes (each 0/1/0 disables it per row)."""
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()) and bool((min_p <= 0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    # top-p over what top-k left: keep a token while the mass before it is below top_p, so the most
    # likely token always stays.
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
