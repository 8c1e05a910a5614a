"""The fused sampling kernel (kernels/sampling.py) against its fp32 torch twin, and its noise.

Without CUDA the kernel runs in Triton's interpreter at about 15 ms a program (one program per row),
so the CPU cases use few rows; the real shapes are in the `gpu`-marked cases at the end.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (see tests/kernels/test_layer_kernels.py)

import zlib  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from nanoplane.kernels import combine_partials, sample, sample_partial  # noqa: E402
from nanoplane.kernels import reference as ref  # noqa: E402
from nanoplane.kernels.sampling import GROUP, sampling_uniforms  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (block, num_splits): the launcher's choice, and one group a tile over several programs per row (the
# path a GPU takes for a batch of few rows) so that tile and split boundaries are crossed.
LAUNCHES = [(None, None), (64, 3)]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def streams(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys over the whole int64 range and offsets past 2**32 / V (the counter's high word)."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, device=DEV)
    offsets = torch.randint(0, 2**40, (rows,), dtype=torch.int64, device=DEV)
    return seeds, offsets


def assert_reference_draws(ids: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                           seeds: torch.Tensor, offsets: torch.Tensor, cuts: tuple[int, ...] = ()) -> None:
    """The kernel's ids are the fp64 reference's given the kernel's uniforms.

    Exactly, but for a near-tie of two scores: the kernel sums exponentials in fp32 (and its exp2
    and logs are not torch's to the last bit), which can swap two scores within rounding of each other.
    """
    u = sampling_uniforms(seeds, offsets, logits.shape[1])
    expected = ref.sample_reference(logits, temperature, u, cuts)
    assert ids.dtype == torch.int64 and ids.shape == expected.shape
    differ = (ids != expected).nonzero().flatten().tolist()
    gid, group_scores, column_scores = ref.group_draw_scores(logits, temperature, u, cuts)

    def near(best: float, got: float) -> bool:
        return abs(best - got) <= 1e-5 * max(1.0, abs(best))

    for r in differ:
        g_best, g_got = int(gid[expected[r]]), int(gid[ids[r]])
        assert near(group_scores[r, g_best].item(), group_scores[r, g_got].item()), \
            f"row {r}: kernel's group {g_got} against the reference's {g_best}"
        top = column_scores[r][gid == g_got].max().item()
        assert near(top, column_scores[r, ids[r]].item()), f"row {r}: kernel {int(ids[r])} is not its group's best"
    assert len(differ) <= max(1, ids.numel() // 100), f"{len(differ)} near-ties is too many: {differ}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [37, 1000])
@pytest.mark.parametrize("block,num_splits", LAUNCHES)
def test_matches_reference_given_the_uniforms(dtype, vocab, block, num_splits):
    rows = 7
    # A view with a row stride wider than V: the kernel must not assume contiguous rows.
    wide = torch.randn(rows, vocab + 13, device=DEV) * 4
    logits = wide.to(dtype)[:, :vocab]
    logits[6] = 0.0  # flat: its draw is the argmax (column 0) one time in V
    temperature = torch.tensor([1.0, 0.0, 0.7, 2.5, 0.0, 1e-3, 1.0], device=DEV)
    seeds, offsets = streams(rows)
    ids = sample(logits, temperature, seeds, offsets, block=block, num_splits=num_splits)
    assert_reference_draws(ids, logits, temperature, seeds, offsets)
    greedy = logits.float().argmax(-1)
    assert torch.equal(ids[temperature == 0], greedy[temperature == 0])
    assert (ids[temperature > 0.5] != greedy[temperature > 0.5]).any()  # the noise really draws


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,num_splits", LAUNCHES)
def test_greedy_is_argmax_with_ties_to_the_lowest_index(dtype, block, num_splits):
    rows, vocab = 6, 301
    # Few distinct values: every row has its maximum several times, across tiles and splits.
    logits = torch.randint(-3, 4, (rows, vocab), device=DEV).to(dtype)
    logits[0, :] = float("-inf")  # nothing finite: torch.argmax answers 0
    logits[1, 250] = float("inf")
    temperature = torch.zeros(rows, device=DEV)
    seeds, offsets = streams(rows)
    ids = sample(logits, temperature, seeds, offsets, block=block, num_splits=num_splits)
    assert torch.equal(ids, logits.float().argmax(-1))
    assert ids[0] == 0 and ids[1] == 250


def spread_logits(vocab: int = 300) -> torch.Tensor:
    """-inf but for six columns over five groups of 64 (two in one group, one in the short last)."""
    logits = torch.full((vocab,), float("-inf"), device=DEV)
    logits[torch.tensor([3, 70, 130, 131, 200, 299])] = torch.tensor([2.0, 1.0, 0.0, 0.5, -1.0, 1.5], device=DEV)
    return logits


def assert_follows_softmax(ids: torch.Tensor, logits: torch.Tensor, temperature: float, slack: float) -> None:
    """Each column drawn within 4.5 sigma (+ slack) of its softmax(logits / T) share; -inf never."""
    freq = torch.bincount(ids.cpu(), minlength=logits.numel()).double() / ids.numel()
    probs = torch.softmax(logits.double().cpu() / temperature, -1)
    sigma = (probs * (1 - probs) / ids.numel()).sqrt()
    assert freq[probs == 0].sum() == 0  # a -inf logit is never drawn
    assert ((freq - probs).abs() <= 4.5 * sigma + slack).all(), (freq.tolist(), probs.tolist())


@pytest.mark.parametrize("logits,temperature,seed", [
    ([2.0, 1.0, 0.0, float("-inf"), -1.0], 0.5, 1234),
    ([2.0, 1.0, 0.0, float("-inf"), -1.0], 2.0, 1234),
    (None, 0.7, 77),  # spread_logits: draws across five groups
])
def test_frequencies_follow_softmax(logits, temperature, seed):
    # 300 kernel draws (interpreter cost): loose, but tells T from 1/T and catches a biased noise.
    logits = spread_logits() if logits is None else torch.tensor(logits, device=DEV)
    rows = 300 if DEV == "cpu" else 100_000
    seeds = torch.full((rows,), seed, dtype=torch.int64, device=DEV)
    offsets = torch.arange(rows, dtype=torch.int64, device=DEV)
    ids = sample(logits.expand(rows, -1), torch.full((rows,), temperature, device=DEV), seeds, offsets)
    assert_follows_softmax(ids, logits, temperature, 1e-3)


@pytest.mark.parametrize("cuts", [(), (131, 150)])
def test_group_draws_follow_softmax(cuts):
    # The two-level draw, given uniform noise: each group must get its whole mass, each column its
    # share of it, with or without extra cuts (one between the two columns of a group). Many draws of
    # the fp64 reference (the kernel matches it elsewhere), so the bound is tight.
    logits, t, rows = spread_logits(), 0.7, 40_000
    u = torch.rand(rows, 2 * logits.numel(), dtype=torch.float64, device=DEV).clamp_min(1e-30)
    ids = ref.sample_reference(logits.expand(rows, -1), torch.full((rows,), t, device=DEV), u, cuts)
    assert_follows_softmax(ids, logits, t, 1e-12)


def test_noise_is_uniform_and_gumbel_max_draws_softmax():
    # One long row of the kernel's uniforms, cut into draws over 4 columns (4 column noises, then 4
    # group noises of which the one group's is used).
    seeds = torch.tensor([99], dtype=torch.int64, device=DEV)
    u = sampling_uniforms(seeds, torch.tensor([5], dtype=torch.int64, device=DEV), 1 << 16)
    assert u.shape == (1, 1 << 17) and ((u > 0) & (u < 1)).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    hist = torch.histc(u.cpu(), bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.005  # 6 sigma of a bin's frequency
    draws = u.view(-1, 8)
    logits = torch.tensor([1.5, 0.0, -0.5, 0.3], device=DEV)
    t = 0.8
    ids = ref.sample_reference(logits.expand(draws.shape[0], -1), torch.full((draws.shape[0],), t, device=DEV), draws)
    freq = torch.bincount(ids, minlength=4).double().cpu() / draws.shape[0]
    probs = torch.softmax(logits.double().cpu() / t, -1)
    assert ((freq - probs).abs() <= 4.5 * (probs * (1 - probs) / draws.shape[0]).sqrt()).all()


def test_seeded_draws_do_not_depend_on_the_batch():
    vocab = 301  # five groups
    logits = torch.randn(6, vocab, device=DEV)
    temperature = torch.tensor([1.0, 0.0, 0.9, 1.0, 1.5, 1.0], device=DEV)
    seeds, offsets = streams(6)
    batched = sample(logits, temperature, seeds, offsets)
    for r in (0, 2, 5):
        alone = sample(logits[r:r + 1], temperature[r:r + 1], seeds[r:r + 1], offsets[r:r + 1])
        split = sample(logits[r:r + 1], temperature[r:r + 1], seeds[r:r + 1], offsets[r:r + 1], block=64,
                       num_splits=2)
        assert alone.item() == split.item() == batched[r].item()
    # The next offsets of one seed are fresh draws (flat logits: any token may come).
    flat = torch.zeros(24, vocab, device=DEV)
    seed = torch.full((24,), 7, dtype=torch.int64, device=DEV)
    draws = sample(flat, torch.ones(24, device=DEV), seed, torch.arange(100, 124, device=DEV))
    assert len(set(draws.tolist())) > 8
    u = sampling_uniforms(seed[:3], torch.tensor([100, 101, 2**33], device=DEV), vocab)
    other_seed = sampling_uniforms(seed[:1] + 1, torch.tensor([100], device=DEV), vocab)
    assert (u[0] != u[1]).all() and (u[0] != u[2]).all() and (u[0] != other_seed[0]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype):
    vocab = 200  # four groups, the last cut short
    big = torch.finfo(dtype).max
    logits = torch.randn(6, vocab, device=DEV).to(dtype)
    logits[0, :] = float("-inf")  # nothing to draw: 0, as torch.argmax
    logits[1, :] = float("-inf")
    logits[1, [5, 140]] = torch.tensor([0.0, 1.0], device=DEV).to(dtype)  # only these two can come
    logits[2, 17] = big  # overwhelms the noise at any sane temperature
    logits[2, 3] = -big
    logits[3, 30] = float("inf")
    logits[3, 150] = float("inf")  # +inf ties, in another group: the first
    logits[4, :] = big  # all at the top of the range: the noise must not overflow into inf or NaN
    logits[5, ::2] = float("-inf")
    temperature = torch.tensor([1.0, 1e-6, 1.0, 3.0, 1e4, 1e-30], device=DEV)
    seeds, offsets = streams(6)
    ids = sample(logits, temperature, seeds, offsets)
    assert ids[0] == 0 and ids[1] in (5, 140) and ids[2] == 17 and ids[3] == 30
    assert 0 <= ids[4] < vocab and ids[5] % 2 == 1
    assert_reference_draws(ids, logits, temperature, seeds, offsets)


def test_empty_batch_and_argument_checks():
    seeds, offsets = streams(0)
    empty = torch.empty(0, 10, device=DEV)
    assert sample(empty, torch.empty(0, device=DEV), seeds, offsets).shape == (0,)
    logits = torch.randn(2, 10, device=DEV)
    with pytest.raises(AssertionError):
        sample(logits, torch.ones(2, device=DEV), *(x.int() for x in streams(2)))  # int32 seeds
    with pytest.raises(AssertionError):
        sample(logits.t(), torch.ones(10, device=DEV), *streams(10))  # column-major


def sliced(logits: torch.Tensor, temperature, seeds, offsets, ranks: int) -> torch.Tensor:
    """What tensor-parallel ranks draw: each scans its slice of the vocabulary (padded up to a multiple
    of `ranks`, as the LM head pads it, with +inf in the padding, which must never be drawn), then
    the slices' best (score, column) pairs are combined."""
    rows, vocab = logits.shape
    per = -(-vocab // ranks)
    padded = torch.full((rows, per * ranks), float("inf"), device=DEV).to(logits.dtype)
    padded[:, :vocab] = logits
    parts = [sample_partial(padded[:, r * per:(r + 1) * per].contiguous(), r * per, vocab, temperature, seeds, offsets)
             for r in range(ranks)]
    best = torch.stack([b for b, _ in parts])
    idx = torch.stack([i for _, i in parts])
    assert best.dtype == torch.float32 and idx.dtype == torch.int32 and best.shape == (ranks, rows)
    return combine_partials(best, idx)


# 256 over 2: slices of two whole groups, which cut none. 301: slices that cut groups, so that the
# draw's partition has cuts; 10 over 8 ranks: the last two slices lie past the vocabulary, in padding.
@pytest.mark.parametrize("vocab,ranks", [(256, 2), (301, 2), (301, 3), (10, 8)])
def test_vocabulary_slices_draw_what_the_whole_row_draws(vocab, ranks):
    rows = 5
    logits = (torch.randn(rows, vocab, device=DEV) * 3).to(torch.bfloat16)
    logits[0, :] = float("-inf")  # nothing finite: 0
    logits[1] = torch.randint(-2, 3, (vocab,), device=DEV).to(torch.bfloat16)  # ties across slices: the first
    temperature = torch.tensor([1.0, 0.0, 0.8, 0.0, 2.0], device=DEV)
    seeds, offsets = streams(rows)
    whole = sample(logits, temperature, seeds, offsets)
    ids = sliced(logits, temperature, seeds, offsets, ranks)
    per = -(-vocab // ranks)
    assert_reference_draws(ids, logits, temperature, seeds, offsets, cuts=tuple(r * per for r in range(ranks)))
    if per % GROUP == 0:  # no group cut: the very draw of the whole row
        assert torch.equal(ids, whole)
    assert torch.equal(ids[[0, 1, 3]], whole[[0, 1, 3]])  # nothing to draw, or greedy
    assert whole[0] == 0 and whole[1] == logits[1].float().argmax()


def real_shape_batch(rows: int, greedy_every: int) -> tuple[torch.Tensor, ...]:
    """bf16 logits over Qwen3's vocabulary, temperatures up to 1.5 with every `greedy_every`-th row
    greedy, and random streams: (logits, temperature, seeds, offsets)."""
    logits = (torch.randn(rows, 151936, device=DEV) * 3).to(torch.bfloat16)
    temperature = torch.rand(rows, device=DEV) * 1.5
    temperature[::greedy_every] = 0.0
    return (logits, temperature, *streams(rows))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_real_shape_slices_draw_what_the_whole_row_draws(rows):
    logits, temperature, seeds, offsets = real_shape_batch(rows, greedy_every=3)
    assert torch.equal(sliced(logits, temperature, seeds, offsets, 2), sample(logits, temperature, seeds, offsets))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 256, 512])
def test_real_shape_matches_reference(rows):
    logits, temperature, seeds, offsets = real_shape_batch(rows, greedy_every=5)
    ids = sample(logits, temperature, seeds, offsets)
    assert_reference_draws(ids, logits, temperature, seeds, offsets)
    greedy = temperature == 0
    assert torch.equal(ids[greedy], logits[greedy].argmax(-1))
    for block, splits in [(1024, 1), (2048, 5), (256, 37)]:  # launches other than the default agree
        assert torch.equal(sample(logits, temperature, seeds, offsets, block=block, num_splits=splits), ids)
