"""Incremental detokenization and stop strings, with the tiny byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.tiny_models import VOCAB, make_tokenizer

from nanoplane.controlplane.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopMatcher, TextStream

ALPHABET = list("abc xyz.,!") + ["é", "ü", "ß", "☃", "東", "京", "🙂", "👍", "\U0001F3FD", "\n"]
# Hypothesis needs settings that tolerate a module fixture and slow-ish decodes on a 2-core box.
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def byte_token_ids(tok) -> list[int]:
    """Id of the single-byte token for each byte value, through GPT-2's byte-to-character table.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes get the characters from
    U+0100 on, in byte order. Written out here to build token sequences that cut characters apart.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    ids = [tok.convert_tokens_to_ids(table[b]) for b in range(256)]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in ids)
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Push ids in chunks of the given sizes (cycled), then flush; returns every piece."""
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        pieces.append(detok.push(ids[i:i + n]))
        i, k = i + n, k + 1
    pieces.append(detok.flush())
    return pieces


def push_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int]:
    """Every piece (the flush's last) and the longest the window got."""
    pieces, longest = [], 0
    for i in ids:
        pieces.append(detok.push([i]))
        longest = max(longest, len(detok.token_ids))
    pieces.append(detok.flush())
    return pieces, longest


def test_multibyte_characters_fed_byte_by_byte(tok):
    text = "héllo wörld ☃ 東京 🙂"
    byte_ids = byte_token_ids(tok)
    ids = [byte_ids[b] for b in text.encode()]
    pieces = stream(IncrementalDetokenizer(tok), ids, [1])
    assert "".join(pieces) == text
    assert all(REPLACEMENT not in p for p in pieces)
    # A character appears whole, in the piece of the byte that completes it.
    assert "東" in pieces and "🙂" in pieces


def test_bpe_tokens_and_special_tokens(tok):
    ids = tok.encode("the quick ☃ 東京 🙂 fox") + [tok.eos_token_id]
    pieces = stream(IncrementalDetokenizer(tok), ids, [1])
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@st.composite
def clean_token_sequences(draw):
    """Text from a multi-byte alphabet, tokenized with characters randomly cut into byte tokens."""
    text = draw(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=30))
    return text, draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))


@SETTINGS
@given(seq=clean_token_sequences(), chunks=st.lists(st.integers(1, 4), max_size=5))
def test_pieces_join_to_decode_of_clean_sequences(tok, seq, chunks):
    text, split = seq
    byte_ids = byte_token_ids(tok)
    ids: list[int] = []
    for ch, as_bytes in zip(text, split, strict=True):
        ids.extend(byte_ids[b] for b in ch.encode()) if as_bytes else ids.extend(tok.encode(ch))
    assert tok.decode(ids, skip_special_tokens=True) == text
    pieces = stream(IncrementalDetokenizer(tok), ids, chunks)
    assert "".join(pieces) == text
    assert all(REPLACEMENT not in p for p in pieces), pieces


@SETTINGS
@given(ids=st.lists(st.integers(0, VOCAB - 9), min_size=1, max_size=40), chunks=st.lists(st.integers(1, 3), max_size=4))
def test_random_ids(tok, ids, chunks):
    """Any ids: the pieces (with the final flush) join to the full decode; clean ones never show U+FFFD."""
    full = tok.decode(ids, skip_special_tokens=True)
    pieces = stream(IncrementalDetokenizer(tok), ids, chunks)
    assert "".join(pieces) == full
    if REPLACEMENT not in full:
        assert all(REPLACEMENT not in p for p in pieces)


@SETTINGS
@given(prompt=st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=20),
       ids=st.lists(st.integers(0, VOCAB - 9), min_size=1, max_size=20))
def test_prompt_context(tok, prompt, ids):
    """With a cleanly decoding prompt as context, the output text is the completion's own decode."""
    full = tok.decode(ids, skip_special_tokens=True)
    assume(REPLACEMENT not in full)
    pieces = stream(IncrementalDetokenizer(tok, tok.encode(prompt)), ids, [1])
    assert "".join(pieces) == full


def test_stop_string_across_pushes():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == "abc "  # "ST" may begin the stop string: held back
    assert m.push("O") == ""
    assert m.push("Px tail") == ""
    assert m.stopped and m.matched == "STOP"
    assert m.flush() == ""


def test_partial_stop_released_when_it_does_not_complete():
    m = StopMatcher(["STOP"])
    assert m.push("xS") == "x"
    assert m.push("TA") == "STA"
    assert m.push("S") == ""  # a new possible start
    assert m.flush() == "S"
    assert not m.stopped


def test_first_completed_stop_wins():
    m = StopMatcher(["abcd", "bc"])
    assert m.push("xabcd") == "xa"
    assert m.matched == "bc"


def reference_release(text: str, stops: list[str]) -> tuple[str, str]:
    """(text before the stop that completes first, the rest held back), by brute force over prefixes."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if ends:
        return text[:min(ends)[1]], ""
    keep = max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)
    return text[:len(text) - keep], text[len(text) - keep:]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.text("abc", max_size=5), max_size=12))
def test_held_back_text_is_the_longest_tail_that_may_start_a_stop(stops, chunks):
    """After every push, what was released and what is held equal a brute-force cut of the text so far."""
    m, released, text = StopMatcher(stops), "", ""
    for chunk in chunks:
        released += m.push(chunk)
        text += chunk
        want_out, want_held = reference_release(text, stops)
        assert released == want_out and (m.stopped or m.held == want_held)
        if m.stopped:
            break


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])


def reference_cut(text: str, stops: list[str]) -> str:
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[:min(hits)[1]] if hits else text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
       max_size=3), cuts=st.lists(st.integers(1, 5), max_size=6))
def test_stop_matching_does_not_depend_on_chunking(text, stops, cuts):
    m = StopMatcher(stops)
    out, i, k = [], 0, 0
    while i < len(text):
        n = cuts[k % len(cuts)] if cuts else 1
        out.append(m.push(text[i:i + n]))
        i, k = i + n, k + 1
    out.append(m.flush())
    assert "".join(out) == reference_cut(text, stops)


def test_text_stream_stops_inside_multibyte_text(tok):
    ids = tok.encode("héllo wörld ☃ 東京 🙂 fox")
    ts = TextStream(tok, stops=["東京"])
    text = "".join(ts.push([i]) for i in ids)
    assert ts.stopped and text == "héllo wörld ☃ "
    assert ts.push([], finished=True) == ""


def test_text_stream_flushes_held_text_at_finish(tok):
    ids = tok.encode("fox jumps")
    ts = TextStream(tok, stops=["jumpsXX"])
    text = "".join(ts.push([i]) for i in ids)
    assert text == "fox "  # "jumps" could still become the stop string
    assert ts.push([], finished=True) == "jumps" and not ts.stopped


def test_ids_that_decode_to_nothing_do_not_grow_the_window(tok):
    """Skipped special tokens and ids the tokenizer does not know add no text; a long run of them must
    neither change the text nor make every later decode longer (a random-weight model samples such ids
    all the time, and a real one may repeat a special token)."""
    words = tok.encode("the quick brown fox", add_special_tokens=False)
    nothing = [tok.eos_token_id, VOCAB + 5, 10**6]
    ids = words[:2] + nothing * 300 + words[2:] + nothing * 300
    pieces, longest = push_one_by_one(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "the quick brown fox"
    assert longest < 70  # bounded by the window, not by the 1,800 empty ids


def test_broken_bytes_settle_without_cutting_a_character(tok):
    """A model looping on stray UTF-8 bytes keeps the text ending in U+FFFD: those bytes are final and
    must settle (else every push decodes a window that grows with the output), yet a real multi-byte
    character that follows, fed byte by byte, still comes out whole."""
    byte_ids = byte_token_ids(tok)
    stray = byte_ids[0x80]  # a continuation byte with no lead: U+FFFD for good
    ids = [stray] * 300 + [byte_ids[b] for b in "🙂".encode()] + [stray] * 40 + [byte_ids[b] for b in "東é".encode()]
    pieces, longest = push_one_by_one(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids)
    assert "🙂" in "".join(pieces) and "".join(pieces).endswith("東é")
    assert sum(p.count(REPLACEMENT) for p in pieces[:300]) > 250  # settled as they came, not at the end
    assert longest < 90
