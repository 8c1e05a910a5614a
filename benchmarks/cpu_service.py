"""The default model served on the CPU through gRPC, beside HuggingFace transformers' `generate`, in one run.

For people without a GPU: `nanoplane serve --device cpu` on the embedded SmolLM2-135M-Instruct (float32),
driven through the Python client, against transformers on the same chat-templated prompts and the same
number of torch threads. Workloads, each 64 greedy output tokens per stream with `ignore_eos`:

    (a) one chat stream            nanoplane: one gRPC stream;  transformers: generate on one prompt
    (b) 16 concurrent chat streams nanoplane: 16 gRPC streams;  transformers: one left-padded batch of 16

Reports output tokens/s (all output tokens / wall time), single-stream ms per output token and TTFT,
and whether the single stream's greedy tokens are equal on both sides (float32 on the CPU: they
should be, token for token). The issue's target, measured on a 2-core machine: transformers made
20 tok/s on one stream and 137 tok/s on a padded batch of 16; nanoplane should reach at least twice that.

    python -m benchmarks.cpu_service [--threads N] [--repeats 3]

The two sides never run at the same time: the server is stopped before transformers loads, so each
side has the machine's cores to itself. The server's torch threads are set through OMP_NUM_THREADS
(inherited by its data-plane process); its control plane (gRPC, scheduler, detokenizer) runs in
another process on the same cores, while transformers runs everything in this one.

Run it on an otherwise idle machine: with as many torch threads as cores, every op that splits across
threads (the KV-cache gather, attention) waits for a scheduler time slice (~20 ms) whenever another
process holds a core, and both sides slow down several-fold. The report says how much CPU other processes
(and the hypervisor) took during each side's timed passes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoplane.clients.client import Client
from nanoplane.demo import serve_in_background
from nanoplane.models.default_model import default_model_dir
from nanoplane.settings import read_tuning

ROOT = Path(__file__).resolve().parent.parent

# Short, different questions, so the 16 streams share only the chat template's prefix (as real users do).
QUESTIONS = [
    "What is the capital of France?",
    "How do bees make honey?",
    "Why is the sky blue?",
    "What is a prime number?",
    "How does a rainbow form?",
    "Who wrote Romeo and Juliet?",
    "What causes the seasons on Earth?",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Why do cats purr?",
    "What is the boiling point of water?",
    "How do airplanes stay in the air?",
    "What is the largest ocean?",
    "How do vaccines work?",
    "What is a black hole?",
    "Why do leaves change color in autumn?",
]
# The issue's transformers figures on a 2-core machine; nanoplane's target is twice each.
ISSUE_TRANSFORMERS_TOK_S = {"1 stream": 20.0, "16 streams": 137.0}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@dataclass(slots=True)
class Run:
    """One timed pass of a workload."""

    wall_s: float
    token_ids: list[list[int]]  # per stream, in prompt order
    ttft_s: float | None = None  # single stream only: request sent -> first token here
    itl_s: float | None = None  # single stream only: mean gap between later tokens
    prompt_tokens: int = 0  # single stream, nanoplane: the prompt's length ...
    cached_tokens: int = 0  # ... and how much of it the prefix cache served (TTFT skips that prefill)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass(slots=True, frozen=True)
class CpuShare:
    others: float  # fraction of all CPUs busy in processes that are not ours
    steal: float  # fraction of all CPUs the hypervisor gave to other machines


class CpuMeter:
    """Machine-wide CPU time against our own processes' over a window: what the rest took from our cores."""

    def __init__(self, roots: Sequence[int]):
        import psutil  # the default-model extra's; only this meter needs it

        self.psutil = psutil
        self.procs = [psutil.Process(pid) for pid in roots]
        self.procs += [c for p in self.procs for c in p.children(recursive=True)]  # the server's planes

    def _sample(self) -> tuple[float, float, float, float]:
        cpu = self.psutil.cpu_times()
        busy = cpu.user + cpu.nice + cpu.system + cpu.irq + cpu.softirq
        ours = sum(t.user + t.system for t in (p.cpu_times() for p in self.procs))
        return time.perf_counter(), busy, ours, cpu.steal

    def __enter__(self) -> CpuMeter:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        (t0, busy0, ours0, steal0), (t1, busy1, ours1, steal1) = self.start, self._sample()
        capacity = (t1 - t0) * (os.cpu_count() or 1)
        self.share = CpuShare(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / capacity, (steal1 - steal0) / capacity)


@dataclass(slots=True)
class Side:
    """Both workloads of one side, `repeats` passes each; figures are medians over the passes."""

    single: list[Run] = field(default_factory=list)
    batch: list[Run] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)  # what the model saw, for the equality check
    others: CpuShare | None = None  # CPU taken by everything else during the timed passes

    @staticmethod
    def median(runs: Sequence[Run], key: Callable[[Run], float | None]) -> float:
        return statistics.median(v for r in runs if (v := key(r)) is not None)


def check_lengths(run: Run, max_tokens: int, who: str) -> None:
    # ignore_eos (and no EOS stop in transformers) must make every stream exactly max_tokens long, or tok/s compares
    # different amounts of work.
    lengths = {len(t) for t in run.token_ids}
    if lengths != {max_tokens}:
        raise RuntimeError(f"{who}: streams produced {sorted(lengths)} tokens, expected exactly {max_tokens}")


# ---------------------------------------------------------------------------------------------------------------
# nanoplane through gRPC


def nanoplane_single(client: Client, question: str, max_tokens: int) -> Run:
    from tqdm.auto import tqdm

    tokens: list[int] = []
    stamps: list[float] = []  # arrival time of each token (a chunk may carry several)
    usage = None
    with tqdm(total=max_tokens, desc="nanoplane  1 stream ", unit="tok", dynamic_ncols=True) as bar:
        start = time.perf_counter()
        for chunk in client.generate(messages=chat(question), temperature=0.0, max_tokens=max_tokens,
                                     ignore_eos=True):
            now = time.perf_counter()
            tokens += chunk.token_ids
            stamps += [now] * len(chunk.token_ids)
            bar.update(len(chunk.token_ids))
            usage = chunk.usage or usage
        wall = time.perf_counter() - start
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return Run(wall, [tokens], ttft_s=stamps[0] - start if stamps else None, itl_s=itl,
               prompt_tokens=usage.prompt_tokens if usage else 0,
               cached_tokens=usage.cached_prompt_tokens if usage else 0)


def nanoplane_batch(client: Client, questions: Sequence[str], max_tokens: int) -> Run:
    start = time.perf_counter()
    # generate_batch opens one stream per prompt at once (max_concurrency >= 16) and draws the tqdm bar.
    done = client.generate_batch([chat(q) for q in questions], max_concurrency=len(questions), temperature=0.0,
                                 max_tokens=max_tokens, ignore_eos=True)
    return Run(time.perf_counter() - start, [c.token_ids for c in done])


def run_nanoplane(model: str, questions: Sequence[str], args: argparse.Namespace) -> Side:
    side = Side()
    log_path = Path(tempfile.mkdtemp(prefix="nanoplane-cpu-bench-")) / "serve.log"
    print(f"starting nanoplane serve --device cpu (OMP_NUM_THREADS={args.threads}; log {log_path})", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    flags = ["--model", model, "--device", "cpu"]
    try:
        # Its logs go to a file so tqdm stays readable.
        with (open(log_path, "wb") as log,
              serve_in_background(flags, args.start_timeout, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT) as (address, proc),
              Client(address) as client):
            client.generate_text(messages=chat("Hi"), temperature=0.0, max_tokens=4)  # warm-up
            side.prompt_ids = [client.tokenize(messages=chat(q)) for q in questions]
            with CpuMeter([os.getpid(), proc.pid]) as meter:
                for _ in range(args.repeats):
                    side.single.append(nanoplane_single(client, questions[0], args.max_tokens))
                for _ in range(args.repeats):
                    side.batch.append(nanoplane_batch(client, questions, args.max_tokens))
            side.others = meter.share
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"{e}; the server's log: {log_path}") from None
    return side


# ---------------------------------------------------------------------------------------------------------------
# transformers


class StepClock:
    """A generate() streamer that stamps each decoding step and drives a tqdm bar.

    generate() first puts the prompt, then each step's new tokens (one per row, batched or not).
    """

    def __init__(self, total: int, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
        self.stamps: list[float] = []
        self._saw_prompt = False

    def put(self, value: Any) -> None:
        if not self._saw_prompt:
            self._saw_prompt = True
            return
        self.stamps.append(time.perf_counter())
        self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def run_transformers(model_dir: str, questions: Sequence[str], args: argparse.Namespace) -> Side:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"  # decoder-only: pad before the prompt so every row ends at its last token
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # The server's path: template to text, then encode without adding special tokens (the template has them).
    texts = [tokenizer.apply_chat_template(chat(q), add_generation_prompt=True, tokenize=False) for q in questions]
    side = Side(prompt_ids=[tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    # ignore_eos, as the server runs it: no EOS stops a row (eos_token_id=None), so every row makes exactly
    # max_tokens. Not min_new_tokens: that masks EOS out of the logits, so greedy would pick another token
    # wherever the model's argmax is EOS, and the tokens would part from nanoplane's at the first EOS.
    # temperature/top_p/top_k None: greedy without the warnings about the model's sampling defaults.
    gen = dict(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None,
               pad_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)

    def generate(batch: Sequence[str], desc: str) -> Run:
        enc = tokenizer(list(batch), return_tensors="pt", padding=True, add_special_tokens=False)
        clock = StepClock(args.max_tokens, desc)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, **gen, streamer=clock)
        wall = time.perf_counter() - start
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        s = clock.stamps
        itl = (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else None
        return Run(wall, new, ttft_s=s[0] - start if s else None, itl_s=itl)

    generate(texts[:1], "transformers warm-up")
    with CpuMeter([os.getpid()]) as meter:
        for _ in range(args.repeats):
            side.single.append(generate(texts[:1], "transformers 1 stream "))
        for _ in range(args.repeats):
            side.batch.append(generate(texts, "transformers 16 rows  "))
    side.others = meter.share
    return side


# ---------------------------------------------------------------------------------------------------------------
# report


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def report(np_side: Side, hf_side: Side, args: argparse.Namespace) -> None:
    n = args.max_tokens
    same_prompts = np_side.prompt_ids == hf_side.prompt_ids
    print(f"\nprompt token ids equal on both sides (server's Tokenize vs apply_chat_template + encode): "
          f"{same_prompts}")
    np_tokens, hf_tokens = np_side.single[0].token_ids[0], hf_side.single[0].token_ids[0]
    diff = first_difference(np_tokens[:n], hf_tokens[:n])
    print(f"single stream greedy tokens, first {n}: "
          + ("equal" if diff is None else f"DIFFER from token {diff} (nanoplane {np_tokens[diff:diff + 4]}, "
                                            f"transformers {hf_tokens[diff:diff + 4]})"))
    # Informational: a padded batch and continuous batching use other matrix shapes than one row, so float32
    # rounding may differ and a near-tie can flip; the single stream above is the strict check.
    equal_rows = sum(a == b for a, b in zip(np_side.batch[0].token_ids, hf_side.batch[0].token_ids, strict=True))
    print(f"{len(QUESTIONS)}-stream greedy tokens equal to transformers' padded batch: "
          f"{equal_rows}/{len(QUESTIONS)} streams")
    stable = all(r.token_ids == np_side.single[0].token_ids for r in np_side.single)
    print(f"nanoplane single stream identical across its {len(np_side.single)} passes: {stable}")

    rows = [("1 stream", np_side.single, hf_side.single), ("16 streams", np_side.batch, hf_side.batch)]
    # Every pass, not only the medians: one slow pass is a finding too (a stall), not noise to hide.
    for name, np_runs, hf_runs in rows:
        print(f"tok/s per pass, {name}: nanoplane {', '.join(f'{r.tok_s:.1f}' for r in np_runs)}; "
              f"transformers {', '.join(f'{r.tok_s:.1f}' for r in hf_runs)}")
    for name, np_runs, _ in rows:
        target = 2 * ISSUE_TRANSFORMERS_TOK_S[name]
        got = Side.median(np_runs, lambda r: r.tok_s)
        print(f"target {name}: >= {target:.0f} tok/s (2x the issue's transformers): "
              f"{'met' if got >= target else 'NOT met'} ({got:.1f})")

    # What else ran on these cores while we timed (see the module docstring): a few percent already costs.
    for name, side in (("nanoplane", np_side), ("transformers", hf_side)):
        o = side.others
        warn = " -- not idle: rerun on an idle machine" if o and o.others + o.steal > 0.05 else ""
        print(f"CPU taken by other processes during the {name} passes: {o.others:.1%} of {os.cpu_count()} CPUs, "
              f"hypervisor steal {o.steal:.1%}{warn}" if o else f"{name}: CPU share not measured")
    print(f"\nmedians of {args.repeats} passes; {args.threads} torch threads each side; {n} greedy output tokens "
          f"per stream; SmolLM2-135M-Instruct float32 on the CPU\n")
    print("| workload | nanoplane gRPC tok/s | transformers tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for name, np_runs, hf_runs in rows:
        a, b = Side.median(np_runs, lambda r: r.tok_s), Side.median(hf_runs, lambda r: r.tok_s)
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    print("\n| single stream | nanoplane gRPC | transformers |")
    print("| --- | --- | --- |")
    ms = 1e3
    print(f"| ms / output token (wall / {n}) | {Side.median(np_side.single, lambda r: r.wall_s) / n * ms:.1f} | "
          f"{Side.median(hf_side.single, lambda r: r.wall_s) / n * ms:.1f} |")
    print(f"| ms between tokens (decode) | {Side.median(np_side.single, lambda r: r.itl_s) * ms:.1f} | "
          f"{Side.median(hf_side.single, lambda r: r.itl_s) * ms:.1f} |")
    # nanoplane's prefix cache keeps the chat template's system prompt from the warm-up on; transformers
    # prefills the whole prompt every time. Both are what a user gets, so the table shows both as they are.
    cached = min(r.cached_tokens for r in np_side.single)
    print(f"| TTFT (ms; nanoplane had {cached} of {np_side.single[0].prompt_tokens} prompt tokens cached) | "
          f"{Side.median(np_side.single, lambda r: r.ttft_s) * ms:.1f} | "
          f"{Side.median(hf_side.single, lambda r: r.ttft_s) * ms:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads for each side (default: the cores this process may use)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per workload; the report takes medians")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args()

    model = str(default_model_dir(read_tuning().cache))  # convert the default model now, before any clock starts
    np_side = run_nanoplane(model, QUESTIONS, args)
    for run in (*np_side.single, *np_side.batch):
        check_lengths(run, args.max_tokens, "nanoplane")
    hf_side = run_transformers(model, QUESTIONS, args)
    for run in (*hf_side.single, *hf_side.batch):
        check_lengths(run, args.max_tokens, "transformers")
    report(np_side, hf_side, args)


if __name__ == "__main__":
    main()
