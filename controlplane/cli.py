"""The `nanoplane` command.

    nanoplane serve                                  # both planes on this host, the default model
    nanoplane generate --server 127.0.0.1:50051 "What is the capital of France?"   # stream an answer
    nanoplane generate "..."                         # no server: the embedded engine
    nanoplane controlplane --model DIR --bind tcp://0.0.0.0:5555   # the planes apart (containers)
    nanoplane dataplane --model DIR --control tcp://controlplane:5555 --tensor-parallel-size 2
    nanoplane health --server 127.0.0.1:50051        # exit 0 while SERVING

Every flag also takes its default from the environment: --max-num-seqs from NANOPLANE_MAX_NUM_SEQS,
and so on. This module launches things; it imports the planes lazily inside the commands that need
them, so `nanoplane controlplane` never loads torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

DEFAULT_PORT = 50051


def add_engine_arguments(p: argparse.ArgumentParser, scheduling_only: bool = False) -> None:
    """Every engine option of `LLM`, as a flag; with `scheduling_only`, those the control plane alone
    uses (the data plane's own flags belong on `nanoplane dataplane`)."""
    p.add_argument("--model", default=None, help="HuggingFace model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--steps-in-flight", type=int, default=0,
                   help="steps sent ahead of the result waited for, up to 2 (0: 2 for GPU ranks over ZeroMQ, else 1)")
    if scheduling_only:
        return
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--kvcache-block-size", type=int, default=0, help="tokens per KV block (0: 256 on GPU, 16 on CPU)")
    p.add_argument("--num-kvcache-blocks", type=int, default=0, help="fix the KV cache size (0: from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cpu-kvcache-gib", type=float, default=2.0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    p.add_argument("--seed", type=int, default=0)


ENGINE_OPTIONS = ("device", "dtype", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                  "max_model_len", "kvcache_block_size", "num_kvcache_blocks", "gpu_memory_utilization",
                  "cpu_kvcache_gib", "enforce_eager", "attention_backend", "seed", "steps_in_flight")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the command has flags for; EngineConfig's defaults fill in the rest."""
    return {name: getattr(args, name) for name in ENGINE_OPTIONS if hasattr(args, name)}


def resolve_model(model: str | None) -> str:
    """The given folder, or the embedded default model (converted once from its PyPI package)."""
    if model:
        return model
    from models.default_model import default_model_dir

    return str(default_model_dir())


def engine_config(args: argparse.Namespace):
    from controlplane.config import EngineConfig

    return EngineConfig(resolve_model(args.model), **engine_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
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


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the answer from a running server, as it is generated."""
    from clients.client import Client

    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    if args.sampling_seed is not None:
        sampling["seed"] = args.sampling_seed
    import grpc

    printed = False
    try:
        with Client(args.server) as client:
            if args.raw:
                chunks = client.generate(args.prompt, **sampling)
            else:
                chunks = client.generate(messages=[{"role": "user", "content": args.prompt}], **sampling)
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
                printed = True
    except grpc.RpcError as e:  # the server's status and message say it all; a traceback adds nothing
        if printed:
            print()
        print(f"nanoplane: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from controlplane.service import run_serve

    return run_serve(engine_config(args), f"{args.host}:{args.port}", args.bind)


def cmd_controlplane(args: argparse.Namespace) -> int:
    from controlplane.service import run_controlplane

    return run_controlplane(engine_config(args), args.bind, f"{args.host}:{args.port}")


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after grace_s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_in_background(serve_args: list[str], start_timeout: float = 600.0, **popen) -> Iterator[tuple[str, object]]:
    """`nanoplane serve SERVE_ARGS` on a free loopback port; yields (address, process) once health says
    SERVING and stops the process on exit. The demo, the benchmarks and the tests start the service
    this way. RuntimeError if the server exits first, TimeoutError if it is not ready in time."""
    import subprocess

    from clients.client import Client

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--port", str(port), *serve_args],
                            **popen)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address) as client:
            client.wait_until_serving(start_timeout, still_starting=lambda: proc.poll() is None)
        yield address, proc
    finally:
        stop_process(proc)


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's first command: start the service, stream one answer through the client, stop."""
    from clients.client import Client

    model = resolve_model(args.model)  # convert the default model here, before the server's clock starts
    flags = ["--model", model]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in engine_kwargs(args).items() if not isinstance(v, bool)]
    flags += ["--enforce-eager"] if args.enforce_eager else []
    try:
        with serve_in_background(flags, args.start_timeout) as (address, _), Client(address) as client:
            print(f"> {args.prompt}", flush=True)
            for chunk in client.generate(messages=[{"role": "user", "content": args.prompt}], temperature=0.0,
                                         max_tokens=args.max_tokens):
                print(chunk.text, end="", flush=True)
            print()
    except (RuntimeError, TimeoutError) as e:
        print(f"nanoplane: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_dataplane(args: argparse.Namespace) -> int:
    from dataplane.launcher import launch

    return launch(args)


def cmd_health(args: argparse.Namespace) -> int:
    import grpc

    from clients.client import Client

    try:
        with Client(args.server) as client:
            status = client.health(timeout=args.timeout)
    except grpc.RpcError as e:  # an unreachable server is simply not healthy
        print(f"nanoplane: {args.server} is not reachable: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoplane", description="Serve large language models over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt: from a server (--server) or the embedded engine")
    g.add_argument("prompt")
    g.add_argument("--server", default=None,
                   help="HOST:PORT of a running nanoplane; streams the answer (the engine flags then do not apply)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)

    for name, func, help_text in (("serve", cmd_serve, "both planes on this host (the data plane supervised)"),
                                  ("controlplane", cmd_controlplane, "the control plane alone")):
        s = sub.add_parser(name, help=help_text)
        add_engine_arguments(s, scheduling_only=name == "controlplane")
        s.add_argument("--host", default="127.0.0.1" if name == "serve" else "0.0.0.0",
                       help="address of the gRPC API")
        s.add_argument("--port", type=int, default=DEFAULT_PORT)
        s.add_argument("--bind", default=None if name == "serve" else "tcp://0.0.0.0:5555",
                       help="ZeroMQ endpoint data planes connect to (serve: a private ipc:// socket)")
        s.set_defaults(func=func)

    demo = sub.add_parser("demo", help="start the service, stream one answer through the gRPC client, stop")
    demo.add_argument("prompt", nargs="?", default="What is the capital of France?")
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.add_argument("--start-timeout", type=float, default=600.0)
    add_engine_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    d = sub.add_parser("dataplane", help="the data plane: one process per tensor-parallel rank")
    from dataplane.launcher import add_arguments as add_dataplane_arguments  # no torch at import

    add_dataplane_arguments(d)
    d.set_defaults(func=cmd_dataplane)

    h = sub.add_parser("health", help="exit 0 while the server's health service says SERVING")
    h.add_argument("--server", default=f"127.0.0.1:{DEFAULT_PORT}")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    h.set_defaults(func=cmd_health)

    for p in sub.choices.values():
        apply_environment(p)
    return parser


def apply_environment(parser: argparse.ArgumentParser, environ: os._Environ | dict | None = None) -> None:
    """Defaults from NANOPLANE_<LONG_FLAG> variables, so containers are configured by environment."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        # Each name of a flag has its variable (an alias keeps the one it always had); the first set wins.
        names = ["NANOPLANE_" + o[2:].replace("-", "_").upper() for o in longs]
        value = next((environ[n] for n in names if n in environ), None)
        if value is None:
            continue
        if action.nargs == 0:  # a switch: 1/true/yes turn it on
            parsed = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                parsed = action.type(value) if action.type else value
            except (TypeError, ValueError):
                parser.error(f"{names[0]}={value!r} is not a valid value for {longs[0]}")
        action.default = parsed
        action.required = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "server", None) is not None and ":" not in args.server:
        print(f"nanoplane: error: --server must be HOST:PORT, got {args.server!r}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ValueError as e:
        print(f"nanoplane: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user knows; a traceback through grpc's threads says nothing
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nanoplane generate ... | head`: the reader left; say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
