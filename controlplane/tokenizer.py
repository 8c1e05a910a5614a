"""Text to token ids and back, and the model's chat template; HuggingFace tokenizers without torch."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

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
        self._chat = ChatEncoder(self.hf.backend_tokenizer)
        self._special = {i: t.content for i, t in self.hf.backend_tokenizer.get_added_tokens_decoder().items()
                         if t.special}  # id -> text of the tokens skip_special_tokens leaves out

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

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """vLLM's text: special tokens left out, or (skip_special_tokens=False) each decoded as a segment
        of its own, the segments joined by a space when spaces_between_special_tokens (as HuggingFace's
        slow tokenizers do; a fast tokenizer has no such option). The default is the plain text the
        tokens stand for; outputs pass their request's SamplingParams value (True unless set)."""
        if skip_special_tokens or self._special.keys().isdisjoint(token_ids):
            return self._decode(token_ids, skip_special_tokens)
        segments, start = [], 0
        for i, t in enumerate(token_ids):
            if t in self._special:
                segments += [self._decode(token_ids[start:i], False), self._special[t]]
                start = i + 1
        segments.append(self._decode(token_ids[start:], False))
        return (" " if spaces_between_special_tokens else "").join(s for s in segments if s)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
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
        """The conversation's prompt text and ids. Only the template's own markers become special
        tokens: special-token text inside a message (content or role) is encoded as the plain text
        it is, so that a client cannot forge a system or assistant turn. `check` sees the templated
        text before it is encoded (and may refuse it by raising)."""
        escaped = self._chat.escape(messages)
        if escaped is None:  # no special-token text in any message: the template's text as it is
            text = self.apply_chat_template(messages)
            if check is not None:
                check(text)
            ids = self.hf.encode(text, add_special_tokens=False)
            if self._chat.count_special(ids) == self._chat.count_markers(text):
                return text, ids
            # A normalizer turned message text into a special token: the careful way after all.
            escaped = self._chat.escape(messages, always=True)
        rendered, unescape = escaped
        templated = self.apply_chat_template(rendered)
        text = unescape(templated)
        if check is not None:
            check(text)
        return text, self._chat.encode(templated, unescape)


class ChatEncoder:
    """Encodes a chat template's output so that only the template's own special-token text becomes
    special tokens. Each special token's text in the messages is swapped for a private-use character
    before the template runs, so every special token left in its output is one of its markers; the
    text between markers is then encoded with special-token parsing off (the tokenizers library's
    `encode_special_tokens`), the swapped characters put back first."""

    def __init__(self, backend: BackendTokenizer):
        self.special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(self.special.values())
        # Longest first: a token whose text starts another's must not cut that one short.
        names = sorted(self.special, key=len, reverse=True)
        self._marker = re.compile("|".join(map(re.escape, names))) if names else None
        self._plain = BackendTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True  # this copy only: never shared with other encodes

    def count_special(self, ids: list[int]) -> int:
        return sum(i in self._special_ids for i in ids)

    def count_markers(self, text: str) -> int:
        return 0 if self._marker is None else sum(1 for _ in self._marker.finditer(text))

    def escape(self, messages: list[dict[str, str]], always: bool = False
               ) -> tuple[list[dict[str, str]], Callable[[str], str]] | None:
        """The messages with special-token text swapped for private-use characters none of them
        holds, and the function that swaps them back; None when no message holds any (unless `always`)."""
        if self._marker is None:
            return None if not always else (messages, lambda text: text)
        strings = [v for m in messages for v in m.values() if isinstance(v, str)]
        if not always and not any(self._marker.search(v) for v in strings):
            return None
        taken = {c for v in strings for c in _PRIVATE.findall(v)}
        free = (chr(c) for c in range(_PRIVATE_FIRST, _PRIVATE_LAST + 1) if chr(c) not in taken)
        to_char = {name: next(free) for name in self.special}
        to_name = {c: name for name, c in to_char.items()}
        back = re.compile("|".join(map(re.escape, to_name)))

        def swap(value: object) -> object:
            return self._marker.sub(lambda m: to_char[m.group()], value) if isinstance(value, str) else value

        return ([{k: swap(v) for k, v in m.items()} for m in messages],
                lambda text: back.sub(lambda m: to_name[m.group()], text))

    def encode(self, templated: str, unescape: Callable[[str], str]) -> list[int]:
        """Ids of the template's output: its markers as special tokens, the rest as plain text."""
        ids: list[int] = []
        start = 0
        for marker in self._marker.finditer(templated):
            ids += self._plain_ids(unescape(templated[start:marker.start()]))
            ids.append(self.special[marker.group()])
            start = marker.end()
        return ids + self._plain_ids(unescape(templated[start:]))

    def _plain_ids(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []


# Unicode's supplementary private use area B: characters no tokenizer gives a meaning to.
_PRIVATE_FIRST, _PRIVATE_LAST = 0x100000, 0x10FFFD
_PRIVATE = re.compile("[\U00100000-\U0010FFFD]")

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
