"""KV-cache events from a real BlockManager: what is stored, evicted and cleared, a subscriber's mirror
of the prefix cache staying equal to it, and the serving side's numbering, replay buffer and resume."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoplane.controlplane.block_manager import BlockManager, chain_hash
from nanoplane.controlplane.kv_events import KvEventLog, KvEventTap, to_events
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import Sequence
from nanoplane.proto import engine_link as link
from nanoplane.proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, signed64

BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=4)


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A request admitted with what the cache holds of it, its prompt then computed and hashed."""
    seq = Sequence(tokens, PARAMS, BS)
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_computed_tokens = seq.num_tokens
    bm.hash_blocks(seq)
    return seq


def drain(bm: BlockManager) -> list:
    events = to_events(bm.kv_events, BS)
    bm.kv_events = []
    return events


class Mirror:
    """What a subscriber knows of the cache, from the events alone: hash -> (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.blocks, "removed a block never stored"
                    del self.blocks[h]
            else:
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    assert h not in self.blocks, "stored a block twice"
                    self.blocks[h] = (parent, e.token_ids[i * e.block_size:(i + 1) * e.block_size])
                    parent = h

    def check(self, bm: BlockManager) -> None:
        want = {}
        for h, block_id in bm.hash_to_block_id.items():
            block = bm.blocks[block_id]
            want[signed64(h)] = (None if block.parent_hash == -1 else signed64(block.parent_hash), block.token_ids)
        assert self.blocks == want


def test_stored_blocks_carry_the_prefix_caches_chain_hashes():
    bm = BlockManager(10, BS)
    bm.kv_events = []
    prompt = list(range(40))  # two full blocks and a partial one
    computed(bm, prompt)
    [stored] = drain(bm)
    h0 = chain_hash(prompt[:16], -1)
    h1 = chain_hash(prompt[16:32], h0)
    assert stored == BlockStored([signed64(h0), signed64(h1)], None, prompt[:32], BS)
    # A second request sharing the first block stores only its own, under the shared parent.
    other = prompt[:16] + [900 + i for i in range(20)]
    second = computed(bm, other)
    assert second.num_computed_tokens == 36 and bm.num_cache_hits == 1
    [stored] = drain(bm)
    assert stored == BlockStored([signed64(chain_hash(other[16:32], h0))], signed64(h0), other[16:32], BS)
    # A hash beyond 2**63 travels as the protocol's negative int64, the same bits.
    assert signed64(2**64 - 1) == -1 and signed64(5) == 5


def test_evicting_a_cached_block_removes_it_and_flush_clears_all():
    bm = BlockManager(4, BS)
    bm.kv_events = []
    a = computed(bm, list(range(33)))  # 3 blocks: two full ones cached
    bm.deallocate(a)
    drain(bm)
    held = computed(bm, [500 + i for i in range(49)])  # all four: the spare, then the freed tail to head
    events = drain(bm)
    assert isinstance(events[0], BlockRemoved) and len(events[0].block_hashes) == 2  # one event for both
    assert set(events[0].block_hashes) == {signed64(chain_hash(list(range(16)), -1)),
                                                   signed64(chain_hash(list(range(16, 32)),
                                                                       chain_hash(list(range(16)), -1)))}
    assert isinstance(events[1], BlockStored)
    # Flush while a request runs: it keeps its blocks, still cached (re-announced after the clear).
    assert bm.flush() == 0
    events = drain(bm)
    assert events[0] == AllBlocksCleared() and sum(len(e.block_hashes) for e in events[1:]) == 3
    assert bm.num_used_blocks == 4 and len(bm._cached_prefix(Sequence([500 + i for i in range(49)], PARAMS, BS))) == 3
    bm.deallocate(held)
    assert bm.flush() == 3 and drain(bm) == [AllBlocksCleared()]  # free now: all of them go
    assert bm.can_allocate(Sequence([500 + i for i in range(49)], PARAMS, BS)) == 0
    assert bm.num_free_blocks == 4


def test_nothing_is_recorded_while_nobody_subscribes():
    bm = BlockManager(4, BS)
    a = computed(bm, list(range(33)))
    bm.deallocate(a)
    computed(bm, [7] * 40)
    bm.flush()
    assert bm.kv_events is None


def test_a_fork_re_hashing_shared_blocks_stores_nothing_twice():
    bm = BlockManager(12, BS)
    bm.kv_events = []
    mirror = Mirror()
    parent = computed(bm, list(range(40)))
    child = Sequence(list(range(40)), PARAMS, BS)
    bm.fork(parent, child)
    child.num_computed_tokens = child.num_tokens
    bm.hash_blocks(child)  # hashed again from block 0: the shared blocks' hashes are known already
    mirror.apply(drain(bm))
    mirror.check(bm)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "flush", "snapshot"]), st.integers(0, 3),
                              st.integers(1, 70)), min_size=1, max_size=50),
       num_blocks=st.integers(1, 20))
def test_a_subscribers_mirror_equals_the_prefix_cache(ops, num_blocks):
    bm = BlockManager(num_blocks, BS)
    bm.kv_events = []
    mirror = Mirror()
    prefixes = [[p * 1000 + i for i in range(64)] for p in range(4)]
    live: list[Sequence] = []
    for op, which, n in ops:
        if op == "add":
            s = Sequence(prefixes[which][:min(n, 64)] + [7] * max(0, n - 64), PARAMS, BS)
            cached = bm.can_allocate(s)
            if cached >= 0:
                bm.allocate(s, cached)
                s.num_computed_tokens = s.num_tokens
                bm.hash_blocks(s)
                live.append(s)
        elif op == "grow" and live:
            s = live[which % len(live)]
            for _ in range(n % 20):
                if not bm.can_append(s, s.num_tokens + 1):
                    break
                s.token_ids.append(5)
                bm.may_append(s, s.num_tokens)
                s.num_computed_tokens = s.num_tokens
                bm.hash_blocks(s)
        elif op == "free" and live:
            bm.deallocate(live.pop(which % len(live)))
        elif op == "flush":
            bm.flush()
        elif op == "snapshot":  # a new subscriber's starting state: replaces the mirror whole
            drain(bm)
            mirror = Mirror()
            bm.kv_events = bm.cached_records()
        mirror.apply(drain(bm))
        mirror.check(bm)


def test_the_tap_starts_with_a_snapshot_and_clears_for_a_new_manager():
    published: list[tuple[list, bool]] = []
    tap = KvEventTap(lambda ts, events, snapshot: published.append((events, snapshot)))
    bm = BlockManager(8, BS)
    computed(bm, list(range(40)))  # cached before anyone listened
    tap.follow(bm)
    tap.drain()
    assert published == [] and bm.kv_events is None
    tap.record(True)
    [(events, snapshot)] = published
    assert snapshot and events[0] == AllBlocksCleared() and len(events) == 3
    assert events[2].parent_block_hash == events[1].block_hashes[0]  # parents first
    computed(bm, [3] * 20)
    tap.drain()
    assert isinstance(published[-1][0][0], BlockStored) and not published[-1][1]
    tap.follow(BlockManager(8, BS))  # a new data plane: a new, empty cache
    tap.drain()
    assert published[-1] == ([AllBlocksCleared()], False)
    tap.record(False)
    assert tap.recording is False
    tap.drain()
    assert len(published) == 3


class FakeEngine:
    """Answers KvEventLog's record(True) with a snapshot batch, as the engine thread does."""

    def __init__(self) -> None:
        self.log: KvEventLog | None = None
        self.calls: list[bool] = []

    def record(self, on: bool) -> None:
        self.calls.append(on)
        if on:
            asyncio.get_running_loop().call_soon(self.log.publish, 0.0, [AllBlocksCleared()], True)


def removed(i: int) -> list:
    return [BlockRemoved([i])]


async def take(it, n: int) -> list[KvEventBatch]:
    return [await asyncio.wait_for(anext(it), 1.0) for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_log_numbers_replays_and_snapshots():
    async def body():
        engine = FakeEngine()
        log = engine.log = KvEventLog(4, engine.record)
        first = log.subscribe(0)
        [snap] = await take(first, 1)  # a fresh subscriber's state comes first
        assert snap.sequence_number == 1 and snap.events == [AllBlocksCleared()] and engine.calls == [True]
        for i in range(3):
            log.publish(float(i), removed(i))
        assert [b.sequence_number for b in await take(first, 3)] == [2, 3, 4]
        # Resume inside the buffer: replayed from that number, then live; no snapshot asked.
        resumed = log.subscribe(3)
        assert [b.sequence_number for b in await take(resumed, 2)] == [3, 4]
        assert engine.calls == [True]
        log.publish(9.0, removed(9))
        assert (await take(resumed, 1))[0].events == removed(9)
        assert (await take(first, 1))[0].sequence_number == 5
        await resumed.aclose()
        # Older than the buffer (2..5 now): told by a snapshot, which every subscriber sees.
        old = log.subscribe(1)
        [snap] = await take(old, 1)
        assert snap.sequence_number == 6 and snap.events[0] == AllBlocksCleared() and engine.calls == [True, True]
        assert (await take(first, 1))[0].sequence_number == 6
        # A number from the future (a serving process that restarted) resynchronises too.
        ahead = log.subscribe(100)
        assert (await take(ahead, 1))[0].sequence_number == 7
        await ahead.aclose()
        await old.aclose()
        await first.aclose()
        assert engine.calls[-1] is False and not log.recording  # the last one out stops the recording
    run(body())


def test_a_subscriber_that_falls_behind_the_buffer_gets_a_snapshot():
    async def body():
        engine = FakeEngine()
        log = engine.log = KvEventLog(3, engine.record)
        slow = log.subscribe(0)
        await take(slow, 1)
        for i in range(5):  # more than the buffer while it does not read
            log.publish(float(i), removed(i))
        [snap] = await take(slow, 1)
        assert snap.events == [AllBlocksCleared()] and snap.sequence_number == 7
        log.publish_cleared()  # an engine process died: its cache with it
        assert (await take(slow, 1))[0].events == [AllBlocksCleared()]
        await slow.aclose()
    run(body())


def test_the_link_carries_kv_events():
    batch = link.KvEvents(1.5, [BlockStored([-3, 4], None, list(range(32)), 16), BlockRemoved([7]),
                                AllBlocksCleared()], True)
    assert link.decode_event(link.encode(batch)) == batch
    assert link.decode_command(link.encode(link.RecordKvEvents(True))) == link.RecordKvEvents(True)
