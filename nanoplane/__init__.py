"""nanoplane: serve large language models over gRPC. The command line and what both planes share live here;
the planes and the rest install beneath this name too (`nanoplane.controlplane`, `nanoplane.dataplane`, ...)."""

from __future__ import annotations

from pathlib import Path as _Path

# A source checkout used without installing (its root on sys.path): the folders that install as
# nanoplane.<folder> sit beside this one, so look for subpackages there as well.
_root = _Path(__file__).parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "controlplane" / "__init__.py").is_file():
    __path__.append(str(_root))


def __getattr__(name: str):
    # The embedded engine's API, loaded on first use: most importers of nanoplane want neither torch nor it.
    if name in ("LLM", "SamplingParams"):
        from nanoplane import controlplane

        return getattr(controlplane, name)
    raise AttributeError(f"module 'nanoplane' has no attribute {name!r}")
