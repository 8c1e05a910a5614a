"""The scheduler's bookkeeping at scale (CPU; any machine): two costs that grew with the cache or the queue.

    python benchmarks/bookkeeping.py

1. A request whose long prefix is in the prefix cache: a shared 2,048-token system prompt plus 64
   tokens of its own, admitted (its cached prefix blocks revived from the free list), its blocks
   hashed as after its prefill, then freed. At the GPU's cache size in 256-token blocks and at a
   CPU-sized block of 16 tokens (the same 1.1M tokens in 70,688 blocks).
2. A client that drops its queued requests: 10,000 and 50,000 waiting requests aborted, newest first.
3. A long request preempted under KV pressure waits at the head of the queue with its blocks cached
   on the free list: the scheduler looks its prefix up again every step while another request runs.
"""

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.block_manager import BlockManager  # noqa: E402
from controlplane.sampling_params import SamplingParams  # noqa: E402
from controlplane.scheduler import Scheduler  # noqa: E402
from controlplane.sequence import FinishReason, Sequence, SequenceStatus  # noqa: E402


def per_request_ms(num_blocks: int, block_size: int, requests: int = 50) -> tuple[float, int]:
    bm = BlockManager(num_blocks, block_size)
    rng = random.Random(0)
    system = [rng.randint(0, 30000) for _ in range(2048)]

    def serve_one() -> int:
        seq = Sequence(system + [rng.randint(0, 30000) for _ in range(64)], SamplingParams(), block_size)
        hits = bm.can_allocate(seq)
        bm.allocate(seq, hits)
        seq.num_computed_tokens = seq.num_tokens
        bm.hash_blocks(seq)
        bm.deallocate(seq)  # the prompt's blocks stay cached on the free list
        return hits

    serve_one()
    start = time.perf_counter()
    for _ in range(requests):
        hits = serve_one()
    return (time.perf_counter() - start) / requests * 1e3, hits


def abort_all_s(waiting: int) -> float:
    """Seconds to abort `waiting` queued requests, newest first."""
    scheduler = Scheduler(4418, 256, 512, 16384)
    seqs = [Sequence([1] * 100, SamplingParams(), 256) for _ in range(waiting)]
    for seq in seqs:
        scheduler.add(seq)
    start = time.perf_counter()
    for seq in reversed(seqs):
        scheduler.finish(seq, FinishReason.ABORT)
    assert not scheduler.waiting
    return time.perf_counter() - start


def blocked_head_step_ms(prompt_tokens: int, block_size: int, steps: int = 50) -> float:
    """ms a schedule() step while a preempted `prompt_tokens`-token request waits for blocks."""
    rng = random.Random(0)
    spare = 64
    scheduler = Scheduler(-(-prompt_tokens // block_size) + spare, block_size, 256, 1 << 30)
    head = Sequence([rng.randrange(30000) for _ in range(prompt_tokens)], SamplingParams(max_tokens=10**6),
                    block_size)
    scheduler.add(head)
    out = scheduler.schedule()
    scheduler.advance(out)
    scheduler.postprocess(out, [1])  # prefilled and hashed
    scheduler.running.remove(head)
    scheduler.preempt(head)  # its blocks go back to the free list, still cached
    # Another request takes more blocks than the head could get back while it runs.
    other = Sequence([1] * (block_size * (spare + 1) - 4), SamplingParams(max_tokens=10**6), block_size)
    scheduler.block_manager.allocate(other, 0)
    other.num_computed_tokens, other.slot, other.status = other.num_tokens, scheduler.free_slots.pop(), \
        SequenceStatus.RUNNING
    scheduler.running.append(other)
    start = time.perf_counter()
    for _ in range(steps):
        assert scheduler.schedule().seqs == [other]
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    print("| blocks | block size | ms a request | cached blocks revived |")
    print("| --- | --- | --- | --- |")
    for num_blocks, block_size in ((4418, 256), (70_688, 16)):
        ms, hits = per_request_ms(num_blocks, block_size)
        print(f"| {num_blocks:,} | {block_size} | {ms:.2f} | {hits} |")
    print()
    print("| waiting requests | seconds to abort them all |")
    print("| --- | --- |")
    for waiting in (10_000, 50_000):
        print(f"| {waiting:,} | {abort_all_s(waiting):.2f} |")
    print()
    print("| preempted request at the head | block size | ms a schedule() step |")
    print("| --- | --- | --- |")
    for block_size in (16, 256):
        for prompt_tokens in (8192, 32768, 131072):
            ms = blocked_head_step_ms(prompt_tokens, block_size)
            print(f"| {prompt_tokens:,} tokens | {block_size} | {ms:.3f} |")


if __name__ == "__main__":
    main()
