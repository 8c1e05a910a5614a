"""The planes stay apart in the code (docs/design.md's import rules), and the control plane never loads torch.

Every folder installs under the one import name `nanoplane` (`controlplane/` as `nanoplane.controlplane`, ...),
so an import is judged by the folder it reaches: its area."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"proto", "controlplane", "dataplane", "models", "kernels", "clients"}
PLANES = {"controlplane", "dataplane", "models", "kernels"}

# area -> areas (ours, or torch) it must never import; "nanoplane" is nanoplane/'s shared modules
FORBIDDEN = {
    "controlplane": {"dataplane", "models", "kernels", "torch", "triton", "nanoplane.cli"},
    "dataplane": {"controlplane", "clients", "nanoplane.cli"},
    "models": {"dataplane", "controlplane", "clients", "nanoplane.cli"},
    "kernels": {"dataplane", "controlplane", "models", "clients", "nanoplane.cli"},
    "clients": {"dataplane", "controlplane", "models", "kernels", "torch", "nanoplane"},
    "proto": {"dataplane", "controlplane", "models", "kernels", "clients", "torch", "nanoplane"},
    "nanoplane": PLANES | {"clients", "torch", "triton", "nanoplane.cli"},
}
# llm.py (the embedded engine) wires in an in-process data plane.
EXEMPT = {ROOT / "controlplane" / "llm.py"}
# The command line (above both planes), the demo it runs and the root package (which hands out the embedded
# API) may import either plane, lazily: never torch at the top, so that `nanoplane health` starts without it.
ABOVE_THE_PLANES = {ROOT / "nanoplane" / name for name in ("cli.py", "__main__.py", "demo.py", "__init__.py")}


def imported_modules(path: Path) -> list[tuple[str, bool]]:
    """(module, at the top of the file) for every absolute import in path; `from a import b` counts a.b too."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules += [(node.module, id(node) in top)]
            modules += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return modules


def area(module: str) -> str:
    """The area an import reaches: a folder (`nanoplane.controlplane.x` -> controlplane), nanoplane.cli,
    nanoplane/'s shared modules ("nanoplane"), or a third-party root (torch)."""
    parts = module.split(".")
    if parts[0] != "nanoplane":
        return parts[0]
    if len(parts) == 1:
        return "nanoplane"
    if parts[1] in FOLDERS:
        return parts[1]
    return "nanoplane.cli" if parts[1] in ("cli", "demo", "__main__") else "nanoplane"


def areas(path: Path, top_only: bool = False) -> set[str]:
    return {area(m) for m, top in imported_modules(path) if top or not top_only}


def test_every_import_goes_through_the_one_import_name():
    stale = []
    for folder in (*FOLDERS, "nanoplane", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            bare = {m for m, _ in imported_modules(path) if m.split(".")[0] in FOLDERS}
            if bare:
                stale.append(f"{path.relative_to(ROOT)} imports {sorted(bare)} (nanoplane.<folder> instead)")
    assert not stale, "\n".join(stale)


def test_import_rules():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in EXEMPT:
                continue
            if path in ABOVE_THE_PLANES:
                bad = areas(path, top_only=True) & {"torch", "triton"}
            else:
                bad = areas(path) & forbidden
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_the_rules_see_a_violation(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import torch\nfrom nanoplane.dataplane.worker import run_rank\nfrom nanoplane import cli\n")
    assert areas(path) >= {"torch", "dataplane", "nanoplane.cli"}
    assert area("nanoplane.settings") == "nanoplane" and area("nanoplane.proto.plane") == "proto"


def test_control_plane_runs_without_torch(tiny_models):
    code = f"""
import sys
heavy = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')
                       or m.split('.')[:2] in (['nanoplane', 'dataplane'], ['nanoplane', 'models'],
                                               ['nanoplane', 'kernels']))
import nanoplane.controlplane, nanoplane.controlplane.engine, nanoplane.controlplane.scheduler
import nanoplane.controlplane.block_manager, nanoplane.controlplane.dataplane_client, nanoplane.controlplane.grpc_server
import nanoplane.controlplane.engine_loop, nanoplane.controlplane.service, nanoplane.controlplane.front_inproc
import nanoplane.controlplane.front_process, nanoplane.controlplane.engine_process, nanoplane.controlplane.supervisor
import nanoplane.clients.client
assert not heavy(), heavy()
import nanoplane.cli, nanoplane.settings
nanoplane.cli.build_parser()  # every command's flags, the data plane's too, still no torch
assert nanoplane.cli.main(["health", "--server", "127.0.0.1:9", "--timeout", "0.5"]) == 1  # nothing listens
from nanoplane import SamplingParams
from nanoplane.controlplane.tokenizer import Tokenizer
tok = Tokenizer({str(tiny_models['qwen3'])!r})
assert tok.decode(tok.encode("the quick brown fox")) == "the quick brown fox"
from nanoplane.controlplane.structured import GrammarCompiler, SequenceGrammar  # llguidance: xgrammar loads torch
grammars = GrammarCompiler({str(tiny_models['qwen3'])!r}, 512, [0])
grammars.fill_masks([SequenceGrammar(grammars.compile({{"json_schema": {{"type": "object"}}}}))])
print(heavy())
assert not heavy(), heavy()
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
