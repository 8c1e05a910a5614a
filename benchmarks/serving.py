"""Latency under open-loop load, as a client of the service sees it.

One client process (grpc.aio) sends requests at Poisson arrival times, whatever the server does,
through the public API, at each rate of a sweep (doubling up to saturation, unless --rates says
which), for each workload (benchmarks/serving_workloads.py):

- `chat`: prompts lognormal (median 256, sigma 1.0, 16-4096 tokens), outputs lognormal (median 200,
  sigma 0.8, 16-1024), ignore_eos;
- `shared-prefix`: 16 system prompts of 2,000 tokens, each request one of them plus a 100-token user
  turn, 128 output tokens;
- `long`: one 32,000-token prompt every 2 s beside 64 steady decoding streams (their gaps are counted
  from the first long prompt sent to the last one answered).

Per rate: time to first token (TTFT, from the send), inter-token latency (a message of k tokens
counts as k gaps of a k-th of the wait before it), end-to-end latency, the longest wait between two
messages of a request, output tokens/s, goodput (requests/s with TTFT <= 500 ms and no wait between
messages over 50 ms) and the share of prompt tokens served from the prefix cache; then the highest
rate whose p99 TTFT stays under 1 s, and a markdown table per workload, printed last.

    python -m benchmarks.serving                      # every workload; random Qwen3-0.6B weights, one GPU
    python -m benchmarks.serving --workload chat --rates 4,8,16,32 --scheduling-policy mixed
    python -m benchmarks.serving --server 127.0.0.1:50051 --workload shared-prefix
    python -m benchmarks.serving --toy                # a tiny generated model on the CPU, toy sizes
    python -m benchmarks.serving --serve-arg=--max-num-batched-tokens=2048   # any `nanoplane serve` flag
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from benchmarks import serving_workloads as wl
from benchmarks.serving_workloads import WORKLOADS, Request, Shapes
from nanoplane.clients.client import FINISH_REASONS, AsyncClient, build_request

TTFT_SLO_S, GAP_SLO_S = 0.5, 0.05  # goodput counts requests within both
TTFT_LIMIT_S = 1.0  # the highest rate whose p99 TTFT stays under this is reported
# --toy: a 32,000-token prompt becomes 1,000 (a tiny model holds 1,024 positions); few system prompts,
# so that a few requests already meet the prefix cache.
TOY_SHAPES = Shapes(scale=1 / 32, long_streams=4, num_system_prompts=4)


@dataclass(slots=True)
class Record:
    """What the client saw of one request."""

    request: Request
    sent: float = 0.0
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of each message with tokens
    finish: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(k for _, k in self.stamps)

    @property
    def complete(self) -> bool:
        """Ended by its length (ignore_eos) with every token it asked for."""
        return not self.error and self.finish == "length" and self.num_tokens == self.request.max_tokens


async def send(stub, record: Record, temperature: float) -> None:
    req = record.request
    record.sent = time.perf_counter()
    call = stub.Generate(build_request(req.prompt, max_tokens=req.max_tokens, temperature=temperature,
                                       ignore_eos=True))
    try:
        async for r in call:
            if r.token_ids:
                record.stamps.append((time.perf_counter(), len(r.token_ids)))
            if r.HasField("usage"):
                record.prompt_tokens, record.cached_tokens = r.usage.prompt_tokens, r.usage.cached_prompt_tokens
            if r.finish_reason:
                record.finish = FINISH_REASONS.get(r.finish_reason)
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    finally:
        call.cancel()  # a no-op after the last message; a stream stopped early frees its request


async def open_loop(stub, requests: list[Request], temperature: float) -> tuple[list[Record], float]:
    """Send each request at its time from now on; returns the records and the client's worst lag
    behind the schedule (a busy client would understate the load: it is printed)."""
    records = [Record(r) for r in requests]
    start, lag, tasks = time.perf_counter(), 0.0, []
    for record in records:
        delay = start + record.request.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, time.perf_counter() - start - record.request.at)
        tasks.append(asyncio.create_task(send(stub, record, temperature)))
    await asyncio.gather(*tasks)
    return records, lag


async def long_run(stub, sizes: Shapes, args: argparse.Namespace, vocab: int
                   ) -> tuple[list[Record], list[Record], tuple[float, float]]:
    """Steady streams (each sends a new request when its last ends) and the long prompts beside them:
    (streams, long prompts, the window from the first long prompt sent to the last one answered)."""
    stop, streams = asyncio.Event(), []

    async def stream(i: int) -> None:
        rng = wl.rng_for("streams", args.seed, i)
        await asyncio.sleep(i * 0.01)  # not all 64 prompts in one step
        while not stop.is_set():
            streams.append(Record(wl.stream_request(rng, vocab, sizes)))
            await send(stub, streams[-1], args.temperature)

    tasks = [asyncio.create_task(stream(i)) for i in range(sizes.long_streams)]
    longs, _ = await open_loop(stub, wl.long_prompts(args.long_prompts, args.settle, args.seed, vocab, sizes),
                               args.temperature)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    window = (min(r.sent for r in longs), max(r.stamps[-1][0] if r.stamps else r.sent for r in longs))
    return streams, longs, window


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[Record], label: str, rate: float,
              window: tuple[float, float] | None = None) -> dict:
    """One row of figures; with a window, only the gaps that end inside it count."""
    seen = [r for r in records if r.stamps]
    ttft = [r.stamps[0][0] - r.sent for r in seen]
    e2e = [r.stamps[-1][0] - r.sent for r in seen if r.finish]
    itl, worst, good = [], [], 0
    for r, first in zip(seen, ttft, strict=True):
        waits = [(at, at - before, k) for (before, _), (at, k) in zip(r.stamps, r.stamps[1:], strict=False)
                 if window is None or window[0] <= at <= window[1]]
        for _, wait, k in waits:
            itl += [wait / k] * k
        longest = max((wait for _, wait, _ in waits), default=0.0)
        worst.append(longest)
        good += r.complete and first <= TTFT_SLO_S and longest <= GAP_SLO_S
    begin = min((r.sent for r in records), default=0.0)
    elapsed = max((r.stamps[-1][0] for r in seen), default=begin) - begin
    per_s = 1 / elapsed if elapsed > 0 else float("nan")
    return dict(label=label, rate=rate, requests=len(records), completed=sum(r.complete for r in records),
                stopped=sum(not (r.finish or r.error) for r in records),  # steady streams cut at the end
                errors=sorted({r.error for r in records if r.error}),
                output_tokens=sum(r.num_tokens for r in records),
                asked_tokens=sum(r.request.max_tokens for r in records),
                ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
                itl_p50_ms=pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) * 1e3,
                e2e_p50_s=pct(e2e, 50), e2e_p99_s=pct(e2e, 99), max_gap_ms=max(worst, default=0.0) * 1e3,
                output_tok_s=sum(r.num_tokens for r in records) * per_s, goodput=good * per_s,
                prompt_tokens=sum(r.prompt_tokens for r in records),
                cached_prompt_tokens=sum(r.cached_tokens for r in records), elapsed_s=elapsed)


def line(workload: str, row: dict) -> str:
    name = f"{workload} {row['label']}" if row["label"] else workload
    return (f"{name} {row['rate']:g}/s: {row['completed']}/{row['requests']} complete, "
            f"TTFT p50 {row['ttft_p50_ms']:.1f} p99 {row['ttft_p99_ms']:.1f} ms, ITL p50 {row['itl_p50_ms']:.2f} "
            f"p99 {row['itl_p99_ms']:.2f} ms, longest gap {row['max_gap_ms']:.1f} ms, "
            f"{row['output_tok_s']:,.0f} tok/s, goodput {row['goodput']:.2f}/s")


def rates(args: argparse.Namespace) -> Iterator[float]:
    if args.rates:
        yield from (float(r) for r in args.rates.split(","))
        return
    rate = args.start_rate
    while rate <= args.max_rate:
        yield rate
        rate *= 2


async def run_workload(address: str, workload: str, args: argparse.Namespace, sizes: Shapes, vocab: int) -> list[dict]:
    async with AsyncClient(address) as client:
        stub = client.stub
        await open_loop(stub, wl.warmup(workload, args.seed, vocab, sizes), args.temperature)
        if workload == "long":
            streams, longs, window = await long_run(stub, sizes, args, vocab)
            rate = 1 / sizes.long_period_s
            rows = [summarize(streams, f"{sizes.long_streams} streams", rate, window),
                    summarize(longs, "long prompts", rate)]
            for row in rows:
                print(line(workload, row), flush=True)
            return rows
        make = wl.chat if workload == "chat" else wl.shared_prefix
        rows: list[dict] = []
        for rate in rates(args):
            n = args.num_requests or max(32, round(rate * args.duration))
            records, lag = await open_loop(stub, make(rate, n, args.seed, vocab, sizes), args.temperature)
            rows.append(summarize(records, "", rate))
            print(line(workload, rows[-1]) + (f" (the client fell {lag * 1e3:.0f} ms behind its schedule)"
                                               if lag > 0.05 else ""), flush=True)
            # Saturated: more offered load no longer buys output, or the queue grows without bound.
            if not args.rates and len(rows) > 1 and (rows[-1]["output_tok_s"] < 1.1 * rows[-2]["output_tok_s"]
                                                     or rows[-1]["ttft_p99_ms"] > args.ttft_cap * 1e3):
                break
        return rows


def best_rate(rows: list[dict]) -> float | None:
    ok = [row["rate"] for row in rows if row["ttft_p99_ms"] < TTFT_LIMIT_S * 1e3]
    return max(ok) if ok else None


def table(workload: str, rows: list[dict]) -> str:
    out = [f"{workload}:", "", "| rate (req/s) | rows | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (s) "
           "| longest gap (ms) | output tok/s | goodput (req/s) | prompt tokens cached |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cached = r["cached_prompt_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        out.append(f"| {r['rate']:g} | {r['label'] or r['requests']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} "
                   f"| {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['e2e_p50_s']:.2f} / {r['e2e_p99_s']:.2f} "
                   f"| {r['max_gap_ms']:.1f} | {r['output_tok_s']:,.0f} | {r['goodput']:.2f} | {cached:.1%} |")
    if workload != "long":
        best = best_rate(rows)
        out += ["", f"highest rate with p99 TTFT under {TTFT_LIMIT_S:g} s: "
                + (f"{best:g} req/s" if best is not None else "none of those run")]
    return "\n".join(out)


def model_dir(args: argparse.Namespace) -> Path:
    """The model folder, generated the first time: a tiny checkpoint (--toy) or random Qwen3 weights."""
    default = "/tmp/nanoplane-tiny-qwen3" if args.toy else f"/tmp/nanoplane-qwen3-{args.shape}-random"
    path = Path(args.model_dir or default)
    if args.toy and not (path / "config.json").is_file():
        from tests.support.tiny_models import make_tiny_model

        make_tiny_model(path)
    elif not args.toy and not (path / "model.safetensors").is_file():
        from benchmarks.throughput import make_random_model

        make_random_model(path, args.shape)
    return path


@contextmanager
def service(args: argparse.Namespace, max_model_len: int) -> Iterator[str]:
    """The address of --server, or of a `nanoplane serve` started here and stopped on exit."""
    if args.server:
        yield args.server
        return
    from nanoplane.demo import serve_in_background

    flags = ["--model", str(model_dir(args)), "--max-model-len", str(max_model_len)]
    flags += ["--device", "cpu"] if args.toy else []
    flags += ["--scheduling-policy", args.scheduling_policy] if args.scheduling_policy else []
    with serve_in_background(flags + args.serve_arg, args.start_timeout) as (address, _):
        yield address


async def model_facts(address: str) -> tuple[int, int]:
    async with AsyncClient(address) as client:
        info = await client.model_info()
    return info.vocab_size, min(info.max_model_len, info.kv_capacity_tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--server", default="", help="HOST:PORT of a running nanoplane (default: start one here)")
    p.add_argument("--model-dir", default="", help="model folder, generated if missing")
    p.add_argument("--shape", choices=["0.6b", "8b"], default="0.6b", help="random Qwen3 weights of this shape")
    p.add_argument("--toy", action="store_true",
                   help="a tiny generated model on the CPU; lengths x 1/32, 4 streams, 4 system prompts")
    p.add_argument("--scheduling-policy", choices=["prefill-first", "mixed"], default="",
                   help="passed to `nanoplane serve` (default: the server's own)")
    p.add_argument("--serve-arg", action="append", default=[], help="another `nanoplane serve` flag (repeatable)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--rates", default="", help="comma-separated requests/s (default: doubling to saturation)")
    p.add_argument("--start-rate", type=float, default=0.0, help="first rate of the sweep (default 4; toy 1)")
    p.add_argument("--max-rate", type=float, default=0.0, help="last rate the sweep may reach (default 512; toy 4)")
    p.add_argument("--ttft-cap", type=float, default=30.0, help="a p99 TTFT over this (s) ends the sweep")
    p.add_argument("--num-requests", type=int, default=0, help="requests per rate (default: rate x duration, >= 32)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--long-prompts", type=int, default=0, help="long prompts in the long workload (default 5; toy 2)")
    p.add_argument("--settle", type=float, default=0.0, help="seconds the streams run before the first long prompt")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write every row here")
    args = p.parse_args(argv)
    toy = args.toy
    args.start_rate = args.start_rate or (1.0 if toy else 4.0)
    args.max_rate = args.max_rate or (4.0 if toy else 512.0)
    args.long_prompts = args.long_prompts or (2 if toy else 5)
    args.settle = args.settle or (1.0 if toy else 3.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = TOY_SHAPES if args.toy else Shapes()
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    need = sizes.max_model_len(workloads)
    results: dict[str, list[dict]] = {}
    with service(args, need) as address:
        vocab, fits = asyncio.run(model_facts(address))
        if fits < need:
            print(f"the server holds {fits} tokens a request; these workloads need {need}", file=sys.stderr)
            return 2
        for workload in workloads:
            results[workload] = asyncio.run(run_workload(address, workload, args, sizes, vocab))
    if args.json:
        Path(args.json).write_text(json.dumps({"scheduling_policy": args.scheduling_policy or "server default",
                                               "scale": sizes.scale, "workloads": results}, indent=1))
    print(f"\nscheduling policy: {args.scheduling_policy or 'the server default'}; lengths x {sizes.scale:g}")
    for workload, rows in results.items():
        print("\n" + table(workload, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
