"""Triton kernels against their fp32 torch references (kernels/reference.py): RMSNorm, rotary, the
QKV prologue, silu·mul and the skinny GEMM. The attention kernels: tests/kernels/test_attention_kernels.py.

Without CUDA the kernels run in Triton's interpreter (numpy, one program at a time), so the CPU
cases use tiny shapes; the real shapes are in the `gpu`-marked cases at the end.
"""

import os

import torch

if not torch.cuda.is_available():
    # Only effective if nothing imported triton yet: @triton.jit (also on triton.language's own
    # helpers such as tl.sum) picks interpreter or compiler at import. tests/conftest.py sets it
    # first for the whole suite; this line serves runs that bypass it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from support.kernel_checks import DEV, ROUNDS_BF16, TOL, check_qkv_prologue, gpu, paged_cache, rel_err  # noqa: E402

from nanoplane.kernels import (  # noqa: E402
    apply_rotary,
    rms_norm,
    silu_and_mul,
    skinny_gemm,
    store_kvcache,
)
from nanoplane.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("seed_from_test_id")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    t = 7
    x = torch.randn(t, hidden + 8, device=DEV).to(dtype)[:, 4 : hidden + 4]  # row-strided view
    weight = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    residual = torch.randn(t, hidden, device=DEV).to(dtype) if with_residual else None
    out = torch.full((t, hidden), float("nan"), dtype=dtype, device=DEV)
    res_out = torch.full_like(out, float("nan")) if with_residual else None
    got = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=res_out)
    expected = ref.rms_norm_ref(x, weight, 1e-6, residual)
    exact = dtype != torch.bfloat16 or ROUNDS_BF16
    tol = TOL[dtype] / 4 if exact else TOL[dtype]
    if with_residual:
        assert got[1] is res_out and rel_err(res_out, expected[1]) < tol
        assert torch.equal(res_out, expected[1]) or not exact  # same add, same rounding
        got, expected = got[0], expected[0]
    assert got is out and rel_err(out, expected) < tol
    if dtype != torch.float32 and exact:
        # HF's order of roundings is reproduced: all but a few elements agree bit for bit (the fp32
        # sum order and rsqrt may differ, and rarely that flips the last bit after rounding).
        assert (out != expected).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,rot_dim", [(9, 3, 64, 64), (4, 2, 128, 128), (2, 1, 64, 32)])
def test_rotary(dtype, hq, hkv, d, rot_dim):
    t, max_pos = 11, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    fused = torch.randn(t, hq + 2 * hkv, d, device=DEV).to(dtype)
    before = fused.clone()
    q, k = fused[:, :hq], fused[:, hq : hq + hkv]
    positions = torch.randint(0, max_pos, (t,), device=DEV)
    expected_q, expected_k = ref.apply_rotary_ref(q, k, positions, cos_sin)
    got_q, got_k = apply_rotary(q, k, positions, cos_sin)
    assert got_q is q and got_k is k  # in place
    tol = TOL[dtype] if dtype == torch.bfloat16 and not ROUNDS_BF16 else TOL[dtype] / 4
    assert rel_err(q, expected_q) < tol and rel_err(k, expected_k) < tol
    assert torch.equal(fused[:, hq + hkv :], before[:, hq + hkv :])  # V untouched
    assert torch.equal(q[..., rot_dim:], before[:, :hq, rot_dim:])  # pass-through dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 128), (2, 1, 80)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qkv_prologue(dtype, hq, hkv, d, with_norm):
    check_qkv_prologue(11, hq, hkv, d, dtype, with_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [64, 100, 1500])
def test_silu_and_mul(dtype, intermediate):
    t = 5
    x = (2 * torch.randn(t, 2 * intermediate + 6, device=DEV)).to(dtype)[:, : 2 * intermediate]
    out = silu_and_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < TOL[dtype]  # the fp32 value
    same_dtype = ref.silu_and_mul_ref(x)  # torch's own rounding in x's dtype
    if dtype == torch.float16 or (dtype == torch.bfloat16 and ROUNDS_BF16):
        # The same two roundings as torch: only an exp that differs in its last fp32 bit can flip one.
        assert (out != same_dtype).float().mean().item() < 0.02


def check_skinny_gemm(m, n, k, dtype, with_bias, tol, **tiles):
    """skinny_gemm against the fp32 reference on fresh inputs, x a row-strided view, out poisoned."""
    x = torch.randn(m, k + 8, device=DEV).to(dtype)[:, 3 : k + 3]
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)  # unit-scale outputs
    bias = torch.randn(n, device=DEV).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    got = skinny_gemm(x, w, bias, out=out, **tiles)
    assert got is out and rel_err(out, ref.skinny_gemm_ref(x, w, bias)) < tol
    return x, w, bias, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(37, 100), (64, 256)])  # odd sizes (K and N tails), block multiples
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("use_dot", [False, True])
def test_skinny_gemm(dtype, m, n, k, with_bias, use_dot):
    if dtype == torch.bfloat16 and use_dot and not torch.cuda.is_available():
        pytest.skip("the interpreter cannot tl.dot bf16")
    check_skinny_gemm(m, n, k, dtype, with_bias, TOL[dtype], use_dot=use_dot)


@pytest.mark.parametrize("use_dot,block_n,block_k,num_stages", [
    (False, 4, 32, 3),  # many programs, N tail, several K steps with a K tail
    (False, 8, 128, 2),
    (True, 16, 32, 4),
    (True, 32, 64, 1),
])
@pytest.mark.parametrize("m,n,k", [(5, 37, 100), (16, 64, 256), (37, 40, 96), (70, 40, 96)])  # 70: two M tiles
def test_skinny_gemm_tiles(use_dot, block_n, block_k, num_stages, m, n, k):
    """The tiles a GPU launch picks (on a CPU the launcher takes the largest): small BLOCK_N, K loops."""
    check_skinny_gemm(m, n, k, torch.float32, True, TOL[torch.float32], use_dot=use_dot, block_n=block_n,
                      block_k=block_k, num_stages=num_stages)


def test_skinny_gemm_in_linear_layers(monkeypatch):
    """With fused kernels on, linear layers send 1..SKINNY_MAX_ROWS rows through skinny_gemm; results equal
    F.linear's."""
    from nanoplane import kernels
    from nanoplane.models.layers import linear
    from nanoplane.models.layers.fused import enable_fused_kernels, fused_kernels_enabled
    from nanoplane.models.layers.linear import QKVParallelLinear, RowParallelLinear

    monkeypatch.setattr(linear, "SKINNY_MAX_ROWS", 16)  # the default is tuned on a GPU; this tests the routing
    calls = []
    monkeypatch.setattr(kernels, "skinny_gemm", lambda *a: calls.append(a[0].shape[0]) or skinny_gemm(*a))
    qkv, row = QKVParallelLinear(64, 16, 4, 2, bias=True), RowParallelLinear(64, 48, bias=True)
    for layer in (qkv, row):
        for p in layer.parameters():
            p.data.normal_()
        layer.to(DEV)
    before = fused_kernels_enabled()
    enable_fused_kernels(True)
    try:
        for t in (1, 16, 17):
            x = torch.randn(t, 64, device=DEV)
            for layer in (qkv, row):
                expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
                assert rel_err(layer(x), expected) < TOL[torch.float32]
    finally:
        enable_fused_kernels(before)
    assert calls == [1, 1, 16, 16]  # 17 rows stay on F.linear





@gpu
@pytest.mark.gpu
def test_norm_rotary_store_gpu():
    t, hidden, hq, hkv, d = 4096, 4096, 32, 8, 128
    x, res = (torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(hidden, device=DEV, dtype=torch.bfloat16)
    out, new_res = rms_norm(x, w, 1e-6, res)
    exp_out, exp_res = ref.rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(new_res, exp_res) and rel_err(out, exp_out) < 4e-3
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), torch.rand(d // 2, device=DEV))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q = torch.randn(t, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    eq, ek = ref.apply_rotary_ref(q, k, pos, cos_sin)
    apply_rotary(q, k, pos, cos_sin)
    assert rel_err(q, eq) < 4e-3 and rel_err(k, ek) < 4e-3
    k_cache, v_cache, _ = paged_cache([t], 16, hkv, d, torch.bfloat16)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEV)[:t]
    store_kvcache(k, k, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], k)


@gpu
@pytest.mark.gpu
def test_qkv_prologue_and_silu_gpu():
    check_qkv_prologue(4096, 16, 8, 128, torch.bfloat16, True, page=256, tol=4e-3)
    x = torch.randn(4096, 2 * 3072, device=DEV, dtype=torch.bfloat16)
    out = silu_and_mul(x)
    assert torch.equal(out, ref.silu_and_mul_ref(x)) or (out != ref.silu_and_mul_ref(x)).float().mean() < 0.001


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024),  # Qwen3-0.6B
                                 (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096),  # Qwen3-8B
                                 (4096, 3072), (2048, 4096)])  # a TP=2 rank's 8B qkv and o_proj
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40, 64, 256])  # 256: four row tiles (NANOPLANE_SKINNY_MAX_ROWS=256)
def test_skinny_gemm_gpu(k, n, m):
    """bf16 at the real decode shapes, both inner products, in and out of a CUDA graph."""
    dtype = torch.bfloat16
    for use_dot in (None, False, True):
        x, w, bias, out = check_skinny_gemm(m, n, k, dtype, use_dot is None, 4e-3, use_dot=use_dot)
        again = skinny_gemm(x, w, bias, use_dot=use_dot)
        assert torch.equal(again, out)  # one program per output: no order that could vary between runs
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    skinny_gemm(x, w)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_gemm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref.skinny_gemm_ref(x, w)) < 4e-3
