"""The queue of requests waiting to be admitted (the scheduler's `waiting`)."""

from __future__ import annotations

from collections import deque

from nanoplane.controlplane.sequence import Sequence


class WaitQueue:
    """The requests waiting to be admitted, first in first out, with O(1) membership and removal.

    A deque's `in` and remove scan the queue: a client that dropped 50,000 queued requests held the
    engine thread for 26 s. Here a removed request is only marked gone, dropped once it reaches an
    end or swept out when the gone outnumber the live, so the head and the tail are always live, and
    len() counts live requests only.
    """

    __slots__ = ("_queue", "_live", "_gone", "num_prompt_tokens")

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()
        self._live: set[Sequence] = set()  # Sequence hashes by identity
        self._gone: set[Sequence] = set()  # removed, still somewhere inside _queue
        self.num_prompt_tokens = 0  # of the live requests (the --max-queued-tokens bound)

    def append(self, seq: Sequence) -> None:
        self._queue.append(seq)
        self._live.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens

    def appendleft(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)
        self._live.add(seq)
        self.num_prompt_tokens += seq.num_prompt_tokens

    def popleft(self) -> Sequence:
        seq = self._queue.popleft()
        self._live.remove(seq)
        self.num_prompt_tokens -= seq.num_prompt_tokens
        self._trim()
        return seq

    def remove(self, seq: Sequence) -> None:
        self._live.remove(seq)  # KeyError, as deque.remove's ValueError, for a request not queued
        self.num_prompt_tokens -= seq.num_prompt_tokens
        self._gone.add(seq)
        self._trim()
        if len(self._gone) > max(len(self._live), 64):
            # Gone requests behind a blocked head would pile up (with their token lists) for as long
            # as it stays blocked: sweep them out once they outnumber the live ones (amortised O(1)).
            self._queue = deque(s for s in self._queue if s not in self._gone)
            self._gone.clear()

    def _trim(self) -> None:
        queue, gone = self._queue, self._gone
        while queue and queue[0] in gone:
            gone.remove(queue.popleft())
        while queue and queue[-1] in gone:
            gone.remove(queue.pop())

    def __getitem__(self, index: int) -> Sequence:
        assert index in (0, -1), "only the ends of the queue are kept live"
        return self._queue[index]

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self):
        return (seq for seq in self._queue if seq in self._live)
