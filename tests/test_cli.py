"""The `nanoplane` command's flags: each subcommand offers the flags it uses, and `serve` hands its
data plane a command line that the data plane's own parser reads back to the same settings."""

from __future__ import annotations

import argparse
import sys

import pytest

from controlplane.cli import build_parser, engine_config
from controlplane.config import EngineConfig
from controlplane.supervisor import dataplane_argv
from dataplane.launcher import add_arguments


def dataplane_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_controlplane_refuses_flags_only_a_data_plane_reads(capsys):
    for flag in (["--device", "cuda"], ["--enforce-eager"], ["--gpu-memory-utilization", "0.5"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["controlplane", *flag])
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_controlplane_config_takes_the_engine_defaults_for_the_rest(tiny_models):
    args = build_parser().parse_args(["controlplane", "--model", str(tiny_models["qwen3"]), "--max-num-seqs", "8"])
    config = engine_config(args)
    assert config.max_num_seqs == 8 and config.device == "auto" and config.kvcache_block_size == 0


def test_serve_hands_the_data_plane_every_setting(tiny_models):
    config = EngineConfig(str(tiny_models["qwen3"]), device="cpu", dtype="float32", tensor_parallel_size=2,
                          max_num_seqs=12, max_num_batched_tokens=96, max_model_len=200, kvcache_block_size=32,
                          num_kvcache_blocks=40, gpu_memory_utilization=0.5, cpu_kvcache_gib=0.25,
                          enforce_eager=True, attention_backend="torch", seed=7)
    argv = dataplane_argv(config, "ipc:///tmp/x.sock")
    assert argv[:3] == [sys.executable, "-m", "dataplane.launcher"]
    args = dataplane_parser().parse_args(argv[3:])
    assert (args.model, args.control, args.world_size) == (config.model, "ipc:///tmp/x.sock", 2)
    assert (args.device, args.dtype, args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len) == (
        "cpu", "float32", 12, 96, 200)
    assert (args.block_size, args.num_kvcache_blocks, args.gpu_memory_utilization, args.cpu_kvcache_gib) == (
        32, 40, 0.5, 0.25)
    assert (args.enforce_eager, args.attention_backend, args.seed) == (True, "torch", 7)


def test_the_block_size_alias_keeps_its_variable(monkeypatch):
    monkeypatch.setenv("NANOPLANE_BLOCK_SIZE", "64")  # the data plane's variable before the flag was renamed
    assert build_parser().parse_args(["dataplane", "--model", "m", "--control", "c"]).block_size == 64


def test_the_block_size_has_one_name_on_both_planes(monkeypatch):
    assert dataplane_parser().parse_args(["--model", "m", "--control", "c", "--block-size", "64"]).block_size == 64
    monkeypatch.setenv("NANOPLANE_KVCACHE_BLOCK_SIZE", "128")
    args = build_parser().parse_args(["dataplane", "--model", "m", "--control", "c"])
    assert args.block_size == 128
    assert build_parser().parse_args(["serve"]).kvcache_block_size == 128


def test_generate_from_a_server_reports_an_rpc_error_in_one_line(capsys):
    from controlplane.cli import free_port, main

    code = main(["generate", "--server", f"127.0.0.1:{free_port()}", "--raw", "hi"])  # nothing listens there
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("nanoplane: UNAVAILABLE: ") and "Traceback" not in err


def test_health_of_an_unreachable_server_in_one_line(capsys):
    from controlplane.cli import free_port, main

    code = main(["health", "--server", f"127.0.0.1:{free_port()}", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 1 and " is not reachable: UNAVAILABLE: " in err
    assert len(err.strip().splitlines()) == 1 and "debug_error_string" not in err


def test_an_empty_server_address_is_refused_not_run_locally(capsys):
    from controlplane.cli import main

    assert main(["generate", "--server", "", "hi"]) == 2
    assert "--server must be HOST:PORT" in capsys.readouterr().err


def test_a_bad_environment_value_is_an_argument_error(monkeypatch, capsys):
    monkeypatch.setenv("NANOPLANE_MAX_TOKENS", "abc")
    with pytest.raises(SystemExit) as exit_info:
        build_parser()
    assert exit_info.value.code == 2
    assert "NANOPLANE_MAX_TOKENS='abc' is not a valid value for --max-tokens" in capsys.readouterr().err


def test_waiting_for_a_server_that_never_answers_keeps_its_timeout():
    """A listener that accepts connections but never speaks gRPC (a wedged or stopped server): each
    health call gets what is left of the timeout, so the wait ends near it, not at gRPC's own."""
    import socket
    import time

    from clients.client import Client

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with Client(f"127.0.0.1:{listener.getsockname()[1]}") as client:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                client.wait_until_serving(2.0)
            assert time.monotonic() - start < 6.0
