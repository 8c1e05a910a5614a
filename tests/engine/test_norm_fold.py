"""Norms folded into the projections after them (models/norm_fold.py).

The kernels' row scale and the projection that adds itself to the residual stream, against their
fp32 torch twins on fresh inputs (interpreter on a CPU, real shapes on a GPU); the fold's own
rules; and a folded model's logits against the same weights unfolded. The whole engine, folded,
against transformers' tokens: tests/engine/test_engine_correctness.py (backend "triton").
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads (see tests/kernels/test_layer_kernels.py)

import zlib  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from support.kernel_checks import (  # noqa: E402
    DEV,
    TOL,
    check_qkv_prologue,  # noqa: E402
    rel_err,
)

from nanoplane.kernels import reference as ref  # noqa: E402
from nanoplane.kernels import silu_and_mul, skinny_gemm  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-6


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def residual_rows(t: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Un-normalised rows, each at its own scale (as a residual stream grows over the layers); a
    row-strided view."""
    scale = torch.exp(2 * torch.randn(t, 1, device=DEV))
    return (scale * torch.randn(t, hidden + 5, device=DEV)).to(dtype)[:, :hidden]


def projection_of(rows: torch.Tensor, width: int) -> torch.Tensor:
    """Random outputs of a projection of `rows`: at each row's own scale, as the projection of an
    un-normalised row is (the kernels scale them back to unit size)."""
    rms = rows.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (2 * rms * torch.randn(rows.shape[0], width, device=DEV)).to(rows.dtype)


def check_prologue(t: int, hq: int, hkv: int, d: int, hidden: int, dtype: torch.dtype, tol: float,
                   page: int = 16) -> None:
    rows = residual_rows(t, hidden, dtype)
    check_qkv_prologue(t, hq, hkv, d, dtype, True, page, tol, qkv=projection_of(rows, (hq + 2 * hkv) * d), rows=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,hidden", [(4, 2, 64, 64), (9, 3, 64, 100), (2, 1, 80, 48)])
def test_qkv_prologue_scales_by_the_rows_rms(dtype, hq, hkv, d, hidden):
    check_prologue(7, hq, hkv, d, hidden, dtype, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("intermediate,hidden", [(64, 64), (100, 37)])
def test_silu_and_mul_scales_by_the_rows_rms(dtype, intermediate, hidden):
    t = 5
    rows = residual_rows(t, hidden, dtype)
    x = projection_of(rows, 2 * intermediate)
    out = silu_and_mul(x, row_norm=(rows, EPS))
    inv_rms = torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + EPS)
    gate, up = (x.float() * inv_rms).chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < TOL[dtype]  # the fp32 value
    assert rel_err(out, ref.silu_and_mul_ref(x, row_norm=(rows, EPS))) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 37])
@pytest.mark.parametrize("use_dot", [False, True])
def test_skinny_gemm_adds_to_the_residual(dtype, m, use_dot):
    n, k = 37, 100
    x = torch.randn(m, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    residual = (4 * torch.randn(m, n, device=DEV)).to(dtype)
    expected = residual.float() + ref.skinny_gemm_ref(x, w)
    out = residual.clone()
    assert skinny_gemm(x, w, out=out, accumulate=True, use_dot=use_dot) is out
    assert rel_err(out, expected) < TOL[dtype]
    with pytest.raises(AssertionError, match="accumulate needs"):
        skinny_gemm(x, w, accumulate=True)


# ---- the fold on a model -----------------------------------------------------------------------


def tiny_qwen3(bias: bool = False):
    """A two-layer Qwen3 of random weights, norm weights not ones, as the data plane builds it."""
    from transformers import Qwen3Config

    from nanoplane.models.qwen3 import Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         max_position_embeddings=256, attention_bias=bias)
    with torch.device(DEV):
        model = Qwen3ForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.08) if p.dim() == 2 else p.data.uniform_(0.5, 1.5)
    return model


@pytest.fixture
def fused():
    from nanoplane.models.layers.fused import enable_fused_kernels, fused_kernels_enabled

    before = fused_kernels_enabled()
    enable_fused_kernels(True)
    yield
    enable_fused_kernels(before)


def test_fold_applies_only_where_it_can(fused):
    from nanoplane.models.layers.fused import enable_fused_kernels
    from nanoplane.models.norm_fold import fold_norms, foldable, folded

    assert foldable(tiny_qwen3()) and not foldable(tiny_qwen3(bias=True))
    assert not foldable(tiny_qwen3().half())  # fp16 could overflow on the un-normalised rows
    assert not foldable(tiny_qwen3(), enabled=False)
    model = tiny_qwen3()
    assert not fold_norms(model, enabled=False) and not folded(model)
    enable_fused_kernels(False)  # the torch path (CPU default) runs the plain norms
    assert not foldable(tiny_qwen3())
    enable_fused_kernels(True)
    weight = model.model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    norm = model.model.layers[0].post_attention_layernorm.weight.detach()
    assert fold_norms(model) and folded(model)
    assert torch.allclose(model.model.layers[0].mlp.gate_up_proj.weight, weight * norm[None, :])
    assert not fold_norms(model)  # once only
    layer = model.model.layers[1]
    assert layer.input_layernorm.folded and layer.post_attention_layernorm.folded and not model.model.norm.folded
    assert layer.self_attn.o_proj.adds_to_residual and layer.mlp.down_proj.adds_to_residual
    assert layer.self_attn.qkv_proj.folded_norm_eps == layer.input_layernorm.eps


def test_only_a_lone_bias_free_projection_adds_to_the_residual():
    from nanoplane.models.layers.linear import RowParallelLinear

    with pytest.raises(ValueError, match="bias-free"):
        RowParallelLinear(8, 4, bias=True).add_to_residual()
    proj = RowParallelLinear(8, 4)
    proj.weight.data.normal_()
    x, residual = torch.randn(3, 8), torch.randn(3, 4)
    expected = residual + x @ proj.weight.T
    proj.add_to_residual()
    assert proj(x, residual=residual) is None
    assert torch.allclose(residual, expected, atol=1e-6)


def test_a_folded_norm_hands_the_stream_on():
    from nanoplane.models.layers.layernorm import RMSNorm

    norm = RMSNorm(8)
    stream = torch.randn(3, 8)
    normed, residual = norm(None, stream)  # unfolded: the stream normed
    assert residual is stream and not torch.equal(normed, stream)
    norm.folded = True
    assert norm(None, stream) == (stream, stream)
    with pytest.raises(ValueError, match="folded norm"):
        norm(torch.randn(3, 8), stream)


@pytest.mark.parametrize("skinny_max_rows", [64, 0])  # 0: the residual adds through Tensor.addmm_ (cuBLAS above 64)
def test_folded_model_gives_the_unfolded_logits(fused, monkeypatch, skinny_max_rows):
    """Prefill of two sequences through the fused path, then one decode step each, folded and not:
    the same logits in fp32 (the rounding moves, nothing else)."""
    import copy

    from nanoplane.models.attention_backend import set_backend
    from nanoplane.models.context import AttentionContext, reset_context, set_context
    from nanoplane.models.layers import linear
    from nanoplane.models.norm_fold import fold_norms

    monkeypatch.setattr(linear, "SKINNY_MAX_ROWS", skinny_max_rows)  # the setter's global, restored after
    set_backend("triton")
    plain = tiny_qwen3()
    folded = copy.deepcopy(plain)
    assert fold_norms(folded)
    lens = [5, 9]
    ids = torch.randint(0, 300, (sum(lens),), device=DEV)
    positions = torch.cat([torch.arange(n, device=DEV) for n in lens])
    block = 16
    tables = torch.tensor([[0], [1]], dtype=torch.int32, device=DEV)
    slots = torch.cat([torch.arange(n, device=DEV) + i * block for i, n in enumerate(lens)])
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=DEV)
    logits = []
    try:
        for model in (plain, folded):
            for layer in model.model.layers:
                layer.self_attn.attn.k_cache = torch.zeros(2, block, 2, 16, device=DEV)
                layer.self_attn.attn.v_cache = torch.zeros(2, block, 2, 16, device=DEV)
            set_context(AttentionContext(slot_mapping=slots, cu_seqlens_q=cu, max_seqlen_q=max(lens),
                                         context_lens=torch.tensor(lens, dtype=torch.int32, device=DEV),
                                         max_context_len=max(lens), block_tables=tables))
            with torch.no_grad():
                prefill = model.compute_logits(model(ids, positions)[cu[1:] - 1])
            step = torch.tensor(lens, device=DEV)  # each sequence's next position
            set_context(AttentionContext(is_decode=True, slot_mapping=step + torch.tensor([0, block], device=DEV),
                                         cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV),
                                         max_seqlen_q=1, context_lens=(step + 1).to(torch.int32),
                                         max_context_len=max(lens) + 1, block_tables=tables))
            with torch.no_grad():
                decode = model.compute_logits(model(prefill.argmax(-1), step))
            logits.append((prefill, decode))
    finally:
        reset_context()
        set_backend("torch")  # the default every other test expects
    for plain_logits, folded_logits in zip(*logits, strict=True):
        assert rel_err(folded_logits, plain_logits) < 1e-5


def test_a_folded_layer_runs_no_norm_kernel(fused, monkeypatch):
    """Per layer: QKV, the prologue with the row scale, attention, o_proj adding to the stream, gate-up,
    silu * mul with the row scale, down adding to the stream; one norm kernel, the final one."""
    from nanoplane import kernels
    from nanoplane.models.attention_backend import set_backend
    from nanoplane.models.context import AttentionContext, reset_context, set_context
    from nanoplane.models.norm_fold import fold_norms

    calls = []  # (kernel, whether it applies a row scale (a tuple argument) or adds to its output)

    def recorder(name, fn):
        def record(*args, **kwargs):
            tupled = any(isinstance(a, tuple) for a in (*args, *kwargs.values()))
            calls.append((name, bool(kwargs.get("accumulate")) or tupled))
            return fn(*args, **kwargs)
        return record

    for name in ("rms_norm", "skinny_gemm", "qkv_prologue", "silu_and_mul", "paged_prefill_attention"):
        monkeypatch.setattr(kernels, name, recorder(name, getattr(kernels, name)))
    set_backend("triton")
    model = tiny_qwen3()
    assert fold_norms(model)
    t = 6
    for layer in model.model.layers:
        layer.self_attn.attn.k_cache = torch.zeros(1, 16, 2, 16, device=DEV)
        layer.self_attn.attn.v_cache = torch.zeros(1, 16, 2, 16, device=DEV)
    set_context(AttentionContext(slot_mapping=torch.arange(t, device=DEV),
                                 cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=DEV), max_seqlen_q=t,
                                 context_lens=torch.tensor([t], dtype=torch.int32, device=DEV), max_context_len=t,
                                 block_tables=torch.tensor([[0]], dtype=torch.int32, device=DEV)))
    try:
        with torch.no_grad():
            model(torch.randint(0, 300, (t,), device=DEV), torch.arange(t, device=DEV))
    finally:
        reset_context()
        set_backend("torch")
    layer = [("skinny_gemm", False), ("qkv_prologue", True), ("paged_prefill_attention", False),
             ("skinny_gemm", True), ("skinny_gemm", False), ("silu_and_mul", True), ("skinny_gemm", True)]
    assert calls == layer * 2 + [("rms_norm", False)]


@gpu
@pytest.mark.gpu
def test_row_norm_kernels_gpu():
    """bf16 at Qwen3-0.6B's shapes: a 4096-token prefill's prologue and activation, and the
    residual-adding projection at decode rows."""
    check_prologue(4096, 16, 8, 128, 1024, torch.bfloat16, 4e-3, page=256)
    rows = residual_rows(4096, 1024, torch.bfloat16)
    x = projection_of(rows, 2 * 3072)
    assert rel_err(silu_and_mul(x, row_norm=(rows, EPS)), ref.silu_and_mul_ref(x, row_norm=(rows, EPS))) < 4e-3
    for m in (1, 16, 64):
        x = torch.randn(m, 3072, device=DEV, dtype=torch.bfloat16)
        w = (torch.randn(1024, 3072, device=DEV) / 3072**0.5).to(torch.bfloat16)
        residual = (4 * torch.randn(m, 1024, device=DEV)).to(torch.bfloat16)
        expected = residual.float() + ref.skinny_gemm_ref(x, w)
        assert rel_err(skinny_gemm(x, w, out=residual, accumulate=True), expected) < 4e-3
