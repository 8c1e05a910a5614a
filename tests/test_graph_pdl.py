"""Programmatic edges into cuBLAS kernels (dataplane/graph_pdl.py): which edges are rewired (CPU), and
on a GPU that the wait check catches a kernel that does not wait, passes cuBLAS's GEMMs, and that the
rewired decode graphs give the tokens of plain ones."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dataplane.graph_pdl import Edge, full_kernel_edges

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


def _pdl_device() -> torch.device:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or later")
    return torch.device("cuda", 0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [1, 128, 256])
def test_check_catches_a_kernel_that_does_not_wait(rows):
    """torch's elementwise kernels have no griddepcontrol.wait: started early they read the stale input."""
    from dataplane.graph_pdl import check

    entered, good = check(lambda x, y: x * 2, rows, 1024, 1024, torch.bfloat16, _pdl_device())
    assert entered and not good



@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [80, 128, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (151936, 1024)])
def test_cublas_gemms_wait(rows, n, k):
    """The GEMMs a Qwen3-0.6B decode step runs above 64 rows wait for their predecessor under PDL, as a
    new tensor and added into one (the projections folded into the residual)."""
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

