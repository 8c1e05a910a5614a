"""Every setting of nanoplane, defined once.

Options are the engine's, the data plane's and the commands' knobs: each is a flag of the commands
named in `commands`, a NANOPLANE_<FLAG> variable that gives that flag its default, and, for the engine
ones, a keyword of `LLM(...)` and a field of EngineConfig. Tuning variables are NANOPLANE_* variables
that only move measured thresholds and switches; `read_tuning` reads them once, at a process's
start-up, into a frozen `Tuning` that the planes hand down to models and kernels.

This module imports neither plane nor torch: both planes and the command line use it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_COMMANDS = frozenset({"generate", "serve", "controlplane", "demo"})
# The commands whose engine runs a data plane in this process tree (the control plane alone does not).
WITH_DATA_PLANE = frozenset({"generate", "serve", "demo", "dataplane"})
DEFAULT_PORT = 50051


@dataclass(frozen=True)
class Option:
    """One knob: a flag (`--name-with-dashes`, plus `aliases`) of each command in `commands`."""

    name: str  # keyword, EngineConfig field and argparse dest
    type: type
    default: Any
    help: str
    commands: frozenset[str]
    engine: bool = False  # a keyword of LLM(...) and a field of EngineConfig
    dataplane_field: str = ""  # the DataPlaneConfig field it sets (and its dest on `nanoplane dataplane`)
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # more flags of `nanoplane dataplane`, each keeping its variable
    required: frozenset[str] = frozenset()  # commands where it must be given (flag or variable)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # per-command defaults that differ
    helps: Mapping[str, str] = field(default_factory=dict)  # per-command help that differs

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def flags(self, command: str) -> tuple[str, ...]:
        return (self.flag, *self.aliases) if command == "dataplane" else (self.flag,)

    @property
    def env(self) -> str:
        return env_name(self.flag)

    def default_for(self, command: str) -> Any:
        return self.defaults.get(command, self.default)

    def help_for(self, command: str) -> str:
        return self.helps.get(command, self.help)


def env_name(flag: str) -> str:
    """--max-num-seqs -> NANOPLANE_MAX_NUM_SEQS."""
    return "NANOPLANE_" + flag.lstrip("-").replace("-", "_").upper()


_ENGINE = ENGINE_COMMANDS
_RANKS = _ENGINE - {"controlplane"} | {"dataplane"}  # where the data plane's options are flags
_SAMPLING = frozenset({"generate"})
_SERVING = frozenset({"serve", "controlplane"})
_ASKING = frozenset({"generate", "health"})  # the commands that call a server (generate: with --server)
_CLIENT_CERT = "PEM client certificate (chain) for mTLS, with --tls-key"
_PLANE = frozenset({"serve", "controlplane", "dataplane"})

OPTIONS: tuple[Option, ...] = (
    # The engine: LLM keywords, EngineConfig fields; those a data plane reads also reach its ranks.
    Option("model", str, None, "HuggingFace model folder (the embedded SmolLM2-135M when not given)",
           _ENGINE | {"dataplane"}, dataplane_field="model", required=frozenset({"dataplane"}),
           helps={"dataplane": "HuggingFace model folder (required)"}),
    Option("model_wait", float, 0.0, "seconds to wait for --model's config.json to appear before failing, as "
           "a container may start before its model is mounted or copied in (-1: forever; the images set it)", _PLANE),
    Option("device", str, "auto", "cuda, cuda:N (a data plane's rank r takes cuda:r with cuda), cpu or auto",
           _RANKS, engine=True, dataplane_field="device"),
    Option("dtype", str, "auto", "weights and activations; auto: bf16 on GPU (fp16 if the checkpoint says so), "
           "fp32 on CPU", _RANKS, engine=True, dataplane_field="dtype",
           choices=("auto", "float32", "float16", "bfloat16")),
    Option("tensor_parallel_size", int, 1, "ranks (processes, one GPU each) the model is split over",
           _ENGINE | {"dataplane"}, engine=True, dataplane_field="world_size", aliases=("--world-size",)),
    Option("max_num_seqs", int, 256, "requests in one step, and the data plane's batch slots",
           _ENGINE | {"dataplane"}, engine=True, dataplane_field="max_num_seqs"),
    Option("max_num_batched_tokens", int, 16384, "tokens in one step; longer prompts are prefilled in chunks",
           _ENGINE | {"dataplane"}, engine=True, dataplane_field="max_num_batched_tokens"),
    Option("max_model_len", int, 4096, "prompt + output tokens; capped by the model's max_position_embeddings",
           _ENGINE | {"dataplane"}, engine=True, dataplane_field="max_model_len"),
    Option("steps_in_flight", int, 0, "steps sent ahead of the result waited for, up to 2 "
           "(0: 2 for GPU ranks over ZeroMQ, else 1)", _ENGINE, engine=True),
    Option("scheduling_policy", str, "prefill-first", "prefill-first: every waiting prompt before any decode "
           "(nano-vllm's); mixed: decode rows first, prompt chunks in the rest of the token budget",
           _ENGINE, engine=True, choices=("prefill-first", "mixed")),
    Option("max_queued_requests", int, 0, "requests that may wait for a slot; beyond it Generate gets "
           "RESOURCE_EXHAUSTED (0: unbounded)", _SERVING, engine=True),
    Option("max_queued_tokens", int, 0, "prompt tokens of the requests waiting for a slot, in all; beyond it "
           "Generate gets RESOURCE_EXHAUSTED (0: unbounded)", _SERVING, engine=True),
    Option("kv_events", str, "on", "KV-cache events (block stored / removed / all cleared) for SubscribeKvEvents; "
           "recorded only while someone subscribes", _SERVING, engine=True, choices=("on", "off")),
    Option("kv_events_buffer", int, 10000, "engine steps' KV-event batches kept for a subscriber resuming from a "
           "sequence number", _SERVING, engine=True),
    Option("kvcache_block_size", int, 0, "tokens per KV block, a power of two >= 16 (0: 256 on GPU, 16 on CPU)",
           _RANKS, engine=True, dataplane_field="block_size", aliases=("--block-size",)),
    Option("num_kvcache_blocks", int, 0, "fix the KV cache size in blocks (0: size it from memory)",
           _RANKS, engine=True, dataplane_field="num_kvcache_blocks"),
    Option("gpu_memory_utilization", float, 0.9, "share of GPU memory the data plane may use in all",
           _RANKS, engine=True, dataplane_field="gpu_memory_utilization"),
    Option("cpu_kvcache_gib", float, 2.0, "KV cache budget of a CPU data plane, GiB",
           _RANKS, engine=True, dataplane_field="cpu_kvcache_gib"),
    Option("enforce_eager", bool, False, "no CUDA graphs", _RANKS, engine=True, dataplane_field="enforce_eager"),
    Option("attention_backend", str, "auto", "attention kernels", _RANKS, engine=True,
           dataplane_field="attention_backend", choices=("auto", "torch", "triton", "flash-attn")),
    Option("seed", int, 0, "seed of rank 0's shared sampling generator", _RANKS, engine=True, dataplane_field="seed"),
    # The data-plane launcher's own.
    Option("control", str, None, "control plane address, tcp://host:port or ipc:///path (required)",
           frozenset({"dataplane"}),
           required=frozenset({"dataplane"})),
    Option("heartbeat_interval", float, 0.5, "seconds between a rank's heartbeats", frozenset({"dataplane"})),
    Option("control_timeout", float, 30.0, "a rank exits when the control plane has been silent this many seconds",
           frozenset({"dataplane"})),
    Option("dist_init", str, "", "torch.distributed init method, tcp://host:port (empty: the launcher picks one)",
           frozenset({"dataplane"}), dataplane_field="dist_init"),
    Option("dist_timeout_s", float, 120.0, "seconds ranks wait for each other in torch.distributed",
           frozenset({"dataplane"}), dataplane_field="dist_timeout_s"),
    # The service.
    Option("host", str, "127.0.0.1", "address of the gRPC API", frozenset({"serve", "controlplane"})),
    Option("port", int, DEFAULT_PORT, "port of the gRPC API", frozenset({"serve", "controlplane"})),
    Option("metrics_port", int, 0, "port of the Prometheus /metrics endpoint (0: off)",
           frozenset({"serve", "controlplane"})),
    Option("metrics_host", str, None, "address of the /metrics endpoint (none: the gRPC API's --host)",
           frozenset({"serve", "controlplane"})),
    Option("otlp_traces_endpoint", str, None, "OTLP/gRPC collector of each request's OpenTelemetry spans, e.g. "
           "http://127.0.0.1:4317 (none: off; needs pip install 'nanoplane[tracing]')", _SERVING),
    Option("drain_delay", float, 5.0, "seconds after SIGTERM with readiness NOT_SERVING but requests still taken, "
           "so load balancers deregister the replica first", _SERVING),
    Option("drain_timeout", float, 30.0, "seconds then given to the requests in flight before they are ended",
           _SERVING),
    Option("max_connection_age", float, 0.0, "seconds before a client connection is asked to reconnect, so long-lived "
           "ones rebalance over replicas; its streams get --drain-timeout to finish (0: never)", _SERVING),
    Option("max_request_bytes", int, 0, "largest request the gRPC API takes, else RESOURCE_EXHAUSTED (0: 64 bytes "
           "a token of --max-model-len, at least 4 MiB)", _SERVING),
    Option("bind", str, None, "ZeroMQ endpoint data planes connect to (serve: a private ipc:// socket)",
           frozenset({"serve", "controlplane"}), defaults={"controlplane": "tcp://127.0.0.1:5555"}),
    # The plane link's security (nanoplane/plane_keys.py).
    Option("plane_keys", str, None, "folder of the plane link's CURVE keys, written by `nanoplane keys DIR`: the "
           "control plane reads controlplane.key_secret and authorized/*.key, a data plane dataplane.key_secret "
           "and controlplane.key (serve: both)", _PLANE),
    Option("insecure_plane", bool, False, "allow a tcp:// plane link without --plane-keys: neither authenticated "
           "nor encrypted (a warning is logged)", _PLANE),
    Option("server", str, None, "HOST:PORT of a running nanoplane to stream the answer from (the engine flags "
           "then do not apply)", frozenset({"generate", "health"}), defaults={"health": f"127.0.0.1:{DEFAULT_PORT}"},
           helps={"health": "HOST:PORT of the server to ask"}),
    Option("timeout", float, 5.0, "seconds to wait for the answer", frozenset({"health"})),
    # TLS, mTLS and bearer tokens on the gRPC port (controlplane/security.py; docs/operations.md).
    Option("tls_cert", str, None, "PEM certificate (chain) of the gRPC API: serve TLS, with --tls-key; "
           "re-read when it changes", _SERVING | _ASKING, helps={"generate": _CLIENT_CERT, "health": _CLIENT_CERT}),
    Option("tls_key", str, None, "PEM private key of --tls-cert", _SERVING | _ASKING),
    Option("tls_client_ca", str, None, "PEM CA certificate(s): clients must present a certificate one of them "
           "signed (mTLS; needs --tls-cert)", _SERVING),
    Option("tls_ca", str, None, "PEM CA certificate(s) to trust the server's certificate with (turns TLS on)",
           _ASKING),
    Option("auth_token_file", str, None, "bearer tokens, one a line, one of which every call but health must "
           "carry; re-read when it changes and on SIGHUP", _SERVING | _ASKING,
           helps={c: "file holding the bearer token to send (its first line but # comments)" for c in _ASKING}),
    Option("auth_token", str, None, "bearer token to send (--auth-token-file keeps it out of ps)", _ASKING),
    # One prompt.
    Option("raw", bool, False, "send the prompt as is, without the chat template", _SAMPLING),
    Option("temperature", float, 0.0, "sampling temperature (0: greedy)", _SAMPLING),
    Option("top_p", float, 1.0, "nucleus sampling mass", _SAMPLING),
    Option("top_k", int, 0, "sample among the k likeliest tokens (0: all)", _SAMPLING),
    Option("max_tokens", int, 128, "tokens to generate at most", frozenset({"generate", "demo"})),
    Option("sampling_seed", int, None, "seed of this request's draws", _SAMPLING),
    Option("start_timeout", float, 600.0, "seconds the service may take to start", frozenset({"demo"})),
    Option("verbose", bool, False, "show the service's logs here instead of writing them to a file",
           frozenset({"demo"})),
)
BY_NAME = {o.name: o for o in OPTIONS}
ENGINE_OPTIONS = tuple(o.name for o in OPTIONS if o.engine)  # LLM's keywords besides the model


def options_for(command: str) -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if command in o.commands)


def engine_default(name: str) -> Any:
    """The default of engine option `name` (EngineConfig's fields take theirs from here)."""
    return BY_NAME[name].default


def dataplane_default(field: str) -> Any:
    """The default of the option that sets DataPlaneConfig's `field` (its defaults come from here)."""
    return next(o.default_for("dataplane") for o in OPTIONS if o.dataplane_field == field)


def dataplane_fields(config: Any) -> dict[str, Any]:
    """The DataPlaneConfig keywords for an EngineConfig: every engine option a rank reads."""
    return {o.dataplane_field: getattr(config, o.name) for o in OPTIONS
            if o.dataplane_field and (o.engine or o.name == "model")}


def option_argv(values: Mapping[str, Any], command: str) -> list[str]:
    """Flags of `command` that set `values` (option name -> value; None is left out)."""
    argv: list[str] = []
    for o in options_for(command):
        value = values.get(o.name)
        if o.name not in values or value is None:
            continue
        if o.type is bool:
            if command == "dataplane":
                argv.append(o.flag if value else "--no-" + o.flag[2:])
            elif value:
                argv.append(o.flag)
        else:
            argv += [o.flag, str(value)]
    return argv


def dataplane_argv(config: Any, control: str) -> list[str]:
    """The data-plane launcher's command line for an EngineConfig, attached to `control`."""
    values = {o.name: getattr(config, o.name) for o in options_for("dataplane") if hasattr(config, o.name)}
    values["control"] = control
    return [sys.executable, "-m", "nanoplane.dataplane.launcher", *option_argv(values, "dataplane")]


# ---------------------------------------------------------------------------------------------------
# Tuning variables: read once at start-up.

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError("expected 1 or 0")


def _at_least(kind: type, low: float, strict: bool = False) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw)
        if value < low or (strict and value == low):
            raise ValueError(f"expected a number {'>' if strict else '>='} {low}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError("expected " + ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}")
        return raw
    return parse


@dataclass(frozen=True)
class Variable:
    field: str  # its Tuning field
    parse: Callable[[str], Any]
    default: Any
    help: str
    used_in: str  # the file whose code it moves

    @property
    def env(self) -> str:
        return "NANOPLANE_" + self.field.upper()


TUNING_VARIABLES: tuple[Variable, ...] = (
    Variable("pdl", parse_bool, True, "programmatic dependent launch of the Triton kernels (Hopper and later); "
             "0 turns it off", "kernels/pdl.py"),
    Variable("skinny_max_rows", _at_least(int, 0), 64, "linear layers of up to this many rows run kernels/"
             "skinny_gemm.py instead of cuBLAS (0: cuBLAS always)", "models/layers/linear.py"),
    Variable("decode_order_waves", _at_least(float, 0), 4.0, "decode attention follows the longest-first row "
             "order from this many waves of programs over the SMs (0: always)", "kernels/decode_attention.py"),
    Variable("decode_two_split_waves", _at_least(float, 0), 5.5, "decode attention splits each row's context "
             "in two below this many waves of one-split programs (0: off)", "kernels/decode_attention.py"),
    Variable("decode_early_setup", parse_bool, True, "decode attention loads its row's setup before its PDL "
             "wait; 0 waits first", "kernels/decode_attention.py"),
    Variable("fused_sampler", parse_bool, None, "1: the fused Triton sampler wherever it applies (on a CPU: in "
             "Triton's interpreter), 0: torch sampling; unset: fused on CUDA", "dataplane/sampler.py"),
    Variable("allreduce", _one_of("nccl", "symm_mem", "triton"), "triton", "tensor-parallel all-reduce of small "
             "tensors: triton (one-shot kernel), symm_mem (torch's) or nccl", "dataplane/allreduce.py"),
    Variable("fold_norms", parse_bool, True, "fold RMSNorm weights into the next projections; 0 keeps the norms",
             "models/norm_fold.py"),
    Variable("rank_pace", _at_least(int, 0), 0, "rank 0 logs its step timings every this many steps (0: never)",
             "dataplane/worker.py"),
    Variable("step_timeout", _at_least(float, 0, strict=True), 120.0, "seconds the control plane waits for a "
             "step's result before it gives the data plane up; keep it above the slowest real step",
             "controlplane/dataplane_client.py"),
    Variable("gil_switch_ms", _at_least(float, 0, strict=True), 0.5, "the control plane's GIL switch interval, "
             "ms (Python's default is 5)", "controlplane/service.py"),
    Variable("engine_process", parse_bool, True, "run the service's engine in a process of its own; 0 keeps it "
             "in the serving process", "controlplane/front_process.py"),
    Variable("cache", str, str(Path.home() / ".cache" / "nanoplane"), "folder of the converted default model "
             "(and the demo's logs)", "models/default_model.py"),
)


@dataclass(frozen=True)
class Tuning:
    pdl: bool = True
    skinny_max_rows: int = 64
    decode_order_waves: float = 4.0
    decode_two_split_waves: float = 5.5
    decode_early_setup: bool = True
    fused_sampler: bool | None = None  # None: fused on CUDA
    allreduce: str = "triton"
    fold_norms: bool = True
    rank_pace: int = 0
    step_timeout: float = 120.0
    gil_switch_ms: float = 0.5
    engine_process: bool = True
    cache: str = TUNING_VARIABLES[-1].default


def read_tuning(environ: Mapping[str, str] | None = None) -> Tuning:
    """The tuning variables from `environ` (os.environ); unset or empty ones keep their defaults.
    ValueError naming the variable when one does not parse."""
    environ = os.environ if environ is None else environ
    values = {}
    for v in TUNING_VARIABLES:
        raw = environ.get(v.env, "")
        if not raw:
            continue
        try:
            values[v.field] = v.parse(raw)
        except ValueError as e:
            raise ValueError(f"{v.env}={raw!r}: {e}") from None
    return Tuning(**values)


def tuning_table() -> str:
    """The tuning variables as a Markdown table (docs/operations.md holds a copy; a test compares them)."""
    rows = ["| Variable | Default | What it does | Used in |", "| --- | --- | --- | --- |"]
    for v in TUNING_VARIABLES:
        default = "unset" if v.default is None else "~/.cache/nanoplane" if v.field == "cache" else (
            int(v.default) if isinstance(v.default, bool) else v.default)
        rows.append(f"| `{v.env}` | `{default}` | {v.help} | `{v.used_in}` |")
    return "\n".join(rows)



# ---------------------------------------------------------------------------------------------------
# Flags: argparse definitions and their NANOPLANE_<FLAG> defaults.


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every option of `command` as a flag whose help ends with its default and variable."""
    for o in options_for(command):
        dest = o.dataplane_field if command == "dataplane" and o.dataplane_field else o.name
        default = o.default_for(command)
        kwargs: dict[str, Any] = dict(dest=dest, default=default,
                                      help=f"{o.help_for(command)} (default: {_shown(default)}; env {o.env})")
        if o.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if command == "dataplane" else "store_true"
        else:
            kwargs["type"] = o.type
            kwargs["required"] = command in o.required
        if o.choices:
            kwargs["choices"] = o.choices
        action = parser.add_argument(*o.flags(command), **kwargs)
        action.env_names = tuple(env_name(f) for f in o.flags(command))  # the first one set wins


def _given(action: argparse.Action, argv: list[str]) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in action.option_strings)


def apply_environment(parser: argparse.ArgumentParser, argv: list[str],
                      environ: Mapping[str, str] | None = None) -> None:
    """Defaults of `parser`'s flags from their NANOPLANE_<FLAG> variables. A value that does not parse is
    ignored with a warning on stderr: a flag given in `argv` wins anyway, and a variable meant for
    something else (Kubernetes sets NANOPLANE_PORT=tcp://... for a Service named nanoplane) must not
    stop a command."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        names = getattr(action, "env_names", ())
        name = next((n for n in names if n in environ), None)
        if name is None or _given(action, argv):
            continue
        raw = environ[name]
        try:
            if action.nargs == 0:  # a switch
                value = parse_bool(raw)
            else:
                value = action.type(raw) if action.type else raw
                if action.choices and value not in action.choices:
                    raise ValueError(f"expected one of {', '.join(action.choices)}")
        except (TypeError, ValueError):
            print(f"nanoplane: warning: ignoring {name}={raw!r}: not a valid value for {action.option_strings[0]}",
                  file=sys.stderr)
            continue
        action.default = value
        action.required = False


if __name__ == "__main__":  # docs/operations.md's table of tuning variables
    print(tuning_table())
