"""nano-vllm's throughput bench on nanoplane's embedded engine.

256 requests, random.seed(0), prompt lengths randint(100, 1024) of ids randint(0, 10000), then
max_tokens randint(100, 1024) per request, temperature 0.6, ignore_eos — on random bf16 weights of the
Qwen3-0.6B architecture (generated once into --model-dir), or Qwen3-8B's for the tensor-parallel run.
Prints output tokens/s beside the card's floor (docs/design.md: ~36,400 tok/s on one H200 for 0.6B;
~18,700-22,800 on two H200s for 8B at TP=2, all-reduce included).

    python -m benchmarks.throughput [--model-dir /tmp/qwen3-0.6b-random] [--enforce-eager] [--profile]
    python -m benchmarks.throughput --mode service   # nanoplane serve + one gRPC client process, 256 streams
    python -m benchmarks.throughput --shape 8b --tensor-parallel-size 2   # two GPUs
    python -m benchmarks.throughput --n 4   # the first 64 prompts, 4 samples each: KV blocks at the peak
    python -m benchmarks.throughput --json-schema   # every request under a 10-field object schema
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

from benchmarks.step_table import (
    allocator_counts,
    instrument,
    pace,
    report,
    report_allocator,
    report_gc,
    report_pace,
    watch_gc,
)

QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_theta=1000000.0, hidden_act="silu", torch_dtype="bfloat16", eos_token_id=0)
QWEN3_8B = dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                tie_word_embeddings=False)
SHAPES = {"0.6b": QWEN3_06B, "8b": QWEN3_8B}
# docs/design.md: the bytes this workload must move over the H200's 4.24 TB/s; for 8B on two cards the
# upper end of the range (the lower one charges the all-reduces too), so the ratio is not flattered.
FLOORS = {("0.6b", 1): 36_400, ("8b", 2): 22_800}


# --json-schema: every request's output is this object (structured output, controlplane/structured.py).
# Strings are unbounded so that random weights, which pick near-uniformly among the allowed tokens,
# still write outputs of a few hundred tokens; a grammar that completes ends its request early.
JSON_SCHEMA_10 = {"type": "object", "additionalProperties": False,
                  "required": ["name", "age", "email", "city", "score", "active", "tags", "level", "id", "note"],
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                                 "city": {"type": "string"}, "score": {"type": "number"},
                                 "active": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
                                 "level": {"enum": ["low", "mid", "high"]}, "id": {"type": "integer"},
                                 "note": {"type": "string"}}}


def floor_cells(shape: str, tp: int, tok_s: float) -> str:
    floor = FLOORS.get((shape, tp))
    return f"{floor:,} | {tok_s / floor:.1%}" if floor else "n/a | n/a"


def make_random_model(path: Path, shape: str = "0.6b") -> None:
    """Random bf16 weights in Qwen3-0.6B's (or -8B's) shapes; a tokenizer from the tests' generator."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.support.tiny_models import make_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    config = SHAPES[shape]
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 8B in fp32 would be 32 GB for nothing
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in config.items() if k != "architectures"}))
    finally:
        torch.set_default_dtype(default_dtype)
    tied = config["tie_word_embeddings"]
    state = {k: v.contiguous().cpu() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    del model
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    # The file's dirty pages (16 GB at 8B) would be written back while the run is timed: flush them first.
    t = time.perf_counter()
    os.sync()
    print(f"wrote {path / 'model.safetensors'} and flushed it to disk ({time.perf_counter() - t:.1f} s)", flush=True)


def warmup_workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    """Other prompts (no prefix-cache hits for the timed run) and outputs of 1..num_seqs tokens, one
    request each: once all are admitted the batch shrinks by about one row a step, so (nearly) every
    batch size and prefill shape the timed run meets comes first here, and no kernel is compiled or
    loaded while the clock runs."""
    rng = random.Random(1)
    prompts = [[rng.randint(10001, 20000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = list(range(1, num_seqs + 1))
    rng.shuffle(max_tokens)
    return prompts, max_tokens


def workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def watch_kv_peak(llm) -> list[dict]:
    """Record, at the step holding the most KV blocks, the blocks in use beside what the live samples
    would need with each prompt held once (its full blocks shared by its samples) and held per sample."""
    scheduler = llm.engine.scheduler
    bm, schedule, peak = scheduler.block_manager, scheduler.schedule, [{"used": -1}]

    def tracked():
        out = schedule()
        if bm.num_used_blocks > peak[0]["used"]:
            live = [s for s in list(scheduler.running) + list(scheduler.waiting) if s.block_table]
            groups: dict[int, list] = {}
            for s in live:
                groups.setdefault(s.group[0].seq_id, []).append(s)
            per_sample = sum(len(s.block_table) for s in live)
            # A request's samples share its prompt's full blocks before the one holding its last token.
            repeated = sum((g[0].num_prompt_tokens - 1) // bm.block_size * (len(g) - 1) for g in groups.values())
            peak[0] = {"used": bm.num_used_blocks, "samples": len(live), "requests": len(groups),
                       "once": per_sample - repeated, "per_sample": per_sample}
        return out

    scheduler.schedule = tracked
    return peak


def run_samples(llm, n: int) -> None:
    """The bench's first 64 prompts, n samples each (same sampling as the plain run): output tokens/s
    and the KV blocks in use at the peak against one prompt plus n outputs per prompt."""
    from nanoplane.controlplane import SamplingParams

    prompts, max_tokens = workload()
    prompts, max_tokens = prompts[:64], max_tokens[:64]
    peak = watch_kv_peak(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, n=n)
                                  for m in max_tokens], use_tqdm=True)
    elapsed = time.perf_counter() - t
    total = sum(len(o["token_ids"]) for out in outs for o in out.get("outputs", [out]))
    assert total == n * sum(max_tokens), "every sample runs to max_tokens (ignore_eos)"
    p, s = peak[0], llm.engine.scheduler
    print("| mode | output tokens | time (s) | tok/s | peak KV blocks | prompt once + n outputs | "
          "n prompts + n outputs | live samples (requests) | forks | preemptions |")
    print(f"| embedded n={n}, 64 prompts | {total} | {elapsed:.2f} | {total / elapsed:,.0f} | {p['used']} | "
          f"{p['once']} | {p['per_sample']} | {p['samples']} ({p['requests']}) | {s.num_forks} | "
          f"{s.num_preemptions} |")


def sampling_extras(args: argparse.Namespace) -> dict:
    """The sampling parameters --logprobs, --penalties and --json-schema add to every request (named in the report)."""
    extra: dict = {}
    if args.logprobs is not None:
        extra["logprobs"] = args.logprobs
    if args.penalties:
        extra.update(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    if args.json_schema:
        extra["structured"] = {"json_schema": JSON_SCHEMA_10}
    return extra


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="", help="default: /tmp/nanoplane-qwen3-<shape>-random")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="print where each step's time goes")
    p.add_argument("--mode", choices=["embedded", "service"], default="embedded")
    p.add_argument("--n", type=int, default=1, help="> 1: the first 64 prompts with n samples each, and the KV "
                   "blocks they hold at the peak")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="every request asks the sampled token's logprob and the top N (embedded mode)")
    p.add_argument("--penalties", action="store_true",
                   help="every request has presence 0.5, frequency 0.5 and repetition 1.1 penalties (embedded mode)")
    p.add_argument("--json-schema", action="store_true",
                   help="every request under a 10-field JSON object schema; reports the mask work per step")
    args = p.parse_args()
    if args.mode == "service" and (args.logprobs is not None or args.penalties or args.n > 1 or args.json_schema):
        p.error("--logprobs, --penalties, --n and --json-schema apply to the embedded mode (the service's mask "
                "time is the engine process's)")
    path = Path(args.model_dir or f"/tmp/nanoplane-qwen3-{args.shape}-random")
    if not (path / "model.safetensors").is_file():
        make_random_model(path, args.shape)
    if args.mode == "service":
        return run_service(path, args)

    from nanoplane.controlplane import LLM, SamplingParams

    llm = LLM(str(path), enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              max_model_len=4096, tensor_parallel_size=args.tensor_parallel_size)
    prompts, max_tokens = workload(args.num_seqs)
    extra = sampling_extras(args)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra) for n in max_tokens]
    warm_prompts, warm_tokens = warmup_workload(args.num_seqs)
    llm.generate(warm_prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra)
                                for n in warm_tokens], use_tqdm=False)
    if args.n > 1:
        run_samples(llm, args.n)
        return llm.close()
    engine = llm.engine
    engine.mask_time_s, engine.num_mask_steps, engine.num_mask_rows = 0.0, 0, 0
    timings = instrument(llm) if args.profile else None
    steps = pace(llm) if llm.engine.overlap and not args.profile else None
    pauses = watch_gc()
    allocator = allocator_counts()
    t = time.perf_counter()
    steps_before = engine.step_id
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    report_gc(pauses)
    report_allocator(allocator)
    if timings is not None:
        report(timings, elapsed)
    runner = llm.engine.data_plane.runner
    if steps is not None:
        report_pace(steps(), runner)
    total = sum(len(o["token_ids"]) for o in outs)  # max_tokens each, unless a grammar completed first
    if args.json_schema:
        report_masks(engine, engine.step_id - steps_before, elapsed, outs)
    import resource

    import torch

    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kv_tokens = runner.num_kv_blocks * runner.block_size
    print("| mode | output tokens | time (s) | tok/s | floor tok/s | ratio | KV capacity (tokens) "
          "| peak GPU GiB | peak RSS GiB |")
    tok_s = total / elapsed
    mode = f"embedded {args.shape} TP={args.tensor_parallel_size}" + (" json-schema" if args.json_schema else "")
    mode += "".join(f" {k}={v}" for k, v in extra.items() if k != "structured")
    if args.tensor_parallel_size > 1:  # the all-reduce rank 0 installed, which may be NCCL after a fallback
        from nanoplane.models.layers import parallel

        mode += f" {getattr(parallel._fast_all_reduce, 'name', 'nccl')}"
    print(f"| {mode} | {total} | {elapsed:.2f} | {tok_s:,.0f} | "
          f"{floor_cells(args.shape, args.tensor_parallel_size, tok_s)} | {kv_tokens:,} | {peak_gpu:.1f} | {rss:.1f} |")
    llm.close()


def report_masks(engine, steps: int, elapsed: float, outs: list[dict]) -> None:
    """The control plane's structured-output work: token masks built in Engine.describe, per step."""
    n = max(engine.num_mask_steps, 1)
    done = sum(1 for o in outs if json_complete(o["text"]))
    print(f"structured output: {engine.num_mask_steps} of {steps} steps had masks, "
          f"{engine.num_mask_rows / n:.1f} rows each; mask time {engine.mask_time_s * 1e3 / n:.3f} ms per "
          f"step ({engine.mask_time_s / elapsed:.1%} of the run); {done} of {len(outs)} outputs complete JSON "
          "(the rest reached max_tokens)", flush=True)


def json_complete(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


async def drive_streams(address: str, prompts: list[list[int]], max_tokens: list[int],
                        desc: str) -> tuple[int, int, float]:
    """One client, every prompt as its own concurrent stream (temperature 0.6, ignore_eos): returns
    (output tokens, messages received, seconds)."""
    from tqdm.auto import tqdm

    from nanoplane.clients.client import AsyncClient

    client = AsyncClient(address)
    bar = tqdm(total=len(prompts), desc=desc, dynamic_ncols=True)
    tokens, messages = [], []

    async def one(prompt: list[int], n: int) -> None:
        got = chunks = 0
        async for chunk in client.generate(prompt, temperature=0.6, max_tokens=n, ignore_eos=True):
            got += len(chunk.token_ids)
            chunks += 1
        tokens.append(got)
        messages.append(chunks)
        bar.update(1)

    t = time.perf_counter()
    await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens, strict=True)))
    elapsed = time.perf_counter() - t
    bar.close()
    await client.close()
    return sum(tokens), sum(messages), elapsed


async def one_stream(address: str, prompt_len: int = 512, max_tokens: int = 129) -> tuple[float, float]:
    """One greedy stream alone, as a client sees it: (time to first token, median inter-token time),
    in seconds. A message that carries k tokens counts as k gaps of a k-th of its wait."""
    from nanoplane.clients.client import AsyncClient

    rng = random.Random(0)
    prompt = [rng.randrange(0, 10000) for _ in range(prompt_len)]
    client = AsyncClient(address)
    stamps: list[tuple[float, int]] = []
    start = time.perf_counter()
    async for chunk in client.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True):
        stamps.append((time.perf_counter(), len(chunk.token_ids)))
    await client.close()
    gaps = []
    for (before, _), (at, k) in zip(stamps, stamps[1:], strict=False):
        gaps += [(at - before) / max(k, 1)] * max(k, 1)
    return stamps[0][0] - start, sorted(gaps)[len(gaps) // 2] if gaps else float("nan")


def role(proc, serve_pid: int) -> str:
    """What a process of `nanoplane serve`'s tree is, for the CPU-load line."""
    cmd = " ".join(proc.cmdline())
    if proc.pid == serve_pid:
        return "serve"
    if "nanoplane.dataplane.launcher" in cmd:
        return "launcher"
    if "resource_tracker" in cmd:
        return "resource tracker"
    if "nanoplane.controlplane.engine_process" in cmd:
        return "engine process"
    return "rank" if "spawn_main" in cmd else cmd[-32:]


def run_service(path: Path, args: argparse.Namespace) -> None:
    """The same workload through `nanoplane serve`: one client process drives all 256 streams."""
    import psutil

    from nanoplane.clients.client import Client
    from nanoplane.demo import serve_in_background

    flags = ["--model", str(path), "--max-model-len", "4096", "--attention-backend", args.attention_backend,
             "--tensor-parallel-size", str(args.tensor_parallel_size)]
    with serve_in_background(flags + (["--enforce-eager"] if args.enforce_eager else []), 600) as (address, server):
        with Client(address) as client:
            client.generate_text([1, 2, 3], max_tokens=4)
        prompts, max_tokens = workload(args.num_seqs)
        warm_prompts, warm_tokens = warmup_workload(args.num_seqs)

        asyncio.run(drive_streams(address, warm_prompts, warm_tokens, "Warm-up"))
        procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        # CPU seconds each process spends on the run: a process near one CPU second a second (the
        # client's event loop, the control plane's) is what bounds the run, not the GPU.
        cpu_before = [time.process_time()] + [sum(p.cpu_times()[:2]) for p in procs]
        total, messages, elapsed = asyncio.run(drive_streams(address, prompts, max_tokens, "Streams"))
        cpu_after = [time.process_time()] + [sum(p.cpu_times()[:2]) for p in procs]
        rss = {p.pid: p.memory_info().rss / 2**30 for p in procs}
        print("| mode | output tokens | time (s) | tok/s | floor tok/s | ratio | messages/s (tokens each) "
              "| RSS GiB per process (serve first) |")
        print(f"| service {args.shape} TP={args.tensor_parallel_size} | {total} | {elapsed:.2f} | "
              f"{total / elapsed:,.0f} | {floor_cells(args.shape, args.tensor_parallel_size, total / elapsed)} | "
              f"{messages / elapsed:,.0f} ({total / messages:.2f}) | {', '.join(f'{v:.1f}' for v in rss.values())} |")
        names = ["client"] + [f"{role(p, server.pid)} (pid {p.pid})" for p in procs]
        busy = [(a - b) / elapsed for a, b in zip(cpu_after, cpu_before, strict=True)]
        print("CPU seconds a second during the run (1.0 = one core busy throughout): "
              + ", ".join(f"{name}: {b:.2f}" for name, b in zip(names, busy, strict=True)), flush=True)
        ttft, itl = asyncio.run(one_stream(address))
        print(f"| service, one stream alone (512-token prompt, greedy) | TTFT {ttft * 1e3:.1f} ms | inter-token "
              f"{itl * 1e3:.2f} ms (median, at the client) |")

if __name__ == "__main__":
    main()
