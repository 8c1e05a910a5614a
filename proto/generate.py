"""Regenerate the Python code for the public API: `python proto/generate.py` from anywhere.

protoc writes `from nanoplane.v1 import generation_pb2` into the gRPC module, which resolves only
with proto/ itself on sys.path; the import is rewritten to a relative one after every run, so the
same files work as `nanoplane.proto.nanoplane.v1` (the server) and inside the client distribution
(clients/pyproject.toml's `nanoplane_client.proto.nanoplane.v1`). The stub (.pyi) gets a
`# ruff: noqa` line: pyproject.toml's exclusion pattern (`*_pb2*.py`) does not cover it, and
generated code is not ours to lint.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
SOURCES = ["nanoplane/v1/generation.proto"]


def main() -> None:
    for source in SOURCES:
        args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={PROTO_DIR}", f"--pyi_out={PROTO_DIR}",
                f"--grpc_python_out={PROTO_DIR}", str(PROTO_DIR / source)]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed on {source}")
        grpc_file = PROTO_DIR / source.replace(".proto", "_pb2_grpc.py")
        text = grpc_file.read_text()
        patched, n = re.subn(r"^from nanoplane\.v1 import", "from . import", text, flags=re.MULTILINE)
        if n == 0:
            sys.exit(f"{grpc_file}: found no 'from nanoplane.' import to rewrite; did protoc change its output?")
        grpc_file.write_text(patched)
        stub = PROTO_DIR / source.replace(".proto", "_pb2.pyi")
        stub.write_text("# ruff: noqa\n" + stub.read_text())
        print(f"generated {source} (rewrote {n} import)")


if __name__ == "__main__":
    main()
