"""Streaming text from streaming token ids: incremental detokenization and stop strings.

Decoding each new token alone is wrong in two ways: byte-level vocabularies split one character
over several tokens (a lone piece decodes to U+FFFD), and SentencePiece-style decoders drop the
leading space of the first token they see. So the detokenizer decodes a short window that starts a
few tokens back ("prefix") and emits only what the window gained past the text already emitted
("read" offset); while the window's text ends in U+FFFD the character is still incomplete and
nothing moves. Windows start only where an earlier window ended cleanly, so the pieces join up to
exactly what decoding all ids at once gives.

Stop strings are matched on the emitted text, with vLLM's meanings: the first stop string to
complete ends the output, its text cut before the stop unless include_stop_str_in_output, and none
is looked for before min_tokens output tokens. Text that could still grow into a stop string is
held back (unless the stop would be kept in the text anyway), so a client never receives a piece of
output that a later token turns into a stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import FinishReason

REPLACEMENT = "\ufffd"
# Tokens of prompt kept as decoding context: enough for a decoder's leading-space rule and for a
# multi-byte character split over byte tokens, small enough that each decode stays cheap.
CONTEXT_TOKENS = 6
# A character is at most 4 bytes, and an id that stays in the window decodes to at least one: text
# still ending in U+FFFD after this many unsettled ids holds bytes that no later id can complete.
# The last _UNSETTLED_KEEP ids stay unsettled, as they may yet complete one.
_UNSETTLED_MAX = 16
_UNSETTLED_KEEP = 8


class Decoder(Protocol):
    """controlplane/tokenizer.py's Tokenizer; spaces_between_special_tokens is passed only with
    skip_special_tokens=False (where it matters), so a decoder without it serves the default text."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns token ids, as they arrive, into final text pieces."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        if prompt_ids:
            self._use_context(list(prompt_ids))

    def _decode(self, token_ids: list[int]) -> str:
        if self.skip_special_tokens:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _use_context(self, prompt: list[int]) -> None:
        # The context must decode cleanly at its end (else its broken last character would swallow
        # the first output character in the length difference) and should start on a character
        # boundary; a prompt that ends mid-character gets no context, as decoding the output alone
        # would treat it.
        start = max(0, len(prompt) - CONTEXT_TOKENS)
        while start > 0 and self._decode(prompt[start:]).startswith(REPLACEMENT) and len(prompt) - start < 12:
            start -= 1
        if self._decode(prompt[start:]).endswith(REPLACEMENT):
            return
        self.token_ids = prompt[start:]
        self.read_offset = len(self.token_ids)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new ids; returns the text they settle (possibly empty)."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The end of the stream: whatever is held back, even a broken character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if not final and full_text == prefix_text and not self._decode(self.token_ids[self.read_offset:]):
            # Ids that decode to nothing, alone and in context (skipped special tokens, ids the
            # tokenizer does not know): drop them, or every later step would decode a window that
            # grows with them (quadratic in the output's length).
            del self.token_ids[self.read_offset:]
            return ""
        if not final and full_text.endswith(REPLACEMENT) and len(self.token_ids) - self.read_offset > _UNSETTLED_MAX:
            return self._settle_broken(prefix_text, full_text)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return ""
        return self._move_to(len(self.token_ids), full_text[len(prefix_text):])

    def _settle_broken(self, prefix_text: str, full_text: str) -> str:
        """The text has ended in U+FFFD for more ids than any character has bytes: its broken bytes
        (a model looping on a stray UTF-8 byte) are final. Settle all but the last _UNSETTLED_KEEP
        ids, if the text up to there is what the whole window decodes to at its start; otherwise
        every push would decode a window that grows with the output (quadratic)."""
        cut = len(self.token_ids) - _UNSETTLED_KEEP
        cut_text = self._decode(self.token_ids[self.prefix_offset:cut])
        if len(cut_text) <= len(prefix_text) or not full_text.startswith(cut_text):
            return ""
        return self._move_to(cut, cut_text[len(prefix_text):])

    def _move_to(self, read_offset: int, text: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, read_offset
        # Only the window from prefix_offset is ever decoded again: drop what lies before it so a
        # long output does not keep a growing list.
        if self.prefix_offset > 64:
            del self.token_ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return text


def _failure(stop: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of stop[:i + 1] that is also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Cuts text at the first stop string, holding back any tail that may start one. With `include`
    (include_stop_str_in_output) the cut comes after the stop string and nothing is held back: a
    tail that becomes a stop is kept in the text anyway."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.include = include
        self.held = ""  # text not yet released; with include, the released tail a stop may still end in
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
        self._longest = max(map(len, self.stops), default=0)
        # Per stop, the length of its longest prefix that ends the text so far (a streaming
        # Knuth-Morris-Pratt match): the held-back tail costs each pushed character O(1) per stop,
        # not a scan of every prefix of every stop, which at 64 stops of 1 KiB stalls the event loop.
        self._fails: list[list[int] | None] = [None] * len(self.stops)  # each made at its first mismatch
        self._states = [0] * len(self.stops)

    def push(self, text: str, match: bool = True) -> str:
        """Add text; returns the part that is settled and comes before any stop string (with
        include, up to its end). `match=False`: this text may not end the output (min_tokens), yet
        a stop that starts in it and ends in later text counts."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        base = len(self.held)
        self.held += text
        found = self._first_stop(base) if match else None
        if found is not None:
            end, start, stop = found
            out = text[:end - base] if self.include else self.held[:start]
            self.held, self.stopped, self.matched = "", True, stop
            return out
        if self.include:
            self.held = self.held[max(0, len(self.held) - self._longest + 1):]  # a stop may still end in it
            return text
        keep = self._advance(text)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def _first_stop(self, base: int) -> tuple[int, int, str] | None:
        """(end, start, stop) of the stop string in the held text that completes first past `base`
        (ties: the one starting earlier), as if the text came one character at a time: the outcome
        must not depend on how tokens are batched."""
        best: tuple[int, int, str] | None = None
        held = self.held
        for stop in self.stops:
            i = held.find(stop, max(0, base - len(stop) + 1))
            if i != -1 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return best

    def _advance(self, text: str) -> int:
        """Feed `text` to each stop's match; returns the length of the longest tail of the text that
        is a proper prefix of a stop string (no stop is complete here: push found none)."""
        states = self._states
        for j, stop in enumerate(self.stops):
            state, fail = states[j], self._fails[j]
            for c in text:
                while state and stop[state] != c:
                    if fail is None:
                        fail = self._fails[j] = _failure(stop)
                    state = fail[state - 1]
                if stop[state] == c:
                    state += 1
                    if state == len(stop):  # unreachable after push's find; kept proper all the same
                        if fail is None:
                            fail = self._fails[j] = _failure(stop)
                        state = fail[state - 1]
            states[j] = state
        return min(max(states), len(self.held))

    def flush(self) -> str:
        """The end of the stream: held-back text turned out not to be a stop string."""
        out, self.held = ("" if self.stopped or self.include else self.held), ""
        return out


def ended_by_token(finish_reason: FinishReason | None, stop_reason: int | str | None) -> bool:
    """Whether the output's last token ended it (end-of-sequence or a stop token id): TextStream.push's
    `ended_by_token` for the message that carries that token."""
    return finish_reason is FinishReason.EOS or (finish_reason is FinishReason.STOP and isinstance(stop_reason, int))


class TextStream:
    """Detokenizer and stop strings together: the text of one request's output, with vLLM's text
    options (SamplingParams: stop, include_stop_str_in_output, skip_special_tokens,
    spaces_between_special_tokens, min_tokens)."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), stops: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, min_tokens: int = 0):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens,
                                                  spaces_between_special_tokens)
        self.stop = StopMatcher(stops, include_stop_str_in_output)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0  # output ids pushed so far

    @classmethod
    def for_params(cls, tokenizer: Decoder, prompt_ids: Sequence[int], params: SamplingParams) -> TextStream:
        """The text stream a request with these sampling parameters asks for."""
        return cls(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens,
                   params.spaces_between_special_tokens, params.min_tokens)

    @property
    def stopped(self) -> bool:
        """True once the text reached a stop string: the request is over, whatever the engine says."""
        return self.stop.stopped

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, once stopped."""
        return self.stop.matched

    def push(self, token_ids: Iterable[int], finished: bool = False, ended_by_token: bool = False) -> str:
        """New text for new ids; with finished=True, also everything held back. `ended_by_token`: the
        last of these ids ended the output as end-of-sequence or a stop token id; as in vLLM, its
        text is left out unless include_stop_str_in_output."""
        ids = list(token_ids)
        if ended_by_token and ids and not self.include_stop_str_in_output:
            ids.pop()
        # Stop strings count from the output's (min_tokens + 1)-th token on, as in vLLM.
        quiet = min(len(ids), max(0, self.min_tokens - self.num_tokens))
        self.num_tokens += len(ids)
        text = self.stop.push(self.detokenizer.push(ids[:quiet]), match=False) if quiet else ""
        if quiet < len(ids) or not quiet:
            text += self.stop.push(self.detokenizer.push(ids[quiet:]))
        if finished and not self.stopped:
            text += self.stop.push(self.detokenizer.flush())
            text += self.stop.flush()
        return text
