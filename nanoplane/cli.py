"""The `nanoplane` command.

    nanoplane serve                                  # both planes on this host, the default model
    nanoplane generate --server 127.0.0.1:50051 "What is the capital of France?"   # stream an answer
    nanoplane generate "..."                         # no server: the embedded engine
    nanoplane keys ./plane-keys                      # the plane link's CURVE keys, once
    nanoplane controlplane --model DIR --bind tcp://0.0.0.0:5555 --plane-keys ./plane-keys   # the planes apart
    nanoplane dataplane --model DIR --control tcp://controlplane:5555 --plane-keys ./plane-keys
    nanoplane health --server 127.0.0.1:50051        # exit 0 while SERVING

Every flag is defined in nanoplane/settings.py and takes its default from the environment, read only
for the command being run: --max-num-seqs from NANOPLANE_MAX_NUM_SEQS, and so on. This module launches
things; it imports the planes lazily inside the commands that need them, so `nanoplane controlplane`
and `nanoplane health` never load torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from importlib import metadata
from pathlib import Path

from nanoplane import settings


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the command has flags for; EngineConfig's defaults fill in the rest."""
    return {name: getattr(args, name) for name in settings.ENGINE_OPTIONS if hasattr(args, name)}


def resolve_model(model: str | None) -> str:
    """The given folder, or the embedded default model (converted once from its PyPI package)."""
    if model:
        return model
    from nanoplane.models.default_model import default_model_dir

    return str(default_model_dir(settings.read_tuning().cache))


def wait_for_model(model: str, wait_s: float, poll_s: float = 2.0) -> None:
    """Wait for a model folder that is not there yet, saying so once: a container that exited instead would
    be restarted by its `restart:` policy over and over. ValueError (exit 2) when the wait is over."""
    config, deadline = Path(model) / "config.json", time.monotonic() + wait_s
    if config.is_file() or wait_s == 0:
        return
    print(f"nanoplane: no model at {model} (no config.json): mount a HuggingFace model folder there "
          f"(docker-compose.yml: NANOPLANE_MODEL_DIR and NANOPLANE_MODEL_NAME); waiting for it"
          + ("" if wait_s < 0 else f" {wait_s:g} s"), file=sys.stderr, flush=True)
    while not config.is_file():
        if wait_s >= 0 and time.monotonic() >= deadline:
            raise ValueError(f"model folder {model!r} has no config.json (waited {wait_s:g} s)")
        time.sleep(poll_s)


def engine_config(args: argparse.Namespace):
    from nanoplane.controlplane.config import EngineConfig

    return EngineConfig(resolve_model(args.model), **engine_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    from nanoplane.controlplane import LLM, SamplingParams

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


def connect(args: argparse.Namespace):
    """A Client of --server with the command's TLS and token flags (ValueError on a file it cannot read)."""
    from nanoplane.clients.client import Client, read_token_file

    token = args.auth_token or (read_token_file(args.auth_token_file) if args.auth_token_file else None)
    return Client(args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=token)


def server_security(args: argparse.Namespace):
    """The gRPC port's TLS and tokens, every file checked now: a bad one stops the command (exit 2)."""
    from nanoplane.controlplane.security import ServerSecurity

    return ServerSecurity.from_files(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream the answer from a running server, as it is generated."""
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens)
    if args.sampling_seed is not None:
        sampling["seed"] = args.sampling_seed
    import grpc

    printed = False
    try:
        with connect(args) as client:
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


def metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """(host, port) of the /metrics endpoint, None when off; ValueError for a port that cannot be one."""
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port} is not a port (0 turns the metrics off, else 1-65535)")
    return (args.metrics_host or args.host, args.metrics_port) if args.metrics_port else None


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoplane.controlplane.service import run_serve

    metrics = metrics_address(args)  # refused before the model is looked for
    security = server_security(args)
    return run_serve(engine_config(args), f"{args.host}:{args.port}", args.bind, security=security,
                     metrics_address=metrics, plane_keys=args.plane_keys, insecure_plane=args.insecure_plane,
                     traces_endpoint=args.otlp_traces_endpoint, **server_limits(args))


def server_limits(args: argparse.Namespace) -> dict[str, float]:
    """SIGTERM's drain and the gRPC connections' limits; ValueError for a negative one."""
    limits = {name: getattr(args, name) for name in ("drain_delay", "drain_timeout", "max_connection_age",
                                                     "max_request_bytes")}
    for name, value in limits.items():
        if not value >= 0:
            raise ValueError(f"--{name.replace('_', '-')} {value:g} must be >= 0")
    return limits


def cmd_controlplane(args: argparse.Namespace) -> int:
    from nanoplane.controlplane.service import run_controlplane

    metrics = metrics_address(args)
    security = server_security(args)
    return run_controlplane(engine_config(args), args.bind, f"{args.host}:{args.port}", security=security,
                            metrics_address=metrics, plane_keys=args.plane_keys, insecure_plane=args.insecure_plane,
                            traces_endpoint=args.otlp_traces_endpoint, **server_limits(args))


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's first command: start the service, stream one answer through the client, stop."""
    from nanoplane.demo import run_demo

    return run_demo(args, engine_kwargs(args))


def cmd_dataplane(args: argparse.Namespace) -> int:
    from nanoplane.dataplane.launcher import launch

    return launch(args)


def cmd_keys(args: argparse.Namespace) -> int:
    from nanoplane.plane_keys import write_keys

    try:
        written = write_keys(args.dir)
    except FileExistsError as e:
        print(f"nanoplane: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in written))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import grpc

    try:
        with connect(args) as client:
            status = client.health(timeout=args.timeout)
    except grpc.RpcError as e:  # an unreachable server is simply not healthy
        print(f"nanoplane: {args.server} is not reachable: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its flags take their defaults from their NANOPLANE_* variables, read when
    that command is the one being run (and only then)."""

    def parse_known_args(self, args=None, namespace=None):
        settings.apply_environment(self, sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)


COMMANDS = {
    "generate": "answer one prompt: from a server (--server) or the embedded engine",
    "serve": "both planes on this host (the data plane supervised)",
    "controlplane": "the control plane alone",
    "demo": "start the service, stream one answer through the gRPC client, stop",
    "dataplane": "the data plane: one process per tensor-parallel rank",
    "health": "exit 0 while the server's health service says SERVING",
    "keys": "write the plane link's CURVE keys into DIR: the control plane's and the data planes' keypairs",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoplane", description="Serve large language models over gRPC.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    funcs = {"generate": cmd_generate, "serve": cmd_serve, "controlplane": cmd_controlplane, "demo": cmd_demo,
             "dataplane": cmd_dataplane, "health": cmd_health, "keys": cmd_keys}
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == "generate":
            p.add_argument("prompt")
        elif name == "demo":
            p.add_argument("prompt", nargs="?", default="What is the capital of France?")
        elif name == "keys":
            p.add_argument("dir", help="folder to write (created if missing); see docs/operations.md, \"Securing "
                                       "the plane link\"")
        settings.add_options(p, name)
        p.set_defaults(func=funcs[name])
    return parser


def version() -> str:
    """The installed distribution's version."""
    try:
        return metadata.version("nanoplane")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "server", None) is not None and ":" not in args.server:
        print(f"nanoplane: error: --server must be HOST:PORT, got {args.server!r}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "model_wait", 0) and args.model:
            wait_for_model(args.model, args.model_wait)
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
