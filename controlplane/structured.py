"""Structured output: grammars compiled with llguidance, one matcher per sequence, packed token bitmasks.

`SamplingParams.structured` names one of five kinds; each becomes an llguidance grammar:
- json_schema: a JSON schema (dict or its text), llguidance's JSON-schema subset; compact JSON by
  default (no free whitespace, which lets a small model loop on newlines), unless the schema's
  "x-guidance" options say otherwise;
- json_object: any JSON object;
- regex: Rust `regex` syntax (no look-around, no back-references), matched against the whole output;
- choice: exactly one of the strings;
- grammar: Lark as llguidance reads it (text with a `start:` rule or a `%llguidance` line) or GBNF,
  llama.cpp's EBNF (`root ::= ...`, what vLLM's xgrammar backend takes), converted to Lark first.

llguidance and not xgrammar: xgrammar's import loads torch, which the control plane never does.

Compiling runs on a small thread pool (llguidance drops the GIL while it builds a matcher), never on
the event loop or the engine thread: `GrammarCompiler.submit` returns a concurrent Future, `compile`
waits for it and `compile_async` awaits it. Results, failures included, are cached by kind and text
in a bounded LRU; a sequence gets a cheap deep copy of the cached matcher. A grammar that does not
compile raises ValueError with the compiler's message (INVALID_ARGUMENT through the API).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CACHE_SIZE = 256  # compiled grammars kept (the LRU bound); failures are cached too
COMPILE_THREADS = 2
MAX_ERROR_CHARS = 2000  # llguidance's messages can carry a whole parser state dump


def cache_key(structured: dict[str, Any]) -> tuple[str, str]:
    """(kind, canonical text): a schema dict and its JSON text with other spacing share one entry (key
    order is kept: the JSON grammar emits properties in the schema's order)."""
    kind, value = next(iter(structured.items()))
    if kind == "json_schema":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(schema, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid sampling parameter structured.json_schema: not a JSON document ({e})") from None
    if kind == "choice":
        return kind, json.dumps(list(value))
    if kind == "json_object":
        return kind, ""
    return kind, value


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a cache key; ValueError for text that does not even convert."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    matcher = llguidance.LLMatcher
    if kind in ("json_schema", "json_object"):
        schema = text if kind == "json_schema" else '{"type": "object"}'
        return matcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "grammar":
        try:
            return matcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # the converter's own exception types
            raise ValueError(f"structured.grammar is neither Lark nor GBNF that converts to it: {e}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


class CompiledGrammar:
    """A grammar that compiled: a pristine matcher that sequences copy."""

    __slots__ = ("key", "_matcher")

    def __init__(self, key: tuple[str, str], matcher):
        self.key = key
        self._matcher = matcher

    def matcher(self):
        return self._matcher.deep_copy()


class GrammarCompiler:
    """Compiles `SamplingParams.structured` for one tokenizer and vocabulary; thread-safe."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE, threads: int = COMPILE_THREADS):
        """`vocab_size`: the model's (the logits' width), which may exceed the tokenizer's; ids past
        the tokenizer's vocabulary are never allowed."""
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # apart from _lock: submit() never waits for the tokenizer's build
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._tokenizer = None  # llguidance's, built on first use (~0.3 s) on a pool thread
        self._executor = None  # llguidance's thread pool for masks
        self.hits = self.misses = 0

    @property
    def mask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def submit(self, structured: dict[str, Any]) -> Future:
        """A Future of the CompiledGrammar (or of the ValueError saying why it does not compile)."""
        key = cache_key(structured)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._cache[key] = self._pool.submit(self._compile, key)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, structured: dict[str, Any], timeout: float | None = None) -> CompiledGrammar:
        """Wait for the compile (on the pool); ValueError if it fails."""
        return self.submit(structured).result(timeout)

    async def compile_async(self, structured: dict[str, Any]) -> CompiledGrammar:
        """Await the compile without blocking the event loop; ValueError if it fails."""
        return await asyncio.wrap_future(self.submit(structured))

    def _llg_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        import llguidance

        grammar = grammar_text(*key)
        try:
            tokenizer = self._llg_tokenizer()
        except Exception as e:  # a model folder whose tokenizer llguidance cannot read: refuse, never crash
            raise ValueError(f"structured output is not available for this model: llguidance cannot use its "
                             f"tokenizer ({type(e).__name__}: {e})") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid sampling parameter structured.{key[0]}: {_short(matcher.get_error())}")
        return CompiledGrammar(key, matcher)

    def fill_masks(self, grammars: list[SequenceGrammar]) -> np.ndarray:
        """The packed int32 allowed-token masks [len(grammars), mask_width] of their next tokens,
        computed in parallel by llguidance's threads without the GIL."""
        import llguidance.numpy as lln

        bitmask = np.empty((len(grammars), self.mask_width), np.int32)
        lln.fill_next_token_bitmask_par(self._executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
        return bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's matcher, advanced with each of its output tokens (Sequence.grammar).

    `release` drops the matcher state (preemption, abort, finish); `ensure` rebuilds it from the
    compiled grammar by replaying the output so far (a preempted sequence readmitted)."""

    __slots__ = ("compiled", "matcher", "num_tokens", "error")

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.matcher = compiled.matcher()
        self.num_tokens = 0  # output tokens consumed
        self.error = ""  # why the matcher refused a token, if it did

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and `error` set) if the grammar does not allow it."""
        if self.matcher.consume_token(token_id):
            self.num_tokens += 1
            return True
        self.error = _short(self.matcher.get_error().split("\n", 1)[0])
        return False

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more but end-of-sequence."""
        return self.matcher.is_stopped()

    def ensure(self, output_token_ids: list[int]) -> None:
        """Have a matcher in the state after `output_token_ids` (rebuilt if it was released)."""
        if self.matcher is None:
            self.matcher = self.compiled.matcher()
            self.num_tokens = 0
            if output_token_ids and not self.matcher.consume_tokens(output_token_ids):
                raise RuntimeError(f"replaying a preempted sequence's output failed: {self.matcher.get_error()}")
            self.num_tokens = len(output_token_ids)

    def release(self) -> None:
        self.matcher = None
