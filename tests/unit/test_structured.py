"""controlplane/structured.py: each kind of structured output compiles to a matcher whose masks allow
exactly the outputs the grammar does; compile errors read well; compiles are cached."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from support.tiny_models import VOCAB, make_tokenizer

from nanoplane.controlplane.structured import GrammarCompiler, SequenceGrammar

MODEL_VOCAB = VOCAB + 64  # the model's vocabulary may be wider than the tokenizer's


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    c = GrammarCompiler(tokenizer_dir, MODEL_VOCAB, [hf.eos_token_id])
    c.hf = hf
    yield c
    c.close()


def allowed(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def walk(compiler: GrammarCompiler, structured: dict, text: str) -> SequenceGrammar:
    """Feed text's tokens one by one, checking that each mask allowed the token taken."""
    g = SequenceGrammar(compiler.compile(structured))
    for token in compiler.hf.encode(text, add_special_tokens=False):
        mask = compiler.fill_masks([g])
        assert mask.shape == (1, (MODEL_VOCAB + 31) // 32)
        assert token in allowed(mask[0]), (structured, text, token)
        assert g.accept(token), g.error
    return g


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("structured, good, bad", [
    ({"json_schema": SCHEMA}, '{"name":"fox","n":12,"tags":["a","b"]}', '{"name":"fox","n":"x"'),
    ({"json_schema": json.dumps(SCHEMA)}, '{"name":"","n":-3,"tags":[]}', '{"tags"'),
    ({"json_object": True}, '{"any":[1,2,{"x":null}]}', '[1]'),
    ({"regex": r"\d{4}-\d{2}-\d{2}"}, "2024-01-31", "24-1"),
    ({"choice": ["quick", "lazy dog"]}, "lazy dog", "lazy cat"),
    ({"choice": ['say "hi"\\', "東京 🙂", "a|b"]}, "東京 🙂", "東x"),  # non-ASCII, lark syntax in a choice
    ({"choice": ['say "hi"\\', "東京 🙂", "a|b"]}, 'say "hi"\\', "b"),  # quotes and a backslash
    ({"grammar": 'root ::= "the " ("fox" | "dog") " jumps"'}, "the dog jumps", "the cat"),  # GBNF
    ({"grammar": 'start: "the " animal\nanimal: "fox" | "dog"'}, "the fox", "the ox"),  # Lark
])
def test_each_kind_allows_its_outputs_and_refuses_others(compiler, structured, good, bad):
    g = walk(compiler, structured, good)
    assert g.matcher.is_accepting()
    refused = SequenceGrammar(compiler.compile(structured))
    tokens = compiler.hf.encode(bad, add_special_tokens=False)
    assert not all(refused.accept(t) for t in tokens)
    assert refused.error


@pytest.mark.parametrize("structured", [{"regex": r"\d{4}-\d{2}-\d{2}"}, {"choice": ["quick", "lazy dog"]},
                                        {"json_schema": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                                         "required": ["a"], "additionalProperties": False}}])
def test_a_complete_grammar_is_stopped_and_allows_only_eos(compiler, structured):
    text = {"regex": "2024-01-31", "choice": "quick", "json_schema": '{"a":true}'}[next(iter(structured))]
    g = walk(compiler, structured, text)
    assert g.is_stopped
    assert allowed(compiler.fill_masks([g])[0]) == {compiler.hf.eos_token_id}


def test_tokens_past_the_tokenizer_vocabulary_are_never_allowed(compiler):
    mask = compiler.fill_masks([SequenceGrammar(compiler.compile({"json_object": True}))])
    ids = allowed(mask[0])
    assert ids and max(ids) < len(compiler.hf)
    assert not allowed(mask[0][len(compiler.hf) // 32 + 1:])


def test_masks_of_many_sequences_fill_their_own_rows(compiler):
    a, c = (walk(compiler, {"choice": ["quick", "lazy dog"]}, "quick") for _ in range(2))
    b = SequenceGrammar(compiler.compile({"regex": "[0-9]+"}))
    mask = compiler.fill_masks([a, b, c])
    assert allowed(mask[0]) == allowed(mask[2]) == {compiler.hf.eos_token_id}
    digits = allowed(mask[1])
    assert compiler.hf.encode("7", add_special_tokens=False)[0] in digits
    assert compiler.hf.eos_token_id not in digits  # "[0-9]+" needs a digit first


@pytest.mark.parametrize("structured, words", [
    ({"regex": "[a-"}, "unclosed character class"),
    ({"grammar": 'root ::= "a" [0-9'}, "neither Lark nor GBNF"),
    ({"grammar": "start: foo(\n"}, "Expected"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"json_schema": {"type": "objectx"}}, "objectx"),
    ({"json_schema": {"type": "object", "default": {1, 2}}}, "not a JSON document"),
])
def test_a_grammar_that_does_not_compile_is_a_readable_value_error(compiler, structured, words):
    kind = next(iter(structured))
    with pytest.raises(ValueError, match=f"structured.{kind}") as info:
        compiler.compile(structured)
    assert words in str(info.value)
    assert len(str(info.value)) < 2100


def test_compiles_are_cached_by_kind_and_canonical_text(compiler):
    # Not by sorted keys: properties come out in the schema's order.
    assert compiler.compile({"json_schema": SCHEMA}) is not compiler.compile(
        {"json_schema": dict(reversed(SCHEMA.items()))} | {"properties": dict(reversed(SCHEMA["properties"].items()))})
    hits, misses = compiler.hits, compiler.misses
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    first = compiler.compile({"json_schema": schema})
    again = compiler.compile({"json_schema": json.dumps(schema, indent=2)})
    assert again is first
    assert (compiler.hits, compiler.misses) == (hits + 1, misses + 1)
    assert compiler.compile({"regex": "[a-z]+"}) is not compiler.compile({"grammar": "start: /[a-z]+/"})
    with pytest.raises(ValueError):
        compiler.compile({"regex": "(("})
    misses = compiler.misses
    with pytest.raises(ValueError):  # a failure is cached as well
        compiler.compile({"regex": "(("})
    assert compiler.misses == misses


def test_the_cache_is_a_bounded_lru(tokenizer_dir):
    c = GrammarCompiler(tokenizer_dir, MODEL_VOCAB, [0], cache_size=2)
    try:
        a = c.compile({"regex": "a"})
        c.compile({"regex": "b"})
        assert c.compile({"regex": "a"}) is a  # a is now the most recent
        c.compile({"regex": "c"})  # evicts b
        assert c.compile({"regex": "a"}) is a
        misses = c.misses
        c.compile({"regex": "b"})
        assert c.misses == misses + 1
    finally:
        c.close()


def test_compile_async_leaves_the_event_loop_free(compiler):
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        compiled = await compiler.compile_async({"regex": "[a-z]{3,40}@example\\.com"})
        with pytest.raises(ValueError, match="structured.regex"):
            await compiler.compile_async({"regex": "[z-a]"})
        ticker.cancel()
        return compiled, ticks

    compiled, ticks = asyncio.run(main())
    assert compiled.key == ("regex", "[a-z]{3,40}@example\\.com")
    assert ticks > 0


def test_release_and_replay_give_the_same_state(compiler):
    text = '{"name":"fox","n":1'
    g = walk(compiler, {"json_schema": SCHEMA}, text)
    before = compiler.fill_masks([g])
    g.release()
    assert g.matcher is None
    g.ensure(compiler.hf.encode(text, add_special_tokens=False))
    assert np.array_equal(compiler.fill_masks([g]), before)


def test_a_model_without_a_usable_tokenizer_refuses_structured_output(tmp_path):
    c = GrammarCompiler(tmp_path, MODEL_VOCAB, [0])
    try:
        with pytest.raises(ValueError, match="structured output is not available for this model"):
            c.compile({"regex": "a"})
    finally:
        c.close()
