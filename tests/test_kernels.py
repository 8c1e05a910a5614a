"""Triton kernels against their fp32 torch references (kernels/reference.py).

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

import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

import kernels.decode_attention as decode_module  # noqa: E402
import kernels.prefill_attention as prefill_attention  # noqa: E402
from kernels import (  # noqa: E402
    apply_rotary,
    paged_decode_attention,
    paged_prefill_attention,
    qkv_prologue,
    rms_norm,
    silu_and_mul,
    skinny_gemm,
    store_kvcache,
)
from kernels import reference as ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (q heads, kv heads, head_dim): MHA, GQA 2 and 4, SmolLM2's 9/3; plus non-power-of-two D.
HEADS = [(4, 4, 64), (4, 2, 128), (8, 2, 64), (9, 3, 64), (2, 1, 80)]
DTYPES = [torch.float32, torch.float16]  # the interpreter cannot tl.dot bf16 (GPU cases cover it)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The interpreter truncates fp32 -> bf16 instead of rounding to nearest even (triton 3.9), so
# bit-exactness with torch's bf16 rounding is only checked on a GPU.
ROUNDS_BF16 = os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh inputs for every case, yet reproducible: seed from the test id.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page,hkv,d,slot_dtype", [(16, 3, 64, torch.int32), (256, 2, 128, torch.int64),
                                                   (32, 1, 80, torch.int64)])
def test_store_kvcache(dtype, page, hkv, d, slot_dtype):
    n, num_blocks = 13, 3
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    # Key and value as strided views of one fused buffer, as the QKV projection produces them.
    fused = torch.randn(n, 2 * hkv + 1, d, device=DEV).to(dtype)
    key, value = fused[:, :hkv], fused[:, hkv : 2 * hkv]
    slots = torch.randperm(num_blocks * page, device=DEV)[:n].to(slot_dtype)
    slots[[0, 5, n - 1]] = -1
    store_kvcache(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots[keep]], key[keep]) and torch.equal(flat_v[slots[keep]], value[keep])
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("page,ctx_lens,num_splits", [
    (16, [1, 37, 0, 130, 65], None),
    (32, [200, 1, 63], 3),
    (256, [0, 300, 7], 2),
    (64, [129, 5], 1),
])
def test_decode(dtype, hq, hkv, d, page, ctx_lens, num_splits, monkeypatch):
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    q = torch.randn(len(ctx_lens), hq + 2, d, device=DEV).to(dtype)[:, 1 : hq + 1]  # strided view
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    poisoned = lambda shape, device: torch.full(shape, float("nan"), device=device)
    monkeypatch.setattr(decode_module, "_workspace", poisoned)
    scale = d**-0.5
    paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), scale, out=out, num_splits=num_splits)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), scale)
    assert rel_err(out, expected) < TOL[dtype]
    for b, n in enumerate(ctx_lens):
        if n == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("heads_fastest", [True, False])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_seq_order(heads_fastest, num_splits):
    """Rows handed to programs in a given order (longest context first, or any permutation) land in
    their own output rows; the result does not depend on the order."""
    ctx_lens = [5, 300, 0, 64, 129, 1]
    k_cache, v_cache, tables = paged_cache(ctx_lens, 16, 2, 64, torch.float32)
    q = torch.randn(len(ctx_lens), 4, 64, device=DEV)
    lens = i32(ctx_lens)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    for order in (torch.argsort(lens, descending=True, stable=True).int(), i32([2, 0, 5, 1, 4, 3])):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out, num_splits=num_splits,
                               seq_order=order, tuning=dict(heads_fastest=heads_fastest))
        assert rel_err(out, expected) < TOL[torch.float32]
        assert (out[2] == 0).all()


def test_longest_first():
    from dataplane.cuda_graphs import longest_first

    order = longest_first(np.array([3, 9, 0, 9, 4], dtype=np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 4, 0, 2]  # ties keep row order


@pytest.mark.parametrize("tuning", [dict(heads_fastest=False), dict(block_n=32, heads_fastest=True),
                                    dict(block_n=128, num_warps=8, num_stages=3)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_alternatives(tuning, num_splits):
    """The benchmark's sweep alternatives (grid order, tile) compute the same attention."""
    ctx_lens = [70, 0, 300, 1]
    k_cache, v_cache, tables = paged_cache(ctx_lens, 16, 4, 64, torch.float32)
    q = torch.randn(len(ctx_lens), 8, 64, device=DEV)
    out = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), 0.125, num_splits=num_splits,
                                 tuning=tuning)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), 0.125)
    assert rel_err(out, expected) < TOL[torch.float32]
    assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("page,q_lens,ctx_lens", [
    (16, [37, 1, 70], [37, 1, 70]),  # plain prefill, odd lengths
    (32, [5, 0, 33, 1], [69, 3, 33, 17]),  # cached prefixes, an empty chunk, a decode-like row
    (256, [20, 9], [300, 9]),
])
def test_prefill(dtype, hq, hkv, d, page, q_lens, ctx_lens):
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), hq, d + 16, device=DEV).to(dtype)[..., :d]  # strided view
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    scale = d**-0.5
    args = (cu, i32(ctx_lens), tables, max(q_lens) + 3, scale)  # max_seqlen_q is an upper bound
    paged_prefill_attention(q, k_cache, v_cache, *args, out=out)
    expected = ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("page", [16, 128])  # key tiles across pages, and inside one page
@pytest.mark.parametrize("tuning", [prefill_attention.TUNING, prefill_attention.LONG_TUNING,
                                    dict(block_m=128, block_n=32, num_warps=8, num_stages=2),
                                    dict(block_m=64, block_n=64, num_warps=4, num_stages=2)])
def test_prefill_launch_alternatives(tuning, page):
    """The sweep's tiles (short and long prompts' included) compute the same attention: tiles wider
    than a sequence, a diagonal inside one key tile, a prefix ending mid-tile."""
    q_lens, ctx_lens = [37, 1, 130], [37, 200, 300]
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, 4, 64, torch.float32)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), 8, 64, device=DEV)
    args = (cu, i32(ctx_lens), tables, max(q_lens), 0.125)
    out = paged_prefill_attention(q, k_cache, v_cache, *args, tuning=tuning)
    assert rel_err(out, ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)) < TOL[torch.float32]


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128)])
def test_chunked_prefill_matches_one_shot(hq, hkv, d):
    """Store + attend chunk by chunk through the cache == causal attention over the whole prompt."""
    page, length, chunks = 16, 90, [40, 1, 31, 18]
    k_cache, v_cache, tables = paged_cache([length], page, hkv, d, torch.float32)
    q, k, v = (torch.randn(length, h, d, device=DEV) for h in (hq, hkv, hkv))
    pos = torch.arange(length, device=DEV)
    slots = tables[0, pos // page].long() * page + pos % page
    outs, done = [], 0
    for c in chunks:
        store_kvcache(k[done : done + c], v[done : done + c], k_cache, v_cache, slots[done : done + c])
        done += c
        outs.append(paged_prefill_attention(q[done - c : done], k_cache, v_cache, i32([0, c]), i32([done]),
                                            tables, c, d**-0.5))
    expected = ref.causal_attention(q, k, v, pos, d**-0.5)
    assert rel_err(torch.cat(outs), expected) < TOL[torch.float32]


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


def rope_cache(d: int, max_pos: int = 4096) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def check_qkv_prologue(t, hq, hkv, d, dtype, with_norm, page=16, tol=None, qkv=None, rows=None):
    """`rows` (with the `qkv` they project to): the row scale of a folded norm (tests/test_norm_fold.py)."""
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
    import kernels
    from models.layers import linear
    from models.layers.fused import enable_fused_kernels, fused_kernels_enabled
    from models.layers.linear import QKVParallelLinear, RowParallelLinear

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


# ---- real shapes, GPU only ------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_ctx,page", [(256, 1024, 16), (256, 1024, 256), (2, 32768, 16)])
def test_decode_gpu(batch, max_ctx, page):
    hq, hkv, d, dtype = 16, 8, 128, torch.bfloat16
    ctx_lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    ctx_lens[0] = max_ctx
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5)
    expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5)
    assert rel_err(out, expected) < TOL[dtype]
    # Longest context first, followed from the threshold's batch sizes up (256 rows are past it).
    order = torch.argsort(i32(ctx_lens), descending=True, stable=True).int()
    ordered = paged_decode_attention(q, k_cache, v_cache, tables, i32(ctx_lens), d**-0.5, seq_order=order)
    assert torch.equal(ordered, out)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])  # the GPU's default KV block is 256 tokens
@pytest.mark.parametrize("q_lens,ctx_lens,hq,dtype", [
    ([4096], [4096], 16, torch.bfloat16),  # long-prompt tiles (LONG_TUNING)
    ([1000, 1, 2048, 1047], [1500, 700, 2048, 3000], 16, torch.bfloat16),
    ([1000, 1, 2048, 1047], [1500, 700, 2048, 3000], 32, torch.bfloat16),  # GQA 4, Qwen3-8B's heads
    ([2048, 300], [2048, 3000], 16, torch.float32),  # long, but fp32 keeps the short tiles' shared memory
    ([100, 1023, 1, 517], [100, 1500, 900, 517], 16, torch.bfloat16),  # short prompts (TUNING)
])
def test_prefill_gpu(q_lens, ctx_lens, hq, dtype, page):
    hkv, d = 8, 128
    k_cache, v_cache, tables = paged_cache(ctx_lens, page, hkv, d, dtype)
    cu = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
    args = (cu, i32(ctx_lens), tables, max(q_lens), d**-0.5)
    out = paged_prefill_attention(q, k_cache, v_cache, *args)
    assert rel_err(out, ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args)) < TOL[dtype]


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
