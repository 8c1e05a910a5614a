"""The planes stay apart in the code (docs/design.md's import rules), and the control plane never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"nanoplane", "proto", "controlplane", "dataplane", "models", "kernels", "clients"}
PLANES = {"controlplane", "dataplane", "models", "kernels"}

# package -> packages (ours, or torch) it must never import
FORBIDDEN = {
    "controlplane": {"dataplane", "models", "kernels", "torch", "triton"},
    "dataplane": {"controlplane", "clients"},
    "models": {"dataplane", "controlplane", "clients"},
    "kernels": {"dataplane", "controlplane", "models", "clients"},
    "clients": {"dataplane", "controlplane", "models", "kernels", "torch"},
    "proto": {"dataplane", "controlplane", "models", "kernels", "clients", "torch"},
}
# llm.py (the embedded engine) wires in an in-process data plane.
EXEMPT = {ROOT / "controlplane" / "llm.py"}
# nanoplane/cli.py (the command line, above both planes) and the demo it runs may import either plane,
# lazily; the rest of nanoplane/ is shared by both planes and imports neither.
ABOVE_THE_PLANES = {ROOT / "nanoplane" / "cli.py", ROOT / "nanoplane" / "__main__.py", ROOT / "nanoplane" / "demo.py"}


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return modules


def imported_roots(path: Path) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(path)}


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


def test_the_command_line_sits_above_the_planes():
    violations = []
    for path in sorted((ROOT / "controlplane").rglob("*.py")):
        if any(m == "nanoplane.cli" or m.startswith("nanoplane.cli.") for m in imported_modules(path)):
            violations.append(f"{path.relative_to(ROOT)} imports nanoplane.cli")
    for path in sorted((ROOT / "nanoplane").rglob("*.py")):
        bad = imported_roots(path) & (PLANES | {"clients", "torch", "triton"})
        if path not in ABOVE_THE_PLANES and bad:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
        if path in ABOVE_THE_PLANES and imported_roots(path) & {"torch", "triton"}:
            violations.append(f"{path.relative_to(ROOT)} imports torch at the top")
    assert not violations, "\n".join(violations)


def test_control_plane_runs_without_torch(tiny_models):
    code = f"""
import sys
import controlplane, controlplane.engine, controlplane.scheduler, controlplane.block_manager
import controlplane.dataplane_client, controlplane.grpc_server, controlplane.engine_loop, controlplane.service
import controlplane.front_inproc, controlplane.front_process, controlplane.engine_process, controlplane.supervisor
import clients.client
planes = sorted(m for m in sys.modules if m.split('.')[0] in ('dataplane', 'models', 'kernels'))
assert not planes, planes
import nanoplane.cli, nanoplane.settings
nanoplane.cli.build_parser()  # every command's flags, the data plane's too, still no torch
assert nanoplane.cli.main(["health", "--server", "127.0.0.1:9", "--timeout", "0.5"]) == 1  # nothing listens
planes = sorted(m for m in sys.modules if m.split('.')[0] in ('dataplane', 'models', 'kernels'))
assert not planes, planes
from controlplane import SamplingParams
from controlplane.tokenizer import Tokenizer
tok = Tokenizer({str(tiny_models['qwen3'])!r})
assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'models', 'kernels'))
print(loaded)
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
