"""Text to token ids and back, and the model's chat template; HuggingFace tokenizers without torch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

# PreTrainedTokenizerFast, not AutoTokenizer: importing the latter loads torch when it is installed.
from transformers import PreTrainedTokenizerFast


class Tokenizer:
    def __init__(self, model_dir: str):
        if not (Path(model_dir) / "tokenizer.json").is_file():
            raise ValueError(f"model folder {model_dir!r} has no tokenizer.json (a fast tokenizer is required)")
        self.hf = PreTrainedTokenizerFast.from_pretrained(model_dir)
        self.eos_token_ids = self._eos_ids(Path(model_dir))
        # The detokenizer decodes a short window per stream per step, tens of thousands a second in a
        # busy server: call the Rust tokenizer directly, skipping transformers' per-id Python checks,
        # unless the tokenizer asks for transformers' clean-up of spaces, which only it implements.
        self._backend_decode = None if self.hf.clean_up_tokenization_spaces else self.hf.backend_tokenizer.decode

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        # generation_config.json may list several end tokens (chat models end turns with their own).
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                ids.update(value if isinstance(value, list) else [value] if value is not None else [])
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def surely_longer(self, text: str, limit: int) -> bool:
        """Whether `text` encodes to more than `limit` tokens, found without encoding all of it.

        Encoding builds a few hundred bytes of Python and Rust objects per token: a 1.3M-character
        text that will be refused anyway took ~400 MB and ~2 s. Here the text goes in pieces of up to
        PIECE_CHARS, and the count stops once it passes the limit, so the work is bounded by the
        limit, not by the text. A piece ends before a whitespace character that follows a
        non-whitespace one: byte-level and metaspace pre-tokenizers never join across such a point,
        so the pieces' counts add up to the whole's, give or take a prefix a pre-tokenizer may put
        at the start of each piece (CUT_SLACK tokens a cut are taken off the count for it). A cut
        that finds no such point within CUT_SEARCH_CHARS is forced, and takes FORCED_CUT_SLACK off,
        since a cut word may encode to more tokens than it does whole."""
        backend = self.hf.backend_tokenizer
        total, start, n = 0, 0, len(text)
        while start < n:
            end, slack = min(start + PIECE_CHARS, n), 0
            if end < n:
                end, slack = _cut(text, start, end)
            total += len(backend.encode(text[start:end], add_special_tokens=False).ids) - slack
            if total > limit:
                return True
            start = end
        return False

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a conversation, ending where the assistant's answer starts."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: send a plain text prompt instead")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict[str, str]],
                    check: Callable[[str], None] | None = None) -> tuple[str, list[int]]:
        """The conversation's prompt text and ids; the template already holds any special tokens.
        `check` sees the templated text before it is encoded (and may refuse it by raising)."""
        text = self.apply_chat_template(messages)
        if check is not None:
            check(text)
        return text, self.hf.encode(text, add_special_tokens=False)


PIECE_CHARS = 16_384
CUT_SEARCH_CHARS = 1_024
CUT_SLACK = 2
FORCED_CUT_SLACK = 16


def _cut(text: str, start: int, end: int) -> tuple[int, int]:
    """Where a piece of text[start:end] should end, and the tokens a cut there may add."""
    for i in range(end, max(start, end - CUT_SEARCH_CHARS), -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i, CUT_SLACK
    return end, FORCED_CUT_SLACK
