"""KV-cache events through both engine fronts on a real (tiny) model: the hashes they store are the
ones a later request's prefix lookup finds, a flush clears them, a subscriber resumes from a number,
and a replaced engine process is announced as all cleared."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import psutil
import pytest

from nanoplane.clients import Client
from nanoplane.controlplane.block_manager import NO_HASH, chain_hash
from nanoplane.controlplane.front_inproc import InProcessFront
from nanoplane.controlplane.kv_events import KvEventsOff
from nanoplane.proto.kv_events import AllBlocksCleared, BlockStored, KvEventBatch, signed64
from tests.support.grpc_server import FRONTS, ServerThread, wait_idle
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("kv") / "tiny", arch="qwen3", seed=5))


@pytest.fixture(scope="module", params=FRONTS)
def server(model, request):
    s = ServerThread(model, front=request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as c:
        yield c


class Subscription:
    """front.kv_events(start) read on the server's event loop into `batches`."""

    def __init__(self, server: ServerThread, start: int):
        self.batches: list[KvEventBatch] = []

        async def read() -> None:
            async for batch in server.server.front.kv_events(start):
                self.batches.append(batch)

        self._task = asyncio.run_coroutine_threadsafe(read(), server.loop)

    def wait(self, done: Callable[[list[KvEventBatch]], bool], timeout: float = 20.0) -> list[KvEventBatch]:
        deadline = time.monotonic() + timeout
        while not done(self.batches):
            assert time.monotonic() < deadline, f"never came; got {self.batches}"
            time.sleep(0.02)
        return self.batches

    def stored(self) -> dict[int, tuple[int | None, list[int]]]:
        """hash -> (parent, tokens) of every block stored since the latest AllBlocksCleared."""
        blocks: dict[int, tuple[int | None, list[int]]] = {}
        for batch in self.batches:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    blocks.clear()
                elif isinstance(e, BlockStored):
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        blocks[h] = (parent, e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                        parent = h
        return blocks

    def close(self) -> None:
        self._task.cancel()


def chain(tokens: list[int], block_size: int) -> list[int]:
    """The prefix cache's hashes of tokens' full blocks, as the protocol carries them."""
    hashes, parent = [], NO_HASH
    for i in range(len(tokens) // block_size):
        parent = chain_hash(tokens[i * block_size:(i + 1) * block_size], parent)
        hashes.append(signed64(parent))
    return hashes


def usage(client: Client, prompt: list[int]):
    chunks = list(client.generate(prompt, max_tokens=2))
    return chunks[-1].usage


def test_stored_hashes_are_found_by_a_later_request_and_flush_clears_them(server, client):
    bs = client.model_info().kv_block_size
    sub = Subscription(server, 0)
    try:
        first = sub.wait(lambda b: len(b) >= 1)[0]
        assert first.events[0] == AllBlocksCleared()  # a new subscriber's state comes first
        prompt = [11 + i for i in range(3 * bs + 5)]
        assert usage(client, prompt).cached_prompt_tokens == 0
        hashes = chain(prompt, bs)
        sub.wait(lambda b: set(hashes) <= set(sub.stored()))
        stored = sub.stored()
        assert [stored[h] for h in hashes] == [(None if i == 0 else hashes[i - 1], prompt[i * bs:(i + 1) * bs])
                                               for i in range(3)]
        numbers = [b.sequence_number for b in sub.batches]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # no gap
        # What the events announced is what a later request's lookup finds.
        assert usage(client, prompt[:3 * bs] + [300, 301]).cached_prompt_tokens == 3 * bs
        # A subscriber resuming from a number the buffer holds gets the same batches from there.
        resumed = Subscription(server, numbers[1])
        try:
            resumed.wait(lambda b: len(b) >= len(numbers) - 1)
            assert resumed.batches[:len(numbers) - 1] == sub.batches[1:len(numbers)]
        finally:
            resumed.close()
        wait_idle(client)
        assert asyncio.run_coroutine_threadsafe(server.server.front.flush_prefix_cache(), server.loop).result(10)
        sub.wait(lambda b: AllBlocksCleared() in b[-1].events)
        assert sub.stored() == {}
        assert usage(client, prompt).cached_prompt_tokens == 0
    finally:
        sub.close()


def test_a_replaced_engine_process_is_announced_as_all_cleared(server, client):
    if server.in_process:
        pytest.skip("the engine process front only")
    bs = client.model_info().kv_block_size
    sub = Subscription(server, 0)
    try:
        sub.wait(lambda b: len(b) >= 1)
        [engine] = [c for c in psutil.Process().children()
                    if "nanoplane.controlplane.engine_process" in " ".join(c.cmdline())]
        engine.kill()
        sub.wait(lambda b: sum(AllBlocksCleared() in x.events for x in b) >= 3, timeout=60)  # death, then snapshot
        deadline = time.monotonic() + 60
        while not server.server.front.data_plane_ready:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        prompt = [200 + i for i in range(2 * bs + 1)]
        for _ in range(50):  # the new data plane may still be attaching
            try:
                usage(client, prompt)
                break
            except Exception:
                time.sleep(0.2)
        hashes = chain(prompt, bs)
        sub.wait(lambda b: set(hashes) <= set(sub.stored()))  # recording resumed in the new engine process
        numbers = [b.sequence_number for b in sub.batches]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    finally:
        sub.close()


def test_kv_events_off_is_said_plainly():
    front = InProcessFront(None, kv_events_buffer=0)
    with pytest.raises(KvEventsOff, match="--kv-events on"):
        front.kv_events(0)
