"""The planes stay apart in the code (docs/design.md's import rules), and the control plane never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"proto", "controlplane", "dataplane", "models", "kernels", "clients"}

# package -> packages (ours, or torch) it must never import
FORBIDDEN = {
    "controlplane": {"dataplane", "models", "kernels", "torch", "triton"},
    "dataplane": {"controlplane", "clients"},
    "models": {"dataplane", "controlplane", "clients"},
    "kernels": {"dataplane", "controlplane", "models", "clients"},
    "clients": {"dataplane", "controlplane", "models", "kernels", "torch"},
    "proto": {"dataplane", "controlplane", "models", "kernels", "clients", "torch"},
}
# llm.py (the embedded engine) wires in an in-process data plane; cli.py launches both planes and
# imports them lazily, inside the commands that need them.
EXEMPT = {ROOT / "controlplane" / "llm.py", ROOT / "controlplane" / "cli.py"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_import_rules():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in EXEMPT:
                continue
            bad = imported_roots(path) & forbidden
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_control_plane_runs_without_torch(tiny_models):
    code = f"""
import sys
import controlplane, controlplane.engine, controlplane.scheduler, controlplane.block_manager
import controlplane.remote, controlplane.grpc_server, controlplane.engine_loop, controlplane.service, clients.client
import controlplane.front_inproc, controlplane.front_process, controlplane.engine_process, controlplane.supervisor
planes = sorted(m for m in sys.modules if m.split('.')[0] in ('dataplane', 'models', 'kernels'))
assert not planes, planes
import controlplane.cli
controlplane.cli.build_parser()  # brings in the data plane's flags (dataplane.launcher), still no torch
from controlplane import SamplingParams
from controlplane.tokenizer import Tokenizer
tok = Tokenizer({str(tiny_models['qwen3'])!r})
assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'models', 'kernels'))
print(loaded)
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
