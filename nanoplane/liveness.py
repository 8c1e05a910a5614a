"""How long a peer has been silent, not counting the time this process itself did not run.

A process that waits for a peer's heartbeats judges its silence in a loop. If that process does not
run for a while (SIGSTOP, swap, a frozen container), the peer's beats of that time may still wait in
ZeroMQ's I/O thread, not yet in the socket: the silence is this process's, not the peer's. A gap
between two judgements longer than `stall_s` is such a stall, and every peer's last word moves on by
it, so that nobody is declared dead for it and the peer that fell silent first is still first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

# A gap this long between two judgements means this process did not run; the waiting loops judge at
# least every few tenths of a second.
STALL_S = 1.0


class Liveness:
    """The last word of each peer (any hashable key; None for a process that waits for one peer)."""

    def __init__(self, stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic):
        self.stall_s = stall_s
        self.clock = clock
        self._heard: dict[Hashable, float] = {}
        self._judged_at: float | None = None

    def heard(self, peer: Hashable = None, now: float | None = None) -> None:
        """The peer said something (or was just started): its silence starts again."""
        self._heard[peer] = self.clock() if now is None else now

    def forget(self, peer: Hashable = None) -> None:
        self._heard.pop(peer, None)

    def judge(self, now: float | None = None) -> float:
        """Call once per turn of the waiting loop; returns how long this process stalled (0.0: it did not).

        A stall moves every peer's last word on by its length, never past now."""
        now = self.clock() if now is None else now
        stall = 0.0 if self._judged_at is None else now - self._judged_at
        self._judged_at = now
        if stall <= self.stall_s:
            return 0.0
        for peer, at in self._heard.items():
            self._heard[peer] = min(at + stall, now)
        return stall

    def silent(self, peer: Hashable = None, now: float | None = None) -> float:
        """Seconds since the peer's last word, stalls of this process left out."""
        return (self.clock() if now is None else now) - self._heard[peer]
