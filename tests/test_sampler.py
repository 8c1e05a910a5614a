"""The sampler: greedy, seeded determinism independent of the batch, and the top-k/top-p/min-p masks."""

from __future__ import annotations

import torch

from dataplane.sampler import Sampler, apply_filters

V = 50


def params(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return (full(temperature, torch.float32), full(top_k, torch.int32), full(top_p, torch.float32),
            full(min_p, torch.float32))


def test_greedy_is_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    s = Sampler(torch.device("cpu"))
    assert torch.equal(s(logits, *params(6, temperature=0.0), [None] * 6), logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    t, k, p, m = params(4)
    t[1] = 0.0
    out = Sampler(torch.device("cpu"))(logits, t, k, p, m, [None] * 4)
    assert out[1] == logits[1].argmax()


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    s = Sampler(torch.device("cpu"), seed=3)
    draws_alone, draws_batched = [], []
    g1, g2 = s.generator(1234), s.generator(1234)
    for _ in range(20):
        draws_alone.append(int(s(logits[2:3], *params(1), [g1])[0]))
        batch = s(logits, *params(5), [None, None, g2, None, None])
        draws_batched.append(int(batch[2]))
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    s = Sampler(torch.device("cpu"), seed=0)
    rows = 4000
    counts = torch.bincount(s(logits.expand(rows, 4), *params(rows), [None] * rows), minlength=4).float() / rows
    assert torch.allclose(counts, probs, atol=0.03)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).expand(3000, 2)
    s = Sampler(torch.device("cpu"), seed=0)
    hot = s(logits, *params(3000, temperature=2.0), [None] * 3000).float().mean()
    cold = s(logits, *params(3000, temperature=0.25), [None] * 3000).float().mean()
    assert cold < hot  # token 1 (the less likely) is drawn less often when cold


def test_top_k_keeps_k_most_likely():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    _, k, p, m = params(3, top_k=5)
    out = apply_filters(logits, k, p, m)
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [5, 5, 5]
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(-1, logits.topk(5).indices, True))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    _, k, p, m = params(1, top_p=0.7)
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, True, False, False]]
    _, k, p, m = params(1, top_p=0.5)  # the top token alone reaches 0.5
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, False, False, False]]
    _, k, p, m = params(1, top_p=0.01)  # the most likely token always stays
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, False, False, False]]


def test_min_p_and_per_row_settings():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]]))
    t, k, p, m = params(2)
    m[0] = 0.4  # drops tokens under 0.24
    assert torch.isfinite(apply_filters(logits, k, p, m)).tolist() == [[True, True, False], [True, True, True]]


def test_sampled_tokens_respect_top_k():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5)).expand(500, V)
    s = Sampler(torch.device("cpu"), seed=1)
    out = s(logits, *params(500, top_k=3), [None] * 500)
    assert set(out.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(out.tolist())) == 3
