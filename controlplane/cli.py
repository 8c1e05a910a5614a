"""The `nanoplane` command.

    nanoplane generate "What is the capital of France?"     # embedded engine, default model
    nanoplane generate --model DIR --device cuda "..."

This module launches things; it imports the planes lazily inside the commands that need them, so
`nanoplane controlplane` never loads torch.
"""

from __future__ import annotations

import argparse
import sys


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Every engine option of `LLM`, as a flag."""
    p.add_argument("--model", default=None, help="HuggingFace model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kvcache-block-size", type=int, default=0, help="tokens per KV block (0: 256 on GPU, 16 on CPU)")
    p.add_argument("--num-kvcache-blocks", type=int, default=0, help="fix the KV cache size (0: from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cpu-kvcache-gib", type=float, default=2.0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    p.add_argument("--seed", type=int, default=0)


ENGINE_OPTIONS = ("device", "dtype", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len", "kvcache_block_size", "num_kvcache_blocks", "gpu_memory_utilization",
                  "cpu_kvcache_gib", "enforce_eager", "attention_backend", "seed")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_OPTIONS}


def resolve_model(model: str | None) -> str:
    """The given folder, or the embedded default model (converted once from its PyPI package)."""
    if model:
        return model
    from models.default_model import default_model_dir

    return str(default_model_dir())


def cmd_generate(args: argparse.Namespace) -> int:
    from controlplane import LLM, SamplingParams

    llm = LLM(resolve_model(args.model), **engine_kwargs(args))
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer.has_chat_template:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])[1]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(out["text"].strip())
    llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoplane", description="Serve large language models over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt (embedded engine)")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"nanoplane: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
