"""Structured output on the real embedded default model (SmolLM2-135M-Instruct, CPU): JSON that parses
and validates against its schema, choices, a date regex, and abort mid-output.

Every output must END inside max_tokens: the schemas bound every string (maxLength), array
(maxItems) and integer (minimum/maximum), and numbers are asked of greedy rows only (a greedy small
model writes short decimals); a grammar that is complete ends the request at once (finish reason
STOP, no stop_reason), so an output that parses as JSON is one whose grammar closed."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.controlplane.sequence import FinishReason
from nanoplane.models.default_model import default_model_dir

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm():
    cache = os.environ.get("NANOPLANE_CACHE") or str(Path.home() / ".cache" / "nanoplane")
    engine = LLM(str(default_model_dir(cache)), device="cpu", max_num_seqs=64)
    yield engine
    engine.close()


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": NAME, "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
                    "capital": {"type": "boolean"}})),
    ("three colors", obj({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                                     "minItems": 1, "maxItems": 3}})),
    ("a product", obj({"item": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}})),
    ("a student", obj({"student": obj({"first": NAME, "grade": {"enum": ["A", "B", "C"]}}),
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "maxItems": 3}})),
]
TOPICS = ["Paris", "a cat", "the ocean", "music", "a teacher", "Tokyo", "a bicycle", "winter", "a doctor", "apples"]


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_fifty_prompts_give_json_that_validates_against_their_schemas(llm):
    prompts, params, schemas = [], [], []
    for i in range(50):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(chat(llm, f"Describe {what} related to {TOPICS[i // len(SCHEMAS)]} as JSON."))
        sampled = i % 2 == 1 and what != "a product"  # numbers from greedy rows only (see the docstring)
        params.append(SamplingParams(temperature=0.8 if sampled else 0.0, seed=i, max_tokens=MAX_TOKENS,
                                     structured={"json_schema": schema if i % 3 else json.dumps(schema)}))
        schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas, strict=True):
        assert len(out["token_ids"]) < MAX_TOKENS, out["text"]
        assert out.get("finish_reason", "stop") == "stop" and out.get("stop_reason") is None  # the grammar completed
        jsonschema.validate(json.loads(out["text"]), schema)
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_choice_always_returns_one_of_the_choices(llm):
    choices = ["yes", "no", "maybe later"]
    questions = ["Is the sky green?", "Is Paris in France?", "Do you like rain?", "Can fish fly?",
                 "Is water wet?", "Shall we go now?"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=8, structured={"choice": choices})
              for t, s in ((0.0, 0), (1.0, 1), (1.5, 2))]
    outs = llm.generate([chat(llm, q) for q in questions for _ in params], params * len(questions), use_tqdm=False)
    assert all(o["text"] in choices for o in outs), [o["text"] for o in outs]


def test_a_date_regex_matches(llm):
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    prompts = [chat(llm, q) for q in ("When did the Berlin wall fall? Answer with a date.",
                                      "What is a good date for a picnic?", "Write today's date.")]
    outs = llm.generate(prompts, [SamplingParams(temperature=t, seed=3, max_tokens=16, structured={"regex": date})
                                  for t in (0.0, 0.7, 1.0)], use_tqdm=False)
    for out in outs:
        assert re.fullmatch(date, out["text"]), out["text"]


def test_a_gbnf_grammar_is_followed(llm):
    gbnf = 'root ::= "The answer is " [0-9]{1,3} "."'
    out = llm.generate([chat(llm, "What is 2 + 2?")], SamplingParams(temperature=0, max_tokens=12,
                                                                      structured={"grammar": gbnf}), use_tqdm=False)
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out[0]["text"])


def test_a_bad_grammar_fails_the_call_and_queues_nothing(llm):
    with pytest.raises(ValueError, match=r"prompt 1: invalid sampling parameter structured\.regex"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(structured={"regex": "(unclosed"})],
                     use_tqdm=False)
    assert not llm.engine.has_work()


def test_abort_mid_structured_output_frees_blocks_and_grammar_state(llm):
    engine = llm.engine
    schema = obj({"story": {"type": "string", "maxLength": 400}})
    seq = engine.add_request(llm.tokenizer.encode(chat(llm, "Tell a long story as JSON.")),
                             SamplingParams(temperature=0, max_tokens=200, structured={"json_schema": schema}))
    while seq.num_completion_tokens < 8:
        engine.step()
    assert not seq.is_finished and seq.grammar.matcher is not None
    assert llm.tokenizer.decode(seq.completion_token_ids).startswith('{"story":"')
    engine.abort(seq.seq_id)
    assert seq.finish_reason is FinishReason.ABORT and seq.grammar.matcher is None
    while engine.has_work():  # the step still in flight is collected and skipped
        engine.step()
    assert engine.scheduler.block_manager.num_used_blocks == 0
