"""The sampling tail's kernels (kernels/logits_processors.py) against their fp32 torch twins:
the token bitmask, the penalties over device counts, and the logprob statistics."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (see tests/kernels/test_layer_kernels.py)

import zlib  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from nanoplane.kernels import apply_bitmask, apply_penalties, logprob_stats  # noqa: E402
from nanoplane.kernels import reference as ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Vocabularies: one tile, several tiles with a ragged end (the tiny models' 384 is below one tile).
VOCABS = [384, 5000]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def logits_of(rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, vocab, device=DEV) * 3).to(dtype)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitmask_kernel_matches_reference(vocab, dtype):
    logits = logits_of(5, vocab, dtype)
    rows = torch.tensor([0, 2, 3], device=DEV)
    # Row 2's mask is narrower than the vocabulary: the tokens past it are not allowed.
    width = -(-vocab // 32)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, width), dtype=torch.int32, device=DEV)
    narrow = mask.clone()
    narrow[1, width // 2:] = 0
    expected = logits.clone()
    ref.apply_bitmask_ref(expected, rows, narrow)
    got = logits.clone()
    apply_bitmask(got, rows, narrow.contiguous())
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows outside the list untouched
    assert torch.isinf(got[2, (width // 2) * 32:]).all()
    # Bit j of word w allows token 32 w + j.
    one = torch.zeros(1, width, dtype=torch.int32, device=DEV)
    one[0, 1] = 1 << 3
    single = logits.clone()
    apply_bitmask(single, torch.tensor([4], device=DEV), one)
    assert torch.isfinite(single[4]).sum() == 1 and torch.isfinite(single[4, 35])


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_penalties_kernel_matches_reference(vocab, dtype):
    logits = logits_of(6, vocab, dtype)
    counts = torch.randint(0, 3, (4, vocab), dtype=torch.int32, device=DEV) * (torch.rand(4, vocab, device=DEV) < 0.05)
    counts = counts.to(torch.int32)
    seen = (torch.rand(4, vocab, device=DEV) < 0.05).to(torch.uint8)
    rows = torch.tensor([5, 0, 3], device=DEV)
    state = torch.tensor([2, 0, 3], device=DEV)
    rep = torch.tensor([1.3, 1.0, 0.8], device=DEV)
    freq = torch.tensor([0.5, -0.7, 0.0], device=DEV)
    pres = torch.tensor([0.25, 1.5, -2.0], device=DEV)
    expected = logits.clone()
    ref.apply_penalties_ref(expected, rows, state, counts, seen, rep, freq, pres)
    got = logits.clone()
    apply_penalties(got, rows, state, counts, seen, rep, freq, pres)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])
    assert not torch.equal(got[5], logits[5])


def test_penalties_follow_huggingface_and_openai_rules():
    """A token seen in the prompt only: divided (positive) or multiplied (negative) by the repetition
    penalty; seen twice in the output: also minus 2 x frequency minus presence."""
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]], device=DEV)
    counts = torch.tensor([[0, 0, 2, 0]], dtype=torch.int32, device=DEV)
    seen = torch.tensor([[1, 1, 0, 0]], dtype=torch.uint8, device=DEV)
    one = torch.tensor([0], device=DEV)
    apply_penalties(logits, one, one, counts, seen, torch.tensor([2.0], device=DEV),
                    torch.tensor([0.5], device=DEV), torch.tensor([0.25], device=DEV))
    assert logits.tolist() == [[1.0, -4.0, 2.0 / 2 - 1.0 - 0.25, 1.0]]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_stats_match_log_softmax(vocab, dtype):
    logits = logits_of(7, vocab, dtype)
    logits[3, 10:] = float("-inf")  # a row masked but for a few tokens
    rows = torch.tensor([6, 0, 3, 2], device=DEV)
    targets = torch.tensor([1, vocab - 1, 4, 17], device=DEV)
    lse, lp, rank = logprob_stats(logits, rows, targets)
    e_lse, e_lp, e_rank = ref.logprob_stats_ref(logits, rows, targets)
    torch.testing.assert_close(lse, e_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, e_lp, rtol=1e-5, atol=1e-5)
    assert torch.equal(rank, e_rank)
    full = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(lp, full[rows, targets], rtol=1e-5, atol=1e-5)
    # The most likely token has rank 1.
    best = logits.float().argmax(dim=-1)[rows]
    assert (logprob_stats(logits, rows, best)[2] == 1).all()


@gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_kernels_at_qwen3_shapes(rows):
    vocab = 151_936
    logits = logits_of(rows, vocab, torch.bfloat16)
    index = torch.arange(rows, device=DEV)
    counts = (torch.rand(rows, vocab, device=DEV) < 0.001).to(torch.int32)
    seen = (torch.rand(rows, vocab, device=DEV) < 0.01).to(torch.uint8)
    params = [torch.full((rows,), v, device=DEV) for v in (1.1, 0.5, 0.5)]
    expected, got = logits.clone(), logits.clone()
    ref.apply_penalties_ref(expected, index, index, counts, seen, *params)
    apply_penalties(got, index, index, counts, seen, *params)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    targets = torch.randint(0, vocab, (rows,), device=DEV)
    lse, lp, rank = logprob_stats(logits, index, targets)
    e_lse, e_lp, e_rank = ref.logprob_stats_ref(logits, index, targets)
    torch.testing.assert_close(lp, e_lp, rtol=1e-4, atol=1e-4)
    assert torch.equal(rank, e_rank)
