"""The scheduler's bookkeeping at scale (CPU; any machine): two costs that grew with the cache or the queue.

    python benchmarks/bookkeeping.py

1. A request whose long prefix is in the prefix cache: a shared 2,048-token system prompt plus 64
   tokens of its own, admitted (its cached prefix blocks revived from the free list), its blocks
   hashed as after its prefill, then freed. At the GPU's cache size in 256-token blocks and at a
   CPU-sized block of 16 tokens (the same 1.1M tokens in 70,688 blocks).
2. A client that drops its queued requests: 10,000 and 50,000 waiting requests aborted, newest first.
"""

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.block_manager import BlockManager  # noqa: E402
from controlplane.sampling_params import SamplingParams  # noqa: E402
from controlplane.scheduler import Scheduler  # noqa: E402
from controlplane.sequence import FinishReason, Sequence  # noqa: E402


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


if __name__ == "__main__":
    main()
