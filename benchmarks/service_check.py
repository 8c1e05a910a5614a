"""GPU check of the service: `nanoplane serve` (ZeroMQ data plane, gRPC API) streams the same greedy tokens
as the embedded engine, at tensor-parallel sizes 1 and 2, on random Qwen3-0.6B-shaped bf16 weights.

    python benchmarks/service_check.py --tp 1 2
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import make_random_model  # noqa: E402

FLAGS = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "64"]


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(0, 10000) for _ in range(n)] for n in (5, 300, 1500, 64)]


def embedded(model: str, tp: int, max_tokens: int) -> list[list[int]]:
    from controlplane import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_model_len=2048, gpu_memory_utilization=0.5, max_num_seqs=64)
    try:
        outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.close()
    return [o["token_ids"] for o in outs]


def served(model: str, tp: int, max_tokens: int) -> tuple[list[list[int]], float]:
    from clients.client import Client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--model", model, "--port", str(port),
                             "--tensor-parallel-size", str(tp), *FLAGS], cwd=ROOT)
    try:
        client = Client(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 300
        while True:
            try:
                if client.health() == "SERVING":
                    break
            except Exception:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)
        t = time.perf_counter()
        out = [[tok for chunk in client.generate(p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                for tok in chunk.token_ids] for p in prompts()]
        one_stream_s = time.perf_counter() - t
        client.close()
        return out, one_stream_s
    finally:
        proc.terminate()
        proc.wait(60)


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
        got, seconds = served(args.model_dir, tp, args.max_tokens)
        same = sum(a == b for a, b in zip(ref, got, strict=True))
        tokens = sum(len(g) for g in got)
        rate = tokens / seconds
        rows.append(f"| {tp} | {same}/{len(ref)} streams identical | {rate:,.0f} tok/s, one stream at a time |")
    print("| TP | serve vs embedded greedy | gRPC sequential streams |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
