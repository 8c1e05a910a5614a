"""nanoplane/liveness.py: a peer's silence leaves out the time this process itself did not run. A fake
clock drives it; nothing sleeps."""

from __future__ import annotations

import pytest

from nanoplane.liveness import Liveness


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def run(self, until: float, liveness: Liveness, every: float = 0.1) -> None:
        """The waiting loop turning normally: a judgement every `every` seconds up to `until`."""
        while self.now + every <= until + 1e-9:
            self.now += every
            assert liveness.judge() == 0.0


def test_silence_is_the_time_since_the_last_word():
    clock = Clock()
    live = Liveness(clock=clock)
    live.heard("rank0")
    clock.run(103.0, live)
    assert live.silent("rank0") == pytest.approx(3.0)
    live.heard("rank0")
    assert live.silent("rank0") == 0.0


def test_a_stall_of_this_process_is_not_counted():
    clock = Clock()
    live = Liveness(stall_s=1.0, clock=clock)
    live.heard()
    clock.run(100.5, live)
    clock.now = 110.5  # SIGSTOP for ten seconds
    assert live.judge() == pytest.approx(10.0)
    assert live.silent() == pytest.approx(0.5)
    clock.run(112.5, live)  # a peer that stays silent afterwards is still caught
    assert live.silent() == pytest.approx(2.5)


def test_gaps_up_to_stall_s_are_ordinary_silence():
    clock = Clock()
    live = Liveness(stall_s=1.0, clock=clock)
    live.heard()
    live.judge()
    for _ in range(3):
        clock.now += 1.0  # a slow loop, but not a stall: the peer's silence counts in full
        assert live.judge() == 0.0
    assert live.silent() == pytest.approx(3.0)


def test_after_a_stall_the_peer_that_fell_silent_first_is_still_first():
    clock = Clock()
    live = Liveness(clock=clock)
    live.heard("first")
    clock.run(100.5, live)
    live.heard("second")
    clock.run(101.0, live)
    clock.now = 106.0
    assert live.judge() == pytest.approx(5.0)
    assert live.silent("first") == pytest.approx(1.0)
    assert live.silent("second") == pytest.approx(0.5)


def test_a_stall_never_moves_a_last_word_past_now():
    clock = Clock()
    live = Liveness(clock=clock)
    live.judge()
    clock.now += 0.05
    live.heard()  # heard just after a judgement, then the stall
    clock.now += 5.0
    assert live.judge() == pytest.approx(5.05)
    assert live.silent() == 0.0


def test_the_first_judgement_is_no_stall_and_forgotten_peers_are_gone():
    clock = Clock(now=5000.0)
    live = Liveness(clock=clock)
    live.heard("a", now=4000.0)
    assert live.judge() == 0.0
    assert live.silent("a") == pytest.approx(1000.0)
    live.forget("a")
    live.forget("a")  # twice is harmless: a retired launch's ranks may be forgotten again
    with pytest.raises(KeyError):
        live.silent("a")


def test_explicit_times_override_the_clock():
    live = Liveness(clock=lambda: pytest.fail("the clock is not read when the time is given"))
    live.heard("r", now=10.0)
    assert live.judge(now=10.1) == 0.0
    assert live.judge(now=15.1) == pytest.approx(5.0)
    assert live.silent("r", now=15.2) == pytest.approx(0.2)  # heard at 10.0, moved on by 5.0
