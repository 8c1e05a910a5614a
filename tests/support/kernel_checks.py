"""What the kernel tests share: the device, tolerances, paged caches with their sequences' pages
scattered, and the QKV prologue's check (also run by tests/engine/test_norm_fold.py). Their per-test seed
is tests/conftest.py's `seed_from_test_id`."""

import os

import pytest
import torch

import nanoplane.kernels.reference as ref
from nanoplane.kernels import qkv_prologue

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


def rope_cache(d: int, max_pos: int = 4096) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def check_qkv_prologue(t, hq, hkv, d, dtype, with_norm, page=16, tol=None, qkv=None, rows=None):
    """The QKV prologue kernel against kernels/reference.py. `rows` (with the `qkv` they project to): the row
    scale of a folded norm."""
    cos_sin = rope_cache(d)
    width = (hq + 2 * hkv) * d
    if qkv is None:
        qkv = torch.randn(t, width + 8, device=DEV).to(dtype)[:, :width]  # row-strided, as a GEMM slice may be
    row_norm = None if rows is None else (rows, 1e-5)
    weights = [(1 + 0.1 * torch.randn(d, device=DEV)).to(dtype) for _ in range(2)] if with_norm else [None, None]
    positions = torch.randint(0, cos_sin.shape[0], (t,), device=DEV)
    num_blocks = -(-t // page) + 2
    slots = torch.randperm(num_blocks * page, device=DEV)[:t]
    slots[t // 2] = -1  # a CUDA-graph padding row: writes nothing
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    args = (positions, cos_sin, *weights, 1e-6, slots)
    expected_q = ref.qkv_prologue_ref(qkv.clone(), *args, exp_k, exp_v, hq, hkv, row_norm)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    q = qkv_prologue(qkv, *args, k_cache, v_cache, hq, hkv, row_norm)
    assert q.shape == (t, hq, d) and q.data_ptr() == qkv.data_ptr()  # q rewritten in place
    if tol is None:
        tol = TOL[dtype] if dtype == torch.bfloat16 and not ROUNDS_BF16 else TOL[dtype] / 4
    assert rel_err(q, expected_q) < tol
    kept = slots[slots >= 0]
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert rel_err(flat_k[kept], exp_k.view(-1, hkv, d)[kept]) < tol
    if rows is None:
        assert torch.equal(flat_v[kept], exp_v.view(-1, hkv, d)[kept])  # V is copied, not transformed
    else:
        assert rel_err(flat_v[kept], exp_v.view(-1, hkv, d)[kept]) < tol  # V takes the row scale
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEV)
    untouched[kept] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # V read, never written
