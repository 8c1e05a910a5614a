"""The `nanoplane` command's flags: each subcommand offers the flags it uses, each explains itself
(help, default, variable), variables are read for the command being run only, and `serve` hands its
data plane a command line that the data plane's own parser reads back to the same settings."""

from __future__ import annotations

import argparse
import sys

import pytest

from nanoplane import settings
from nanoplane.cli import COMMANDS, build_parser, engine_config, main
from nanoplane.controlplane.config import EngineConfig
from nanoplane.dataplane.launcher import add_arguments
from nanoplane.process import free_port
from nanoplane.settings import dataplane_argv


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
    assert argv[:3] == [sys.executable, "-m", "nanoplane.dataplane.launcher"]
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
    code = main(["generate", "--server", f"127.0.0.1:{free_port()}", "--raw", "hi"])  # nothing listens there
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("nanoplane: UNAVAILABLE: ") and "Traceback" not in err


def test_health_of_an_unreachable_server_in_one_line(capsys):
    code = main(["health", "--server", f"127.0.0.1:{free_port()}", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 1 and " is not reachable: UNAVAILABLE: " in err
    assert len(err.strip().splitlines()) == 1 and "debug_error_string" not in err


def test_an_empty_server_address_is_refused_not_run_locally(capsys):
    assert main(["generate", "--server", "", "hi"]) == 2
    assert "--server must be HOST:PORT" in capsys.readouterr().err


def test_a_bad_environment_value_is_ignored_with_a_warning(monkeypatch, capsys):
    monkeypatch.setenv("NANOPLANE_MAX_TOKENS", "abc")
    assert build_parser().parse_args(["generate", "hi"]).max_tokens == 128
    assert "ignoring NANOPLANE_MAX_TOKENS='abc': not a valid value for --max-tokens" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--max-tokens", "7", "hi"]).max_tokens == 7  # the flag wins
    assert capsys.readouterr().err == ""  # and the variable is not even read


def test_kubernetes_service_variables_do_not_stop_a_command(monkeypatch, capsys):
    """A Service named nanoplane makes Kubernetes set NANOPLANE_PORT=tcp://IP:PORT in every pod."""
    monkeypatch.setenv("NANOPLANE_PORT", "tcp://10.0.0.7:50051")
    args = build_parser().parse_args(["health"])
    assert args.server == "127.0.0.1:50051" and capsys.readouterr().err == ""  # not a flag of health: unread
    args = build_parser().parse_args(["serve"])
    assert args.port == settings.DEFAULT_PORT
    assert "ignoring NANOPLANE_PORT='tcp://10.0.0.7:50051'" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--port", "7000"]).port == 7000


def test_a_bad_value_on_the_command_line_is_an_error(capsys):
    for argv in (["serve", "--port", "tcp://x:1"], ["serve", "--dtype", "int3"], ["health", "--timeout", "soon"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        assert "invalid" in capsys.readouterr().err


def test_variables_are_read_only_for_the_command_being_run(monkeypatch):
    monkeypatch.setenv("NANOPLANE_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("NANOPLANE_ENFORCE_EAGER", "1")
    args = build_parser().parse_args(["serve"])
    assert args.max_num_seqs == 12 and args.enforce_eager is True
    monkeypatch.setenv("NANOPLANE_ENFORCE_EAGER", "maybe")  # not a switch value: ignored
    assert build_parser().parse_args(["demo"]).enforce_eager is False


def test_every_flag_explains_itself(capsys):
    parser = build_parser()
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = "".join(capsys.readouterr().out.split())  # argparse wraps the help, at hyphens too
        for o in settings.options_for(command):
            default = o.default_for(command)
            shown = "none" if default is None else str(default)
            expected = f"{o.help_for(command)} (default: {shown}; env {o.env})"
            assert "".join(expected.split()) in text, (command, o.name)
    for command, sub in parser._subparsers._group_actions[0].choices.items():
        flags = {a.option_strings[0] for a in sub._actions if a.option_strings and a.dest != "help"}
        assert flags == {o.flag for o in settings.options_for(command)}, command  # no flag outside settings


def test_version_comes_from_the_installed_distribution(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoplane {metadata.version('nanoplane')}"


def test_waiting_for_a_server_that_never_answers_keeps_its_timeout():
    """A listener that accepts connections but never speaks gRPC (a wedged or stopped server): each
    health call gets what is left of the timeout, so the wait ends near it, not at gRPC's own."""
    import socket
    import time

    from nanoplane.clients.client import Client

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with Client(f"127.0.0.1:{listener.getsockname()[1]}") as client:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                client.wait_until_serving(2.0)
            assert time.monotonic() - start < 6.0


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_metrics_port_that_is_no_port_is_refused_before_anything_starts(port, capsys):
    assert main(["controlplane", "--metrics-port", port]) == 2
    assert f"--metrics-port {port} is not a port" in capsys.readouterr().err


def test_the_metrics_endpoint_follows_the_api_host_unless_told(monkeypatch):
    from nanoplane.cli import metrics_address

    parse = build_parser().parse_args
    assert metrics_address(parse(["serve"])) is None  # off by default
    assert metrics_address(parse(["serve", "--metrics-port", "9090"])) == ("127.0.0.1", 9090)
    assert metrics_address(parse(["controlplane", "--metrics-port", "9090"])) == ("127.0.0.1", 9090)
    monkeypatch.setenv("NANOPLANE_METRICS_HOST", "10.0.0.5")
    assert metrics_address(parse(["serve", "--metrics-port", "9090"])) == ("10.0.0.5", 9090)


def test_controlplane_listens_on_loopback_unless_told():
    args = build_parser().parse_args(["controlplane"])
    assert args.host == "127.0.0.1" and args.bind == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize("command", ["controlplane", "serve", "dataplane"])
def test_every_plane_command_takes_the_plane_link_flags(command, monkeypatch):
    monkeypatch.setenv("NANOPLANE_PLANE_KEYS", "/keys")
    monkeypatch.setenv("NANOPLANE_INSECURE_PLANE", "1")
    extra = ["--model", "m", "--control", "ipc:///x"] if command == "dataplane" else []
    args = build_parser().parse_args([command, *extra])
    assert args.plane_keys == "/keys" and args.insecure_plane is True


def test_serve_hands_its_data_plane_the_keys(tiny_models, tmp_path, monkeypatch):
    """`serve --bind tcp://... --plane-keys DIR`: its supervised data plane gets the same folder."""
    from nanoplane.controlplane import service
    from nanoplane.plane_keys import write_keys

    write_keys(tmp_path)
    started = []

    class Supervisor:
        def __init__(self, argv):
            started.append(argv)

        def start(self):
            pass

        def stop(self):
            pass

        def on_ready(self, ready):
            pass

    async def serve(*args, **kwargs):
        assert kwargs["plane_keys"] == str(tmp_path)  # the engine process binds with them

    monkeypatch.setattr(service, "DataPlaneSupervisor", Supervisor)
    monkeypatch.setattr(service, "_serve", serve)
    monkeypatch.setattr(service, "engine_process_enabled", lambda: True)
    config = EngineConfig(str(tiny_models["qwen3"]))
    service.run_serve(config, "127.0.0.1:0", f"tcp://127.0.0.1:{free_port()}", plane_keys=str(tmp_path))
    ns = dataplane_parser().parse_args(started[0][3:])
    assert ns.plane_keys == str(tmp_path) and not ns.insecure_plane
    with pytest.raises(ValueError, match="--plane-keys"):
        service.run_serve(config, "127.0.0.1:0", f"tcp://127.0.0.1:{free_port()}")


def test_keys_writes_once(tmp_path, capsys):
    assert main(["keys", str(tmp_path / "k")]) == 0
    assert "controlplane.key_secret" in capsys.readouterr().out
    assert main(["keys", str(tmp_path / "k")]) == 2
    assert "already holds" in capsys.readouterr().err
