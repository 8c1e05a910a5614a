"""KV cache blocks: allocation, reference counts and the prefix cache.

A full block is identified by a chained xxhash64 of its tokens and the hash of the blocks before it,
so equal prefixes map to equal hashes. A hash hit is trusted only after comparing the stored token
ids and parent hash, so a 64-bit collision can never hand one request another's KV cache.

Freed blocks keep their hash and tokens: until a block is handed out again for other content, a
later request with the same prefix takes it back from the free list (the cache is the free list,
evicted least recently freed first).

While `kv_events` is a list (someone subscribes to KV-cache events: controlplane/kv_events.py), the
index's changes are recorded there: (STORED, parent hash, hashes, token lists) per chain of blocks
that joined it, (REMOVED, hash) per block evicted from it, (CLEARED,) on a flush. None: nothing
is recorded, at the cost of one test per newly hashed or evicted block.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanoplane.controlplane.sequence import Sequence

NO_HASH = -1
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"  # kv_events records' kinds


def chain_hash(token_ids: list[int], parent: int) -> int:
    h = xxhash.xxh64()
    if parent != NO_HASH:
        h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.intdigest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.parent_hash = NO_HASH
        self.token_ids: list[int] = []

    def forget(self) -> None:
        self.hash = NO_HASH
        self.parent_hash = NO_HASH
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"need at least one KV cache block, got {num_blocks}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Least recently freed first. An OrderedDict rather than a deque: reviving a cached block takes
        # it out of the middle, which a deque does in O(free blocks), a large cache's whole free list
        # per prefix hit, and this in O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_cache_hits = 0  # blocks reused from the prefix cache, for tests and metrics
        self.kv_events: list[tuple] | None = None  # the index's changes, while someone subscribes

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests; free blocks that only cache a prefix do not count."""
        return len(self.used_block_ids)

    def _block_hash(self, seq: Sequence, i: int, tokens: list[int], parent: int) -> int:
        """Chain hash of seq's full block i (tokens), remembered on seq once its tokens are all known."""
        if i < len(seq.block_hashes):
            return seq.block_hashes[i]
        h = chain_hash(tokens, parent)
        if i == len(seq.block_hashes) and (i + 1) * self.block_size <= seq.num_known_tokens:
            seq.block_hashes.append(h)
        return h

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding a verified prefix of seq, leaving at least one token to compute."""
        hits: list[int] = []
        parent = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i)
            h = self._block_hash(seq, i, tokens, parent)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.hash != h or block.parent_hash != parent or block.token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence) -> int:
        """Number of prefix blocks seq can reuse, or -1 if its blocks do not fit now."""
        hits = self._cached_prefix(seq)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return len(hits) if seq.num_blocks - in_use <= self.num_free_blocks else -1

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Give seq a block table covering all its tokens, its first blocks from the prefix cache."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)[:num_cached_blocks]
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        self.num_cache_hits += len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            if self.kv_events is not None:
                self.kv_events.append((REMOVED, block.hash))
        block.forget()
        block.ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go back first so that, evicted first, they leave the shared head cached longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_sent_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int]:
        """Give child, another sample of parent's prompt (parent's prompt computed), parent's blocks
        before the one holding the last prompt token by reference, and a fresh block that the data
        plane fills with a copy of that one; child then computes only its last prompt token.
        Returns the copy's (source, destination) block ids. Needs one free block (num_free_blocks)."""
        assert not child.block_table and parent.num_computed_tokens >= child.num_prompt_tokens
        last = (child.num_prompt_tokens - 1) // self.block_size
        shared = parent.block_table[:last]
        for block_id in shared:
            self.blocks[block_id].ref_count += 1
        copy = self._take_free_block()
        child.block_table = shared + [copy]
        # The shared blocks hold prompt tokens only, so parent's hashes of them are child's too.
        child.block_hashes = parent.block_hashes[:last]
        # Hashed again from the first block once child's step is back: parent may end before its own
        # result publishes them, and a chain must never start mid-sequence.
        child.num_hashed_blocks = 0
        child.num_computed_tokens = child.num_prompt_tokens - 1
        return parent.block_table[last], copy

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table covers num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens tokens (a decode step adds at most one block)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_free_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that the last step filled, so later requests can share them."""
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else NO_HASH
        # Only blocks whose tokens are all known: a pending token's value is still in flight.
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        events, hashes = self.kv_events, None
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            tokens = seq.block(i)
            h = self._block_hash(seq, i, tokens, parent)
            block.hash, block.parent_hash, block.token_ids = h, parent, tokens
            # Only a hash new to the index is news: a re-hashed shared block or a duplicate's is known.
            if events is not None and h not in self.hash_to_block_id:
                if not hashes or hashes[-1] != parent:  # not the previous block's child: a new chain
                    hashes, token_lists = [], []
                    events.append((STORED, parent, hashes, token_lists))
                hashes.append(h)
                token_lists.append(tokens)
            self.hash_to_block_id[h] = block.block_id
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def flush(self) -> int:
        """Drop every cached-but-free block from the prefix cache (FlushCache); returns how many. Blocks
        that running requests hold stay, cached: recorded as CLEARED, then STORED for each of them."""
        dropped = 0
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                dropped += 1
            block.forget()
        if self.kv_events is not None:
            self.kv_events.extend(self.cached_records())
        return dropped

    def cached_records(self) -> list[tuple]:
        """A subscriber's starting state as kv_events records: CLEARED, then one STORED per indexed
        block, parents before children."""
        children: dict[int, list[Block]] = {}
        roots: list[Block] = []
        for block_id in self.hash_to_block_id.values():
            block = self.blocks[block_id]
            if block.parent_hash in self.hash_to_block_id:
                children.setdefault(block.parent_hash, []).append(block)
            else:
                roots.append(block)
        records: list[tuple] = [(CLEARED,)]
        order = roots
        while order:
            records.extend((STORED, b.parent_hash, [b.hash], [b.token_ids]) for b in order)
            order = [c for b in order for c in children.get(b.hash, ())]
        return records
