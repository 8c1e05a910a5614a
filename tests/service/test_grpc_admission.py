"""Admission control and deadlines on a real server, both engine fronts: a burst past the queue's
bounds is refused with RESOURCE_EXHAUSTED and a retry pushback while the admitted requests complete;
a request whose deadline passes in the queue ends with DEADLINE_EXCEEDED before it is prefilled.

One slot (max_num_seqs=1) and a long first request keep the others waiting. While the burst is sent,
no step completes (a slow in-process data plane, or the engine process's ranks suspended), so every
request of it reaches the engine before the first request could end: which are refused is certain."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import psutil
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from support.grpc_server import FRONTS, ServerThread, serving, wait_idle
from support.tiny_models import make_tiny_model

from nanoplane.clients import Client
from nanoplane.controlplane.errors import DeadlineExceeded
from nanoplane.controlplane.sampling_params import SamplingParams

LONG = 200  # output tokens of the request that holds the one slot
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("admission") / "tiny", arch="qwen3", seed=3))


@contextmanager
def no_step_completes(s: ServerThread) -> Iterator[None]:
    """Hold the data plane: the engine stays inside a step, and commands wait for it."""
    if s.in_process:
        s.plane.delay = 0.8
        try:
            yield
        finally:
            s.plane.delay = 0.01
        return
    launcher = psutil.Process(s.supervisor.proc.pid)
    procs = [launcher, *launcher.children(recursive=True)]
    for p in procs:
        p.suspend()
    try:
        yield
    finally:
        for p in procs:
            p.resume()


class Call(threading.Thread):
    """One Generate on a thread: its token count, or its error."""

    def __init__(self, client: Client, prompt: list[int], max_tokens: int, timeout: float | None = None):
        super().__init__(daemon=True)
        self.client, self.prompt, self.max_tokens, self.timeout = client, prompt, max_tokens, timeout
        self.tokens, self.error = 0, None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.client.generate(self.prompt, max_tokens=self.max_tokens, ignore_eos=True,
                                              timeout=self.timeout):
                self.tokens += len(chunk.token_ids)
                self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        self.first.set()


@contextmanager
def one_slot(model: str, front: str, **options) -> Iterator[tuple[ServerThread, Client, Call]]:
    """A server with one slot, held by a long request that is already producing tokens."""
    with serving(model, flaky=front == "in-process", front=front, max_num_seqs=1, **options) as (s, client):
        if s.in_process:
            s.plane.delay = 0.01  # LONG tokens take 2 s
        holder = Call(client, [1, 2, 3], LONG)
        assert holder.first.wait(60) and holder.error is None, holder.error
        yield s, client, holder


def burst(s: ServerThread, client: Client, n: int) -> list[Call]:
    with no_step_completes(s):
        calls = [Call(client, PROMPT, 4) for _ in range(n)]
        time.sleep(0.4)  # every call reaches the engine meanwhile
    for call in calls:
        call.join(60)
    return calls


def check_refused(calls: list[Call], n_refused: int, bound: str) -> None:
    refused = [c for c in calls if c.error is not None]
    assert len(refused) == n_refused, [c.error for c in refused]
    for c in refused:
        assert c.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, c.error
        assert bound in c.error.details() and "retry later" in c.error.details()
        assert dict(c.error.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
        status, info = rpc_status.from_call(c.error), error_details_pb2.RetryInfo()  # google.rpc.Status too
        assert status.message == c.error.details() and status.details[0].Unpack(info)
        assert info.retry_delay.ToMilliseconds() == 1000
    assert all(c.tokens == 4 for c in calls if c.error is None)


@pytest.mark.parametrize("front", FRONTS)
def test_a_burst_past_the_request_bound_is_refused_with_a_pushback(model, front):
    with one_slot(model, front, max_queued_requests=2) as (s, client, holder):
        calls = burst(s, client, 5)
        check_refused(calls, 3, "--max-queued-requests 2")
        if s.in_process:  # calls without a deadline leave the scheduler nothing to watch
            assert not s.server.front.loop.engine.scheduler._deadlines
        holder.join(60)
        assert holder.error is None and holder.tokens == LONG
        wait_idle(client)


@pytest.mark.parametrize("front", FRONTS)
def test_a_burst_past_the_token_bound_is_refused_with_a_pushback(model, front):
    with one_slot(model, front, max_queued_tokens=2 * len(PROMPT) + 1) as (s, client, holder):
        calls = burst(s, client, 4)
        check_refused(calls, 2, f"--max-queued-tokens {2 * len(PROMPT) + 1}")
        holder.join(60)
        assert holder.error is None and holder.tokens == LONG
        wait_idle(client)


@pytest.mark.parametrize("front", FRONTS)
def test_a_request_whose_deadline_passes_in_the_queue_ends_before_prefill(model, front):
    with one_slot(model, front) as (s, client, holder):
        used = client.server_status().kv_blocks_used
        with no_step_completes(s):
            late = Call(client, PROMPT, 4, timeout=0.3)
            patient = Call(client, PROMPT, 4, timeout=120)
            late.join(30)
        assert late.error is not None and late.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert late.tokens == 0
        patient.join(60)
        holder.join(60)
        assert (patient.error, patient.tokens, holder.error, holder.tokens) == (None, 4, None, LONG)
        assert used > 0
        wait_idle(client)


@pytest.mark.parametrize("front", FRONTS)
def test_the_engine_drops_an_expired_request_with_a_clear_message(model, front):
    """Below the gRPC layer (whose own timer would also end the call): the front's timeout reaches the
    engine, in this process or the engine process, which drops the request itself."""
    with one_slot(model, front) as (s, client, holder):
        async def expire() -> BaseException:
            try:
                async for _ in s.server.front.generate(PROMPT, SamplingParams(max_tokens=4), "late", timeout_s=0.1):
                    pass
            except DeadlineExceeded as exc:
                return exc
            raise AssertionError("the request ran")

        with no_step_completes(s):  # its deadline passes while it waits
            future = asyncio.run_coroutine_threadsafe(expire(), s.loop)
            time.sleep(0.4)
        error = future.result(30)
        assert "deadline passed" in str(error) and "nothing was computed" in str(error)
        if s.in_process:
            assert s.server.front.loop.engine.scheduler.num_expired == 1
        holder.join(60)
        assert holder.error is None and holder.tokens == LONG
        wait_idle(client)
