"""Every benchmark runs as `python -m benchmarks.X` and parses its arguments; the GPU ones cannot run here."""

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = ["throughput", "decode_latency", "service_check", "cpu_service", "controlplane_ceiling",
              "plane_protocol", "kernel_speed", "allreduce", "alternate", "kv_events"]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    monkeypatch.delitem(sys.modules, f"benchmarks.{name}", raising=False)  # runpy runs a fresh copy
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_no_module_is_named_like_a_package():
    """Such a module would shadow the package wherever benchmarks/ is on sys.path."""
    root = Path(__file__).resolve().parents[2]
    packages = {p.parent.name for pattern in ("*/__init__.py", "nanoplane/*/__init__.py") for p in root.glob(pattern)}
    assert "kernels" in packages
    assert not {p.stem for p in (root / "benchmarks").glob("*.py")} & packages
