"""The distribution installs every folder under the one import name `nanoplane`, beside other packages:
nothing of ours at the top level of site-packages, where proto-plus's `proto` (every google-cloud library
needs it), the `kernels` distribution or another `models` live."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("proto", "controlplane", "dataplane", "models", "kernels", "clients")


def test_the_wheel_holds_only_the_nanoplane_package(tmp_path):
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("nanoplane", *FOLDERS):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                   check=True, cwd=tmp_path, timeout=300)
    wheel, = tmp_path.glob("nanoplane-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"nanoplane"}, tops
    for folder in FOLDERS:  # every folder made it in, with its __init__
        assert f"nanoplane/{folder}/__init__.py" in names, folder
    assert "nanoplane/proto/nanoplane/v1/generation_pb2.py" in names
    assert "nanoplane/models/layers/__init__.py" in names
    # Every package folder of the tree is in pyproject's list (a new subpackage would be left out).
    listed = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    # clients/nanoplane_client is the client distribution's own top package (clients/pyproject.toml), not ours.
    present = {f"nanoplane/{p.parent.relative_to(ROOT)}" for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")
               if "nanoplane_client" not in p.parts}
    assert present <= listed, sorted(present - listed)


def test_proto_plus_still_imports_beside_us(tmp_path):
    # Away from the checkout's root, so that only installed packages are found.
    code = ("import proto, nanoplane.proto.plane, nanoplane.controlplane\n"
            "assert hasattr(proto, 'Message'), proto.__file__  # proto-plus's, not ours\n"
            "assert nanoplane.proto.plane.__name__ == 'nanoplane.proto.plane'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=120)
