"""Block manager properties under random workloads (hypothesis), and the prefix cache's rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoplane.controlplane.block_manager import NO_HASH, BlockManager, chain_hash
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.controlplane.sequence import Sequence

BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=4)


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, PARAMS, BS)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    total = len(bm.blocks)
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == total
    assert not set(bm.free_block_ids) & bm.used_block_ids
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    refs = {}
    for s in live:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)
    for h, b in bm.hash_to_block_id.items():
        assert bm.blocks[b].hash == h
    for s in live:  # the hashes a sequence remembers are those of its blocks' current tokens
        parent = NO_HASH
        for i, h in enumerate(s.block_hashes):
            assert h == chain_hash(s.block(i), parent)
            parent = h


# A workload: each op admits a prompt built from a few shared prefixes, grows, or frees a request.
ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 3), st.integers(1, 70)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24))
def test_random_workload_keeps_counts_consistent(ops, num_blocks):
    bm = BlockManager(num_blocks, BS)
    prefixes = [[p * 1000 + i for i in range(64)] for p in range(4)]
    live: list[Sequence] = []
    for op, which, n in ops:
        if op == "add":
            s = seq_of(prefixes[which][: min(n, 64)] + [7] * max(0, n - 64))
            cached = bm.can_allocate(s)
            if cached >= 0:
                bm.allocate(s, cached)
                assert len(s.block_table) == s.num_blocks
                assert s.num_computed_tokens == cached * BS < s.num_tokens
                # Pretend the prompt was computed, as the scheduler's postprocess does.
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
        check_invariants(bm, live)
        assert len(bm.used_block_ids) <= num_blocks
    for s in live:
        bm.deallocate(s)
    check_invariants(bm, [])
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks


def test_cached_prefix_is_reused_and_verified():
    bm = BlockManager(10, BS)
    a = seq_of(list(range(40)))
    bm.allocate(a, bm.can_allocate(a))
    a.num_computed_tokens = 40
    bm.hash_blocks(a)
    b = seq_of(list(range(33)) + [999])
    assert bm.can_allocate(b) == 2  # two full blocks shared
    bm.allocate(b, 2)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # Freed blocks stay cached: a third request takes them back from the free list.
    bm.deallocate(a)
    bm.deallocate(b)
    c = seq_of(list(range(40)))
    assert bm.can_allocate(c) == 2
    # A hash that maps to a block with other tokens (a collision) is not trusted.
    bm2 = BlockManager(4, BS)
    d = seq_of(list(range(20)))
    bm2.allocate(d, 0)
    d.num_computed_tokens = 20
    bm2.hash_blocks(d)
    bm2.blocks[d.block_table[0]].token_ids = [1] * BS
    assert bm2.can_allocate(seq_of(list(range(20)))) == 0


def test_never_caches_the_whole_prompt():
    # At least one token must be computed to get logits, so a prompt that is all cached blocks
    # still leaves its last block to compute.
    bm = BlockManager(8, BS)
    a = seq_of(list(range(32)))
    bm.allocate(a, 0)
    a.num_computed_tokens = 32
    bm.hash_blocks(a)
    assert bm.can_allocate(seq_of(list(range(32)))) == 1


def test_freed_blocks_evict_the_tail_of_a_cached_prefix_first():
    bm = BlockManager(5, BS)
    a = seq_of(list(range(49)))  # three full blocks and one partial
    bm.allocate(a, 0)
    a.num_computed_tokens = 49
    bm.hash_blocks(a)
    bm.deallocate(a)
    same = seq_of(list(range(49)))
    assert bm.can_allocate(same) == 3
    fresh = seq_of([500] * 40)
    bm.allocate(fresh, 0)  # three fresh blocks: the spare, the partial, then block 2
    bm.deallocate(fresh)
    assert bm.can_allocate(same) == 2
    assert bm.num_cache_hits == 0


def test_chain_hash_depends_on_prefix():
    assert chain_hash([1, 2], -1) != chain_hash([1, 2], chain_hash([0], -1))
    assert chain_hash([1, 2], 5) == chain_hash([1, 2], 5)
