"""nano-vllm's throughput bench on nanoplane's embedded engine.

256 requests, random.seed(0), prompt lengths randint(100, 1024) of ids randint(0, 10000), then
max_tokens randint(100, 1024) per request, temperature 0.6, ignore_eos — on random bf16 weights of the
Qwen3-0.6B architecture (generated once into --model-dir). Prints output tokens/s beside the card's
floor (design.md: ~36,400 tok/s on one H200 for this workload).

    python benchmarks/throughput.py [--model-dir /tmp/qwen3-0.6b-random] [--enforce-eager]
    python benchmarks/throughput.py --mode service   # nanoplane serve + one gRPC client process, 256 streams
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                 intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_theta=1000000.0, hidden_act="silu", torch_dtype="bfloat16", eos_token_id=0)
FLOOR_TOK_S = 36_400  # design.md: bytes this workload must move, over the H200's 4.24 TB/s


def make_random_model(path: Path) -> None:
    """Random weights in the Qwen3-0.6B shapes; a tokenizer from the tests' generator."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import make_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in QWEN3_06B.items() if k != "architectures"}))
    state = {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(QWEN3_06B))


def workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def instrument(llm) -> dict[str, list[float]]:
    """Wrap the engine step and the data plane so that each step's time splits into host and device."""
    engine, runner = llm.engine, llm.engine.data_plane.runner
    timings: dict[str, list[float]] = {"step": [], "execute": [], "run": [], "rows": []}
    step, execute, run = engine.step, engine.data_plane.execute, runner._run

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            timings[name].append(time.perf_counter() - t)
            return out
        return wrapper

    import torch

    activity = torch.profiler.ProfilerActivity
    # Three windows: prefill (steps 2-3), decode at a full batch (300-309), and the small-batch tail
    # (the first ten steps with at most 8 rows).
    windows = {"prefill": (2, 4), "decode, full batch": (300, 310)}
    state: dict = {"prof": None, "name": "", "end": -1}

    def step_with_rows():
        n = len(timings["step"])
        rows = timings["rows"][-1] if timings["rows"] else 0
        if state["prof"] is None and "tail" not in windows and 0 < rows <= 8:
            windows["tail"] = (n, n + 10)
        for name, (lo, hi) in windows.items():
            if n == lo and state["prof"] is None:
                state.update(prof=torch.profiler.profile(activities=[activity.CPU, activity.CUDA]), name=name, end=hi)
                state["prof"].start()
        out = timed("step", step)()
        timings["rows"].append(len(out.rows))
        if state["prof"] is not None and n + 1 == state["end"]:
            prof, state["prof"] = state["prof"], None
            torch.cuda.synchronize()
            prof.stop()
            lo, hi = windows[state["name"]]
            events = prof.key_averages()
            gpu_us = sum(e.self_device_time_total for e in events)
            print(f"\n== {state['name']}: steps {lo}-{hi - 1}, GPU busy {gpu_us / (hi - lo) / 1e3:.2f} ms/step ==")
            print(events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
        return out

    engine.step = step_with_rows
    engine.data_plane.execute = timed("execute", execute)
    runner._run = timed("run", run)
    return timings


def report(t: dict[str, list[float]], elapsed: float) -> None:
    step, execute, run = sum(t["step"]), sum(t["execute"]), sum(t["run"])
    n = len(t["step"])
    print(f"steps {n}: total {elapsed:.2f} s; engine.step {step:.2f} s; control plane outside execute "
          f"{step - execute:.2f} s ({(step - execute) / n * 1e3:.2f} ms/step); data plane apply "
          f"{execute - run:.2f} s; data plane run (prep + forward + sample + sync) {run:.2f} s "
          f"({run / n * 1e3:.2f} ms/step)")
    for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256)):
        rows = [(s, r) for s, r in zip(t["run"], t["rows"], strict=False) if lo <= r <= hi]
        if rows:
            mean_ms = sum(s for s, _ in rows) / len(rows) * 1e3
            print(f"  batch {lo:>3}-{hi:<3}: {len(rows):>5} steps, run {mean_ms:.2f} ms/step")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="/tmp/nanoplane-qwen3-0.6b-random")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="print where each step's time goes")
    p.add_argument("--mode", choices=["embedded", "service"], default="embedded")
    args = p.parse_args()
    path = Path(args.model_dir)
    if not (path / "model.safetensors").is_file():
        make_random_model(path)
    if args.mode == "service":
        return run_service(path, args)

    from controlplane import LLM, SamplingParams

    llm = LLM(str(path), enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              max_model_len=4096)
    prompts, max_tokens = workload(args.num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    timings = instrument(llm) if args.profile else None
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    if timings is not None:
        report(timings, elapsed)
    total = sum(max_tokens)
    runner = llm.engine.data_plane.runner
    import resource

    import torch

    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kv_tokens = runner.num_kv_blocks * runner.block_size
    print("| mode | output tokens | time (s) | tok/s | floor tok/s | ratio | KV capacity (tokens) "
          "| peak GPU GiB | peak RSS GiB |")
    print(f"| embedded | {total} | {elapsed:.2f} | {total / elapsed:,.0f} | {FLOOR_TOK_S:,} | "
          f"{total / elapsed / FLOOR_TOK_S:.1%} | {kv_tokens:,} | {peak_gpu:.1f} | {rss:.1f} |")
    llm.close()


def run_service(path: Path, args: argparse.Namespace) -> None:
    """The same workload through `nanoplane serve`: one client process drives all 256 streams."""
    import asyncio

    import psutil
    from tqdm.auto import tqdm

    from clients.client import AsyncClient, Client
    from controlplane.cli import serve_in_background

    flags = ["--model", str(path), "--max-model-len", "4096", "--attention-backend", args.attention_backend]
    with serve_in_background(flags + (["--enforce-eager"] if args.enforce_eager else []), 600) as (address, server):
        with Client(address) as client:
            client.generate_text([1, 2, 3], max_tokens=4)  # warm-up
        prompts, max_tokens = workload(args.num_seqs)

        async def drive() -> tuple[int, float]:
            client = AsyncClient(address)
            bar = tqdm(total=len(prompts), desc="Streams", dynamic_ncols=True)
            counts = []

            async def one(prompt: list[int], n: int) -> None:
                got = 0
                async for chunk in client.generate(prompt, temperature=0.6, max_tokens=n, ignore_eos=True):
                    got += len(chunk.token_ids)
                counts.append(got)
                bar.update(1)

            t = time.perf_counter()
            await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens, strict=True)))
            elapsed = time.perf_counter() - t
            bar.close()
            await client.close()
            return sum(counts), elapsed

        total, elapsed = asyncio.run(drive())
        procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        rss = {p.pid: p.memory_info().rss / 2**30 for p in procs}
        print("| mode | output tokens | time (s) | tok/s | floor tok/s | ratio | RSS GiB per process (serve first) |")
        print(f"| service | {total} | {elapsed:.2f} | {total / elapsed:,.0f} | {FLOOR_TOK_S:,} | "
              f"{total / elapsed / FLOOR_TOK_S:.1%} | {', '.join(f'{v:.1f}' for v in rss.values())} |")

if __name__ == "__main__":
    main()
