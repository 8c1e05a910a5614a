"""Tokenizer.surely_longer: counting a text's tokens piece by piece, only as far as a limit."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tiny_models import make_tokenizer

from nanoplane.controlplane import tokenizer as tokenizer_module
from nanoplane.controlplane.tokenizer import Tokenizer

ALPHABET = list("abc xyz.,!\t") + ["é", "ß", "☃", "東", "🙂", "\n", "  "]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    hf_dir = tmp_path_factory.mktemp("tok")
    make_tokenizer(hf_dir)
    return Tokenizer(str(hf_dir))


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few dozen characters, so that short texts are cut many times."""
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 24)
    monkeypatch.setattr(tokenizer_module, "CUT_SEARCH_CHARS", 12)


def count(tok: Tokenizer, text: str) -> int:
    return len(tok.hf.backend_tokenizer.encode(text, add_special_tokens=False).ids)


@SETTINGS
@given(text=st.lists(st.sampled_from(ALPHABET), max_size=300).map("".join), limit=st.integers(0, 200))
def test_never_refuses_a_text_within_the_limit(tok, small_pieces, text, limit):
    """Sound whatever the cuts: a text it calls longer than the limit is longer."""
    if tok.surely_longer(text, limit):
        assert count(tok, text) > limit


def pieces(text: str) -> list[tuple[str, int]]:
    """The pieces surely_longer makes of text, each with the slack its cut takes off."""
    out, start = [], 0
    while start < len(text):
        end, slack = min(start + tokenizer_module.PIECE_CHARS, len(text)), 0
        if end < len(text):
            end, slack = tokenizer_module._cut(text, start, end)
        out.append((text[start:end], slack))
        start = end
    return out


def test_exact_where_every_piece_ends_before_a_space(tok, small_pieces):
    """Cut before a space that follows a word, the pieces' counts add up to the whole text's: it
    decides every limit but the CUT_SLACK each cut takes off."""
    text = "the quick brown fox jumps over the lazy dog, 東京 🙂 " * 20
    whole, cut = count(tok, text), pieces(text)
    assert len(cut) > 20 and all(slack == tokenizer_module.CUT_SLACK for _, slack in cut[:-1])
    assert sum(count(tok, p) for p, _ in cut) == whole
    slack = sum(s for _, s in cut)
    for limit in (0, 1, 17, whole - slack - 1):
        assert tok.surely_longer(text, limit)
    for limit in (whole, whole + 1, 10 * whole):
        assert not tok.surely_longer(text, limit)


def test_a_long_text_is_decided_from_its_first_pieces(tok, monkeypatch):
    """The count stops at the limit: a text of a million characters costs a piece or two."""
    encoded = []
    encode = tok.hf.backend_tokenizer.encode

    class Recording:
        def encode(self, piece, add_special_tokens):
            encoded.append(len(piece))
            return encode(piece, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(type(tok.hf), "backend_tokenizer", property(lambda self: Recording()))
    assert tok.surely_longer("a b " * 250_000, 1000)
    assert sum(encoded) <= 2 * tokenizer_module.PIECE_CHARS
