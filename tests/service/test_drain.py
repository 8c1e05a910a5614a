"""SIGTERM drains `nanoplane serve` (real processes): readiness NOT_SERVING at once while liveness stays
SERVING and the port still takes calls for --drain-delay, then new calls get UNAVAILABLE, the streams in
flight finish (or are ended with a message at --drain-timeout), the data plane leaves and the exit is 0;
a second signal stops at once."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from nanoplane.clients.client import READINESS, Client
from nanoplane.controlplane.vllm_servicer import SERVICE as VLLM_SERVICE
from nanoplane.demo import serve_in_background

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(5, 35))
LONG = 1024 - len(PROMPT)  # the tiny models' whole context


class Stream(threading.Thread):
    """One long greedy stream on a client of its own: its tokens, or the error that ended it."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.client = Client(address)
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.client.generate(PROMPT, temperature=0.0, max_tokens=LONG, ignore_eos=True):
                self.tokens.extend(chunk.token_ids)
                self.started.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.started.set()


@contextlib.contextmanager
def serving(model: Path, *flags: str) -> Iterator[tuple[str, psutil.Popen, list[psutil.Process]]]:
    """(address, serve's process, its data plane's processes)."""
    argv = ["--model", str(model), "--device", "cpu", "--max-num-batched-tokens", "64", *flags]
    with serve_in_background(argv, 120, cwd=ROOT) as (address, proc):
        yield address, proc, psutil.Process(proc.pid).children(recursive=True)


def streams(address: str, n: int) -> list[Stream]:
    started = [Stream(address) for _ in range(n)]
    for s in started:
        s.start()
    for s in started:
        assert s.started.wait(60) and s.error is None, s.error
    return started


def wait_for(predicate, timeout: float, poll: float = 0.02) -> float:
    """Seconds until predicate() held; AssertionError past timeout."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "not in time"
        time.sleep(poll)
    return time.monotonic() - t0


def gone(processes: list[psutil.Process], timeout: float = 15.0) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


def test_sigterm_turns_readiness_off_then_refuses_new_requests_and_lets_streams_finish(tiny_models):
    delay = 2.0
    with serving(tiny_models["qwen3"], "--drain-delay", str(delay), "--drain-timeout", "120") as (address, proc, kids):
        running = streams(address, 6)  # several at once: the drain must outlast the delay
        with Client(address) as client:
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            wait_for(lambda: client.health() == "NOT_SERVING", timeout=1.0)
            assert client.health(VLLM_SERVICE) == "NOT_SERVING" and client.health(READINESS) == "NOT_SERVING"
            assert client.health("") == "SERVING"  # liveness: a probe must not kill a draining replica
            assert client.tokenize("still open") and time.monotonic() - sent < delay  # the listener takes calls
            time.sleep(max(0.0, sent + delay + 0.5 - time.monotonic()))
            assert any(s.is_alive() for s in running), "the streams ended before the delay: nothing drained"
            with pytest.raises(grpc.RpcError) as refused:
                list(client.generate(PROMPT, max_tokens=2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
            assert client.health("") == "SERVING"
        for s in running:
            s.join(120)
            assert s.error is None and len(s.tokens) == LONG, s.error
        assert proc.wait(30) == 0
        assert gone(kids), "the data plane outlived serve"


def test_drain_timeout_ends_the_streams_still_running_with_a_message(tiny_models):
    with serving(tiny_models["qwen3"], "--drain-delay", "0", "--drain-timeout", "0.5") as (address, proc, kids):
        running = streams(address, 6)
        proc.send_signal(signal.SIGTERM)
        for s in running:
            s.join(30)
        ended = [s.error for s in running if s.error is not None]
        assert ended, "every stream finished within 0.5 s: the timeout was not exercised"
        for e in ended:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "did not finish in time" in e.details(), e
        assert proc.wait(30) == 0
        assert gone(kids)


def test_a_second_signal_stops_at_once(tiny_models):
    with serving(tiny_models["qwen3"], "--drain-delay", "60", "--drain-timeout", "60") as (address, proc, kids):
        with Client(address) as client:
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: client.health() == "NOT_SERVING", timeout=1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        assert time.monotonic() - sent < 20 and gone(kids)


def test_connection_age_lets_streams_finish_and_requests_are_size_bounded(tiny_models):
    """--max-connection-age: streams outliving the age still finish (the grace is --drain-timeout);
    a request over --max-request-bytes gets RESOURCE_EXHAUSTED saying how large it was."""
    flags = ("--max-connection-age", "1", "--drain-timeout", "60", "--max-request-bytes", "20000")
    with serving(tiny_models["qwen3"], *flags) as (address, proc, kids):
        t0 = time.monotonic()
        running = streams(address, 6)
        with Client(address) as client:
            with pytest.raises(grpc.RpcError) as big:
                client.tokenize("x" * 30000)
            assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in big.value.details() and "20000" in big.value.details(), big.value.details()
            assert client.tokenize("x" * 1000)
            for s in running:
                s.join(120)
                assert s.error is None and len(s.tokens) == LONG, s.error
            assert time.monotonic() - t0 > 1.5, "the streams did not outlive the connection age"
            time.sleep(1.5)  # past the age: the client reconnects by itself
            assert client.tokenize("after the age")
