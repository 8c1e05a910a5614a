"""vLLM's text options on the embedded default model's real tokenizer: stop strings with
include_stop_str_in_output and min_tokens, skip_special_tokens, spaces_between_special_tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoplane.controlplane.detokenizer import StopMatcher, TextStream, ended_by_token
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason
from nanoplane.controlplane.tokenizer import Tokenizer
from nanoplane.models.default_model import default_model_dir

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ANSWER = "The capital of France is Paris.<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # The README's first command converts into the default cache; reuse it when it is there.
    cache = os.environ.get("NANOPLANE_CACHE") or str(Path.home() / ".cache" / "nanoplane")
    return Tokenizer(str(default_model_dir(cache)))


def one_by_one(stream: TextStream, ids: list[int], ended_by_token: bool = False) -> str:
    text = "".join(stream.push([i]) for i in ids[:-1])
    return text + stream.push(ids[-1:], finished=True, ended_by_token=ended_by_token)


def test_special_tokens_skipped_or_spaced_as_vllm_does(tok):
    ids = tok.encode("Hello<|im_end|><|im_start|>world")
    assert tok.decode(ids) == tok.decode(ids, spaces_between_special_tokens=False) == "Helloworld"
    assert tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True) == \
        "Hello <|im_end|> <|im_start|> world"
    # Without the option (the default of a plain decode), the tokens' own text.
    assert tok.decode(ids, skip_special_tokens=False) == "Hello<|im_end|><|im_start|>world"
    im_end = tok.encode("<|im_end|>")
    assert tok.decode(im_end + im_end, skip_special_tokens=False, spaces_between_special_tokens=True) == \
        "<|im_end|> <|im_end|>"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_streamed_text_equals_the_whole_decode_with_each_option(tok, skip, spaces):
    ids = tok.encode(ANSWER + " 東京 🙂<|endoftext|><|endoftext|>x")
    stream = TextStream(tok, tok.encode("<|im_start|>assistant\n"), skip_special_tokens=skip,
                        spaces_between_special_tokens=spaces)
    text = one_by_one(stream, ids)
    assert text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert ("<|im_end|>" in text) is not skip
    if not skip:
        assert ("Paris. <|im_end|> \n <|im_start|> user" in text) is spaces


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text_and_names_itself(tok, include):
    ids = tok.encode(ANSWER)
    stream = TextStream(tok, stops=["of Spain", "is P"], include_stop_str_in_output=include)
    text = "".join(stream.push([i]) for i in ids)  # "is P" ends inside the token " Paris"
    assert stream.stopped and stream.stop_reason == "is P"
    assert text == ("The capital of France is P" if include else "The capital of France ")
    assert stream.push(tok.encode(" more"), finished=True) == ""


def test_stop_string_in_special_token_text_counts_only_when_the_text_holds_it(tok):
    ids = tok.encode(ANSWER)
    skipped = TextStream(tok, stops=["<|im_end|>"])
    assert one_by_one(skipped, ids) == "The capital of France is Paris.\nuser\nAnd of Spain?"
    assert not skipped.stopped
    kept = TextStream(tok, stops=["<|im_end|>"], skip_special_tokens=False, include_stop_str_in_output=True)
    assert one_by_one(kept, ids) == "The capital of France is Paris. <|im_end|>" and kept.stop_reason == "<|im_end|>"


def test_min_tokens_holds_off_stop_strings(tok):
    ids = tok.encode("a, b, c, d")  # "a" "," " b" "," " c" "," " d"
    assert len(ids) == 7
    # vLLM looks for stop strings from output token min_tokens + 1 on: tokens 1-4 hold "a, b," only.
    stream = TextStream(tok, stops=[","], min_tokens=4)
    assert one_by_one(stream, ids) == "a, b, c" and stream.stop_reason == ","
    # A stop that starts in the quiet tokens and ends after them counts.
    stream = TextStream(tok, stops=["b, c"], min_tokens=3)
    assert one_by_one(stream, ids) == "a, " and stream.stopped
    stream = TextStream(tok, stops=[", b"], min_tokens=3)
    assert one_by_one(stream, ids) == "a, b, c, d" and not stream.stopped


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_ended_the_output_is_text_only_with_include(tok, include):
    """vLLM leaves the text of an end-of-sequence or stop token id out unless include_stop_str_in_output."""
    ids = tok.encode("Paris.")
    stream = TextStream(tok, include_stop_str_in_output=include)
    assert one_by_one(stream, ids, ended_by_token=True) == ("Paris." if include else "Paris")


def test_ended_by_token_is_eos_or_a_stop_id():
    assert ended_by_token(FinishReason.EOS, None) and ended_by_token(FinishReason.STOP, 7)
    assert not ended_by_token(FinishReason.STOP, "x") and not ended_by_token(FinishReason.LENGTH, None)
    assert not ended_by_token(FinishReason.ABORT, None) and not ended_by_token(None, None)


def test_text_stream_for_params_takes_every_text_option(tok):
    params = SamplingParams(stop=["P"], include_stop_str_in_output=True, skip_special_tokens=False,
                            spaces_between_special_tokens=False, min_tokens=2)
    stream = TextStream.for_params(tok, [], params)
    assert (stream.stop.stops, stream.include_stop_str_in_output, stream.min_tokens) == (("P",), True, 2)
    assert (stream.detokenizer.skip_special_tokens, stream.detokenizer.spaces_between_special_tokens) == (False, False)


def reference_include(text: str, stops: list[str]) -> str:
    """The text up to the end of the stop that completes first, by brute force."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text


@SETTINGS
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
       min_size=1, max_size=3), cuts=st.lists(st.integers(1, 5), max_size=6))
def test_include_releases_everything_up_to_the_stop_whatever_the_chunks(text, stops, cuts):
    m = StopMatcher(stops, include=True)
    out, i, k = [], 0, 0
    while i < len(text):
        n = cuts[k % len(cuts)] if cuts else 1
        piece = m.push(text[i:i + n])
        out.append(piece)
        if not m.stopped:
            assert piece == text[i:i + n]  # nothing held back
        i, k = i + n, k + 1
    out.append(m.flush())
    assert "".join(out) == reference_include(text, stops)
    assert m.stopped == (reference_include(text, stops) != text or any(text.endswith(s) for s in stops))
