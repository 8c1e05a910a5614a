"""Programmatic edges into cuBLAS's kernels in the decode graphs (Hopper and later).

Our Triton kernels take part in programmatic dependent launch (kernels/pdl.py): each is launched
with the PDL attribute, so in a captured graph the edge into it is programmatic and its grid is
launched while its predecessor drains. torch launches cuBLAS without that attribute, so every edge
into a GEMM is a full one: above 64 rows a decode layer's four GEMMs each wait for the previous
kernel to retire before their grid is even launched. Programmatic edges into them took 1.9-2.6%
off the bench's run.

Two things keep a rewired edge from handing a GEMM unfinished data. Measured on the H200
(tests/test_graph_pdl.py): a kernel launched without the PDL attribute whose edge was made
programmatic afterwards is not run ahead of its producer, not even one that reads before its
`griddepcontrol.wait`. The gain (~1 µs an edge; BENCHMARKS.md, twenty-first session) is then most
likely the grid's launch, done while the producer still runs. And in case a driver did run such
kernels early, `waiting_kernels` checks every GEMM the graphs will run (each weight shape at each
batch size, through the calls the model makes) behind a slow producer that lets dependents launch
at once and only then writes the GEMM's input and reads the buffer the GEMM writes: a kernel that
read its input, or wrote, too early gives a wrong result, and only kernels that passed are rewired.
`rewire` changes each graph, captured with `keep_graph=True`, before it is instantiated.
`NANOPLANE_GRAPH_PDL=0` turns it off; it is off wherever PDL is (kernels/pdl.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_enabled, pdl_prologue

log = logging.getLogger(__name__)

_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the upstream kernel's trigger
# Iterations of the producer's dependent multiply-add chain: at a few cycles each some tens of
# microseconds (estimated, not timed), several times a GEMM's run, so a GEMM that read too early
# has long finished on the stale input.
_SPIN = 25_000


class _EdgeData(ctypes.Structure):
    # CUgraphEdgeData: the port the edge leaves its upstream node from, the port it enters, its type.
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):
    # CUDA_KERNEL_NODE_PARAMS_v2; only func / kern are read, to name the kernel.
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@dataclass
class Edge:
    src: int  # CUgraphNode handles
    dst: int
    src_name: str | None  # kernel names; None for a node that is not a kernel (a copy, a memset)
    dst_name: str | None
    programmatic: bool


def enabled(device: torch.device) -> bool:
    return os.environ.get("NANOPLANE_GRAPH_PDL", "1") != "0" and pdl_enabled(device)


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _ok(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def _fn(lib: ctypes.CDLL, *names: str):
    """The first of `names` the driver exports (the `_v2` entry points are the CUDA 12 ones)."""
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise RuntimeError(f"the CUDA driver exports none of {names}")


def nodes(graph: int) -> list[int]:
    """Every node of a graph (`torch.cuda.CUDAGraph.raw_cuda_graph()`)."""
    lib, count = _driver(), ctypes.c_size_t()
    _ok(lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    out = (ctypes.c_void_p * count.value)()
    _ok(lib.cuGraphGetNodes(ctypes.c_void_p(graph), out, ctypes.byref(count)), "cuGraphGetNodes")
    return list(out)


def kernel_name(node: int, lib: ctypes.CDLL | None = None) -> str | None:
    """A kernel node's kernel name; None for any other node."""
    lib = lib or _driver()
    kind = ctypes.c_int()
    _ok(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _NODE_KERNEL:
        return None
    params = _KernelParams()
    _ok(_fn(lib, "cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")(
        ctypes.c_void_p(node), ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func:
        _ok(lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    else:  # launched through a library handle (CUkernel) rather than a function
        _ok(lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return name.value.decode()


def edges(graph: int) -> list[Edge]:
    """Every edge of a graph not yet instantiated."""
    lib = _driver()
    get = _fn(lib, "cuGraphGetEdges_v2", "cuGraphGetEdges")
    count = ctypes.c_size_t()
    _ok(get(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _ok(get(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    names: dict[int, str | None] = {}
    for node in (*src, *dst):
        if node not in names:
            names[node] = kernel_name(node, lib)
    return [Edge(src[i], dst[i], names[src[i]], names[dst[i]], data[i].type == _EDGE_PROGRAMMATIC)
            for i in range(n)]


def full_kernel_edges(all_edges: list[Edge], into: Callable[[str], bool]) -> list[Edge]:
    """The full (not programmatic) edges from a kernel into a kernel whose name `into` accepts."""
    return [e for e in all_edges if not e.programmatic and e.src_name is not None
            and e.dst_name is not None and into(e.dst_name)]


def rewire(graph: int, into: Callable[[str], bool]) -> list[Edge]:
    """Make every full kernel-to-kernel edge into a kernel `into` accepts programmatic: that kernel's
    grid may launch once its predecessor triggers, and its own wait keeps the data order. Returns
    the edges changed."""
    lib = _driver()
    remove = _fn(lib, "cuGraphRemoveDependencies_v2", "cuGraphRemoveDependencies")
    add = _fn(lib, "cuGraphAddDependencies_v2", "cuGraphAddDependencies")
    chosen = full_kernel_edges(edges(graph), into)
    data = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0, type=_EDGE_PROGRAMMATIC)
    for e in chosen:
        src, dst = ctypes.c_void_p(e.src), ctypes.c_void_p(e.dst)
        _ok(remove(ctypes.c_void_p(graph), ctypes.byref(src), ctypes.byref(dst), None, 1), "cuGraphRemoveDependencies")
        _ok(add(ctypes.c_void_p(graph), ctypes.byref(src), ctypes.byref(dst), ctypes.byref(data), 1),
            "cuGraphAddDependencies")
    return chosen


@triton.jit
def _late_copy(src_ptr, dst_ptr, n, seen_ptr, snap_ptr, m, iters, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Waits, lets its dependents launch at once, spins, and only then writes dst (the next kernel's
    # input) and reads seen (a buffer the next kernel writes) into snap.
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32) + 1.0
    for _ in range(iters):  # 1 is the fixed point: acc stays 1, but the chain must run
        acc = acc * 0.5 + 0.5
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * acc).to(dst_ptr.dtype.element_ty), mask=offs < n)
    seen = tl.load(seen_ptr + offs, mask=offs < m, other=0.0).to(tl.float32)
    tl.store(snap_ptr + offs, (seen * acc).to(snap_ptr.dtype.element_ty), mask=offs < m)


def check(gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int, k: int, n: int,
          dtype: torch.dtype, device: torch.device, replays: int = 2) -> tuple[set[str], bool]:
    """Run `gemm(x [rows, k], y [rows, n]) -> out` (it may write y) in a graph behind the late producer,
    every full edge into a kernel made programmatic. Returns the kernels those edges entered and
    whether every replay matched the eager result with the producer's reads undisturbed."""
    src = torch.randn(rows, k, dtype=dtype, device=device)
    x, y = torch.zeros_like(src), torch.empty(rows, n, dtype=dtype, device=device)
    y0 = torch.randn(rows, n, dtype=dtype, device=device)
    snap = torch.empty_like(y)
    block = 1024

    def step() -> torch.Tensor:
        y.copy_(y0)
        x.zero_()
        _late_copy[(triton.cdiv(max(x.numel(), y.numel()), block),)](
            src, x, x.numel(), y, snap, y.numel(), _SPIN, BLOCK=block, **pdl_args(device))
        return gemm(x, y)

    step()  # compiles, and lets cuBLAS settle its choice outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = step()
    entered = {e.dst_name for e in rewire(graph.raw_cuda_graph(), lambda name: not name.startswith("_late_copy"))}
    graph.instantiate()
    good = True
    for _ in range(replays):
        src.normal_()
        graph.replay()
        want = gemm(src.clone(), y0.clone())
        good &= torch.equal(snap, y0) and torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize(device)
    return entered, bool(good)


def decode_gemms(model: torch.nn.Module) -> list[tuple[Callable, int, int]]:
    """(gemm(x, y) -> out, k, n): each library GEMM a decode graph of `model` may run, through the
    calls the model makes (models/layers/linear.py picks the kernel by row count)."""
    from models.layers.embed_head import ParallelLMHead
    from models.layers.linear import LinearBase, RowParallelLinear, linear, linear_add_

    out, seen = [], set()
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            calls = [("head", lambda x, y, w=module.weight: F.linear(x, w))]
        elif isinstance(module, LinearBase):
            calls = [("linear", lambda x, y, w=module.weight: linear(x, w))]
            if isinstance(module, RowParallelLinear):
                calls.append(("add", lambda x, y, w=module.weight: linear_add_(x, w, y)))
        else:
            continue
        n, k = module.weight.shape
        for kind, call in calls:
            if (kind, n, k) not in seen:
                seen.add((kind, n, k))
                out.append((call, k, n))
    return out


def waiting_kernels(model: torch.nn.Module, batch_sizes: list[int], dtype: torch.dtype,
                    device: torch.device) -> set[str]:
    """Names of the kernels the checks passed, over the model's GEMMs at each batch size; a kernel any
    check failed is left out whatever the others found. Empty (nothing rewired) where the driver
    lacks the graph-edge API."""
    passed: set[str] = set()
    failed: set[str] = set()
    gemms = decode_gemms(model)
    try:
        for rows in batch_sizes:
            for gemm, k, n in gemms:
                entered, good = check(gemm, rows, k, n, dtype, device)
                (passed if good else failed).update(entered)
    except (OSError, RuntimeError) as exc:  # no libcuda.so.1, or a driver before CUDA 12.3's edge data
        log.warning("decode graphs keep full edges into library kernels: %s", exc)
        return set()
    finally:
        torch.cuda.empty_cache()  # the checks' buffers, before the graphs' pool is reserved
    if failed:
        log.warning("kernels that failed the early-start check keep full edges: %s", sorted(failed))
    return passed - failed
