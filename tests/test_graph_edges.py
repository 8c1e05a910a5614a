"""Programmatic edges in a captured graph (benchmarks/graph_edges.py): which edges `rewire` changes (CPU);
on a GPU, that its check fails kernels that touch memory before their wait, passes one that waits
first, and fails cuBLAS's GEMMs, the reason the decode graphs keep full edges into them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.graph_edges import Edge, check, doubling, full_kernel_edges
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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("kernel", [_reads_before_wait, _writes_before_wait])
def test_the_check_fails_a_kernel_that_touches_memory_before_its_wait(kernel, pdl):
    """Launched plainly on an edge the check made programmatic, or with the PDL attribute, such a
    kernel starts while the producer spins and reads its stale input, or clears the buffer the
    producer has yet to read."""
    entered, good = check(doubling(kernel, pdl), 128, 1024, 1024, torch.bfloat16, _pdl_device())
    assert entered == (set() if pdl else {kernel.fn.__name__})  # with the attribute it was programmatic already
    assert not good


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rows", [1, 128])
def test_the_check_passes_a_kernel_that_waits_before_touching_memory(rows, pdl):
    _, good = check(doubling(pdl=pdl), rows, 1024, 1024, torch.bfloat16, _pdl_device())
    assert good


@pytest.mark.gpu
@gpu
def test_the_check_fails_a_torch_kernel_without_any_wait():
    entered, good = check(lambda x, y: x * 2, 128, 1024, 1024, torch.bfloat16, _pdl_device())
    assert entered and not good


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [80, 128, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (6144, 1024)])
def test_cublas_gemms_read_their_input_before_it_is_written_on_a_programmatic_edge(rows, n, k):
    """Why the decode graphs keep full edges into cuBLAS: the GEMMs a Qwen3-0.6B decode step runs above
    64 rows, as a new tensor and added into one, start early and compute on stale input. A cuBLAS
    whose kernels waited would fail this test, and programmatic edges into them would be worth
    another look (the racy version ran the bench 1.9-2.6% faster on an H200)."""
    device = _pdl_device()
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    for gemm in (lambda x, y: F.linear(x, w), lambda x, y: y.addmm_(x, w.t())):
        entered, good = check(gemm, rows, k, n, torch.bfloat16, device)
        assert entered
        assert not good, entered
