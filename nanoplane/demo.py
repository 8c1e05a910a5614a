"""`nanoplane demo`: start the service on a free port, stream one answer through the gRPC client, stop.

What a newcomer sees is the question and the streamed answer, with one progress line while the model
converts and loads; the service's logs go to <NANOPLANE_CACHE>/logs/demo.log (--verbose shows them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from nanoplane import settings
from nanoplane.process import free_port, stop_process


@contextlib.contextmanager
def serve_in_background(serve_args: list[str], start_timeout: float = 600.0, **popen) -> Iterator[tuple[str, object]]:
    """`nanoplane serve SERVE_ARGS` on a free loopback port; yields (address, process) once health says
    SERVING and stops the process on exit. The demo, the benchmarks and the tests start the service
    this way. RuntimeError if the server exits first, TimeoutError if it is not ready in time."""
    from nanoplane.clients.client import Client

    port = free_port()
    # No load balancer to wait for on a private port: SIGTERM drains at once (SERVE_ARGS may say otherwise).
    argv = [sys.executable, "-m", "nanoplane", "serve", "--port", str(port), "--drain-delay", "0", *serve_args]
    proc = subprocess.Popen(argv, **popen)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address) as client:
            client.wait_until_serving(start_timeout, still_starting=lambda: proc.poll() is None)
        yield address, proc
    finally:
        stop_process(proc)


class Progress:
    """One status line on stderr, overwritten in place on a terminal and gone once the answer starts."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown = False

    def show(self, text: str) -> None:
        if self.tty:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)
        self.shown = True

    def clear(self) -> None:
        if self.tty and self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
        self.shown = False


def run_demo(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from nanoplane.clients.client import Client
    from nanoplane.models.default_model import MODEL_NAME, default_model_dir

    tuning = settings.read_tuning()
    progress = Progress()
    model = args.model
    if not model:  # converted here, before the server's start-up clock runs
        cached = Path(tuning.cache).expanduser() / MODEL_NAME
        if not (cached / "config.json").is_file():
            progress.show(f"converting {MODEL_NAME} once (about 30 s) ...")
        quiet = contextlib.nullcontext() if args.verbose else contextlib.redirect_stderr(io.StringIO())
        with quiet:
            model = str(default_model_dir(tuning.cache))
    values = {**engine_kwargs, "model": model}
    flags = settings.option_argv(values, "serve")
    log_path = Path(tuning.cache).expanduser() / "logs" / "demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress.show(f"starting the service on {Path(model).name} (logs: {log_path}) ...")
    with contextlib.ExitStack() as stack:
        popen = {}
        if not args.verbose:
            log = stack.enter_context(open(log_path, "w"))
            popen = {"stdout": log, "stderr": subprocess.STDOUT}
        try:
            address, _ = stack.enter_context(serve_in_background(flags, args.start_timeout, **popen))
            client = stack.enter_context(Client(address))
            progress.clear()
            print(f"> {args.prompt}", flush=True)
            for chunk in client.generate(messages=[{"role": "user", "content": args.prompt}], temperature=0.0,
                                         max_tokens=args.max_tokens):
                print(chunk.text, end="", flush=True)
            print()
        except (RuntimeError, TimeoutError) as e:
            progress.clear()
            print(f"nanoplane: {e}" + ("" if args.verbose else f" (the service's log: {log_path})"), file=sys.stderr)
            return 1
    return 0

