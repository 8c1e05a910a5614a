"""What KV-cache events cost the engine thread: the throughput workload (benchmarks/throughput.py: 256
requests, nano-vllm's prompt and output lengths) through a real Engine (scheduler, block manager)
over a data plane that answers every step at once, with events off and on (a subscriber: the block
manager records, each step's records become proto/kv_events.py events and are encoded for the engine
link as the engine process sends them). Runs alternate off / on to even out the machine's drift; the
time is this process's CPU time (time.process_time), which other processes on the host disturb less
than the wall clock; "publish" is the part spent turning records into events and encoding them.

    python -m benchmarks.kv_events [--block-size 16] [--blocks 16384] [--runs 3]

A small cache (`--blocks`) makes requests evict each other's cached blocks: removals too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.controlplane_ceiling import InstantDataPlane
from benchmarks.throughput import QWEN3_06B, workload
from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.kv_events import KvEventTap
from nanoplane.controlplane.sampling_params import SamplingParams
from nanoplane.proto import engine_link as link


def run(model_dir: str, block_size: int, blocks: int, events: bool) -> tuple[float, int, int, float]:
    """(CPU seconds of Engine.step and the drain in all, steps, events published, CPU seconds publishing)."""
    plane = InstantDataPlane(QWEN3_06B["vocab_size"], 0.0, blocks, block_size)
    plane.close = lambda: None  # quiet
    cfg = EngineConfig(model_dir, device="cpu", kvcache_block_size=block_size, num_kvcache_blocks=blocks,
                       max_num_seqs=256, max_model_len=4096)
    engine = Engine(cfg, plane, (0,))
    sent, publishing = [0], [0.0]

    def publish(timestamp, kv, snapshot) -> None:
        link.encode(link.KvEvents(timestamp, kv, snapshot))
        sent[0] += len(kv)

    tap = KvEventTap(publish)
    drain = tap.drain

    def timed_drain(snapshot: bool = False) -> None:
        started = time.process_time()
        drain(snapshot)
        publishing[0] += time.process_time() - started

    tap.drain = timed_drain
    if events:
        tap.follow(engine.scheduler.block_manager)
        tap.record(True)
    prompts, max_tokens = workload()
    for prompt, n in zip(prompts, max_tokens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True))
    steps, spent = 0, 0.0
    while engine.has_work():
        started = time.process_time()
        engine.step()
        tap.drain()  # what the engine loop does after each step (nothing when not recording)
        spent += time.process_time() - started
        steps += 1
    return spent, steps, sent[0], publishing[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=16384, help="KV cache blocks")
    parser.add_argument("--runs", type=int, default=5, help="off/on pairs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(QWEN3_06B))
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.runs):
            for on in (False, True) if i % 2 == 0 else (True, False):
                spent, steps, sent, publishing = run(tmp, args.block_size, args.blocks, on)
                times[on].append(spent / steps * 1e6)
                print(f"events {'on ' if on else 'off'}: {spent / steps * 1e6:7.1f} us a step over {steps} steps"
                      + (f", {sent} events, publish {publishing / steps * 1e6:.1f} us a step" if on else ""),
                      flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"median of {args.runs}: off {off:.1f} us, on {on:.1f} us a step (+{on - off:.1f} us, "
          f"{(on - off) / off:+.1%})")


if __name__ == "__main__":
    main()
