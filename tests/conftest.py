"""Shared fixtures: tiny generated checkpoints and a HuggingFace greedy reference."""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))

from support.tiny_models import make_tiny_model  # noqa: E402

# name -> (architecture, tied embeddings, kv heads of 4 query heads)
TINY = {
    "qwen3": ("qwen3", False, 2),
    "llama-tied": ("llama", True, 2),
    "qwen3-mha-tied": ("qwen3", True, 4),
    "llama-mqa": ("llama", False, 1),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(base / name, arch, tie, seed=i, num_kv_heads=kv)
            for i, (name, (arch, tie, kv)) in enumerate(TINY.items())}


@pytest.fixture
def seed_from_test_id(request) -> None:
    # Fresh inputs for every case, yet reproducible: seed from the test id.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from HuggingFace transformers in float32, ignoring end-of-sequence."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _HF_CACHE[key]
    # Recompute the whole sequence each step: slow but free of any cache API between versions.
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out
