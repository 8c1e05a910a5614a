"""Skip a test that would convert the embedded default model when this machine cannot (no gguf,
accelerate or GGUF file): the CI machine has them all, a GPU host may not."""

from __future__ import annotations

import pytest


def needs_conversion_deps() -> None:
    from nanoplane.models.default_model import find_gguf

    for module in ("gguf", "accelerate"):
        pytest.importorskip(module, reason=f"converting the GGUF with transformers needs {module}")
    try:
        find_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
