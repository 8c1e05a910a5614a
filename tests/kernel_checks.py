"""What the kernel tests share: the device, tolerances, and paged caches with their sequences'
pages scattered (tests/test_kernels.py, tests/test_attention_kernels.py; their per-test seed is
tests/conftest.py's `seed_from_test_id`)."""

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (q heads, kv heads, head_dim): MHA, GQA 2 and 4, SmolLM2's 9/3; plus non-power-of-two D.
HEADS = [(4, 4, 64), (4, 2, 128), (8, 2, 64), (9, 3, 64), (2, 1, 80)]
DTYPES = [torch.float32, torch.float16]  # the interpreter cannot tl.dot bf16 (GPU cases cover it)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The interpreter truncates fp32 -> bf16 instead of rounding to nearest even (triton 3.9), so
# bit-exactness with torch's bf16 rounding is only checked on a GPU.
ROUNDS_BF16 = os.environ.get("TRITON_INTERPRET") != "1"


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite elements"
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def paged_cache(ctx_lens, page, hkv, d, dtype):
    """Random K/V caches with each sequence's pages scattered; unused table entries are -1."""
    need = [-(-n // page) for n in ctx_lens]
    num_blocks = sum(need) + 2  # spare blocks no table points at: reading them would show
    k_cache = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, device=DEV).int()
    tables = torch.full((len(ctx_lens), max(need + [0]) + 1), -1, dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, tables


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEV)

