"""Programmatic edges into cuBLAS kernels (dataplane/graph_pdl.py): which edges are rewired and which GEMMs
are checked (CPU); on a GPU, that a plainly launched kernel is not run ahead of its producer on a
rewired edge, that the check fails kernels started early that touch memory before their wait and
passes cuBLAS's GEMMs, and that the rewired decode graphs give the tokens of plain ones."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dataplane.graph_pdl import Edge, full_kernel_edges
from kernels.pdl import gdc_wait

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_only_full_edges_between_kernels_into_accepted_kernels_are_chosen():
    es = [Edge(1, 2, "_attention", "nvjet_a", programmatic=False),   # chosen
          Edge(2, 3, "nvjet_a", "_silu", programmatic=True),         # already programmatic
          Edge(3, 4, "_silu", "nvjet_b", programmatic=False),        # chosen
          Edge(5, 4, None, "nvjet_b", programmatic=False),           # from a copy node: no trigger to wait on
          Edge(4, 6, "nvjet_b", "elementwise", programmatic=False),  # into a kernel not accepted
          Edge(6, 7, "elementwise", None, programmatic=False)]       # into a copy node
    chosen = full_kernel_edges(es, lambda name: name.startswith("nvjet"))
    assert [(e.src, e.dst) for e in chosen] == [(1, 2), (3, 4)]


def test_decode_gemms_are_every_projection_and_the_head_through_the_models_calls():
    """The check runs each library GEMM a decode graph may run: one per weight shape and call (a new
    tensor, or added into the residual by the row-parallel projections), the LM head included."""
    from transformers import Qwen3Config

    from dataplane.graph_pdl import decode_gemms
    from models.qwen3 import Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True)  # one (300, 64) weight: the head is the embedding
    model = Qwen3ForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    gemms = decode_gemms(model)
    # qkv, o_proj (new and added), gate_up, down (new and added), the head: layer 2 repeats layer 1's shapes
    assert sorted((k, n) for _, k, n in gemms) == sorted([(64, 128), (64, 64), (64, 64), (64, 192), (96, 64),
                                                        (96, 64), (64, 300)])
    weights = {tuple(p.shape[::-1]) for p in model.parameters() if p.dim() == 2}
    added = 0
    for gemm, k, n in gemms:
        assert (k, n) in weights
        x, y = torch.randn(3, k), torch.randn(3, n)
        y0 = y.clone()
        out = gemm(x, y)
        w = next(p for p in model.parameters() if tuple(p.shape) == (n, k))
        added += out is y
        base = y0 if out is y else torch.zeros_like(y0)
        torch.testing.assert_close(out, base + x @ w.t(), rtol=1e-5, atol=1e-5)
    assert added == 2  # o_proj and down_proj into the residual


def _pdl_device() -> torch.device:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or later")
    return torch.device("cuda", 0)


@triton.jit
def _reads_before_wait(x_ptr, o_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    gdc_wait()
    tl.store(o_ptr + offs, x * 2, mask=offs < n)


@triton.jit
def _writes_before_wait(x_ptr, o_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], tl.float32).to(y_ptr.dtype.element_ty), mask=offs < n)
    gdc_wait()
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@triton.jit
def _waits_first(x_ptr, o_ptr, y_ptr, n, BLOCK: tl.constexpr):
    gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], tl.float32).to(y_ptr.dtype.element_ty), mask=offs < n)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _launch(kernel, pdl: bool = False):
    """gemm(x, y) for the check: `kernel` doubles x into a new tensor (and may clear y). Launched plainly,
    the check's rewiring makes its edge programmatic; with `pdl`, its own launch attribute does."""
    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch = {"launch_pdl": True} if pdl else {}
        kernel[(triton.cdiv(x.numel(), 1024),)](x, out, y, x.numel(), BLOCK=1024, **launch)
        return out
    return run


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 128])
@pytest.mark.parametrize("kernel", [_reads_before_wait, _writes_before_wait, _waits_first])
def test_a_plainly_launched_kernel_is_not_run_ahead_of_its_producer_on_a_rewired_edge(kernel, rows):
    """What makes rewiring safe whatever a library kernel does: on the H200, a kernel launched without
    the PDL attribute whose edge was made programmatic afterwards does not run ahead of its producer,
    even one that reads, or writes, before its wait. (The rewired edges' speed-up suggests their
    grids are still launched early: BENCHMARKS.md, twenty-first session.) A driver that did run it ahead
    would fail this test, and the check would keep such kernels off the rewired list."""
    from dataplane.graph_pdl import check

    entered, good = check(_launch(kernel), rows, 1024, 1024, torch.bfloat16, _pdl_device())
    assert entered == {kernel.fn.__name__} and good


@pytest.mark.gpu
@gpu
def test_a_torch_kernel_without_any_wait_passes():
    from dataplane.graph_pdl import check

    entered, good = check(lambda x, y: x * 2, 128, 1024, 1024, torch.bfloat16, _pdl_device())
    assert entered and good


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kernel", [_reads_before_wait, _writes_before_wait])
def test_check_fails_a_kernel_started_early_that_touches_memory_before_its_wait(kernel):
    """The check can fail: launched with the PDL attribute, the same kernels do start while the producer
    spins, and read its stale input or clear the buffer it has yet to read."""
    from dataplane.graph_pdl import check

    entered, good = check(_launch(kernel, pdl=True), 128, 1024, 1024, torch.bfloat16, _pdl_device())
    assert not entered and not good


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [80, 128, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (6144, 1024)])
def test_cublas_gemms_pass_the_check(rows, n, k):
    """The GEMMs a Qwen3-0.6B decode step runs above 64 rows, as a new tensor and added into one (the
    projections folded into the residual), pass the check on an edge the check rewired."""
    from dataplane.graph_pdl import check

    device = _pdl_device()
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    for gemm in (lambda x, y: F.linear(x, w), lambda x, y: y.addmm_(x, w.t())):
        entered, good = check(gemm, rows, k, n, torch.bfloat16, device)
        assert entered and good, entered


@pytest.mark.gpu
@gpu
def test_rewired_decode_graphs_give_the_plain_graphs_tokens(tiny_models, monkeypatch):
    """Decode steps of up to 128 rows (cuBLAS above 64) through graphs with and without the rewired edges."""
    from controlplane import LLM, SamplingParams

    _pdl_device()
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 380) for _ in range(rng.randrange(1, 60))] for _ in range(120)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runs, edges = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("NANOPLANE_GRAPH_PDL", flag)
        llm = LLM(str(tiny_models["qwen3"]), device="cuda", dtype="bfloat16", attention_backend="triton",
                  max_num_seqs=128, kvcache_block_size=16, num_kvcache_blocks=512)
        try:
            edges[flag] = llm.engine.data_plane.runner.graphs.programmatic_edges
            runs[flag] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert edges["1"] > 0 and edges["0"] == 0
    assert runs["1"] == runs["0"]

