"""GPU check of the service: `nanoplane serve` (ZeroMQ data plane, gRPC API) streams the same greedy tokens
as the embedded engine, at tensor-parallel sizes 1 and 2, on random Qwen3-0.6B-shaped bf16 weights.

    python -m benchmarks.service_check --tp 1 2
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.throughput import make_random_model

ROOT = Path(__file__).resolve().parent.parent

FLAGS = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "64"]


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(0, 10000) for _ in range(n)] for n in (5, 300, 1500, 64)]


def embedded(model: str, tp: int, max_tokens: int) -> list[list[int]]:
    from nanoplane.controlplane import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_model_len=2048, gpu_memory_utilization=0.5, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        # One prompt at a time, as the served check sends them: bf16 results depend on the batch
        # (GEMM shapes, graph buckets), so equal batches are what makes token equality meaningful.
        return [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts()]
    finally:
        llm.close()


def served(model: str, tp: int, max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    from nanoplane.clients.client import Client
    from nanoplane.demo import serve_in_background

    with serve_in_background(["--model", model, "--tensor-parallel-size", str(tp), *FLAGS], 300,
                             cwd=ROOT) as (address, _), Client(address) as client:
        client.generate_text([1, 2, 3], max_tokens=8)  # first use compiles kernels for new shapes
        out, stamps = [], []
        for p in prompts():
            tokens, times, t = [], [], time.perf_counter()
            for chunk in client.generate(p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True):
                tokens += chunk.token_ids
                times.append(time.perf_counter() - t)
            out.append(tokens)
            stamps.append(times)
        return out, stamps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument("--model-dir", default="/tmp/nanoplane-qwen3-0.6b-random")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    if not (Path(args.model_dir) / "model.safetensors").is_file():
        make_random_model(Path(args.model_dir))
    rows = []
    for tp in args.tp:
        ref = embedded(args.model_dir, tp, args.max_tokens)
        got, stamps = served(args.model_dir, tp, args.max_tokens)
        same = sum(a == b for a, b in zip(ref, got, strict=True))
        ttft = [s[0] * 1e3 for s in stamps]
        itl = [(s[-1] - s[0]) / (len(s) - 1) * 1e3 for s in stamps]
        rows.append(f"| {tp} | {same}/{len(ref)} streams identical | "
                    + ", ".join(f"{len(p)}: {a:.1f} / {b:.2f}" for p, a, b in zip(prompts(), ttft, itl, strict=True))
                    + " |")
    print("| TP | serve vs embedded greedy | one stream: prompt tokens: TTFT ms / ms per output token |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
