"""Programmatic edges in a captured CUDA graph, and a check of whether a kernel waits on one.

An experiment's tools, not used by the engine (benchmarks/graph_pdl.py runs them). Our Triton kernels
take part in programmatic dependent launch (kernels/pdl.py); torch launches cuBLAS without it, so in
the decode graphs every edge into a GEMM is a full one. `rewire` makes such edges programmatic
after capture (a graph captured with `keep_graph=True`, changed before it is instantiated), so the
GEMM's grid launches while its producer still runs. That is only correct for a kernel that executes
`griddepcontrol.wait` before it touches what its producer writes.

`check` finds out: it runs a kernel behind a producer that lets dependents launch at once, holds a
few SMs for ~50 us, and only then writes the kernel's input and reads the buffer the kernel writes.
On an H200 (driver for CUDA 13, cuBLAS 13) every cuBLAS GEMM a Qwen3-0.6B decode step runs fails it:
they start early and read stale input. So did kernels without a wait launched plainly on a rewired
edge. The engine therefore keeps full edges into cuBLAS (BENCHMARKS.md, twenty-second session: the
1.9-2.6% measured with rewired edges came with that race).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import gdc_wait, pdl_args, pdl_prologue

_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the upstream kernel's trigger
# Iterations of the producer's dependent multiply-add chain: ~50 us on an H200 (the producer took 201 us
# with them and 150 us without, timed once), many times a decode GEMM's run, so a GEMM that read
# too early has long finished on the stale input.
_SPIN = 25_000
_PRODUCER_PROGRAMS = 4


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
    grid may launch once its predecessor triggers. Only a kernel that waits before it touches memory
    keeps the data order then (`check` tells). Returns the edges changed."""
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
def _late_copy(src_ptr, dst_ptr, n, seen_ptr, snap_ptr, m, iters, half, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Waits, lets its dependents launch at once, spins, and only then writes dst (the next kernel's
    # input) and reads seen (a buffer the next kernel writes) into snap. Its few programs stride over
    # the data, so nearly every SM is free for a dependent that starts early.
    pdl_prologue(USE_PDL)
    acc = tl.zeros([BLOCK], tl.float32) + 1.0
    # 1 is the fixed point (half = 0.5): acc stays 1. `half` is a run-time argument so that the compiler
    # cannot fold the chain away, as it did with a literal 0.5: the producer then took ~40 us whatever
    # `iters` was, and no kernel ever failed the check.
    for _ in range(iters):
        acc = acc * half + half
    for start in range(tl.program_id(0) * BLOCK, tl.maximum(n, m), tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, (x * acc).to(dst_ptr.dtype.element_ty), mask=offs < n)
        seen = tl.load(seen_ptr + offs, mask=offs < m, other=0.0).to(tl.float32)
        tl.store(snap_ptr + offs, (seen * acc).to(snap_ptr.dtype.element_ty), mask=offs < m)


def late_copy(src: torch.Tensor, dst: torch.Tensor, seen: torch.Tensor, snap: torch.Tensor, iters: int) -> None:
    """The check's producer: dst = src and snap = seen, done after `iters` steps of a dependent chain."""
    _late_copy[(_PRODUCER_PROGRAMS,)](src, dst, dst.numel(), seen, snap, seen.numel(), iters, 0.5, BLOCK=1024,
                                      **pdl_args(src.device))


def check(gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: int, k: int, n: int,
          dtype: torch.dtype, device: torch.device, replays: int = 2) -> tuple[set[str], bool]:
    """Run `gemm(x [rows, k], y [rows, n]) -> out` (it may write y) in a graph behind the late producer,
    every full edge into a kernel made programmatic. Returns the kernels those edges entered and
    whether every replay matched the eager result with the producer's reads undisturbed."""
    src = torch.randn(rows, k, dtype=dtype, device=device)
    x, y = torch.zeros_like(src), torch.empty(rows, n, dtype=dtype, device=device)
    y0 = torch.randn(rows, n, dtype=dtype, device=device)
    snap = torch.empty_like(y)

    def step() -> torch.Tensor:
        y.copy_(y0)
        x.zero_()
        late_copy(src, x, y, snap, _SPIN)
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


@triton.jit
def _waits_first(x_ptr, o_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # The control that keeps the PDL contract: it waits, then clears y and doubles x into o.
    gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.zeros([BLOCK], tl.float32).to(y_ptr.dtype.element_ty), mask=offs < n)
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def doubling(kernel=_waits_first, pdl: bool = False) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A `gemm(x, y)` for `check` made of a Triton `kernel(x, o, y, n, BLOCK)` that doubles x into a new
    tensor (and may clear y). Launched plainly, the check's rewiring makes its edge programmatic;
    with `pdl`, its own launch attribute does."""
    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        launch = {"launch_pdl": True} if pdl else {}
        kernel[(triton.cdiv(x.numel(), 1024),)](x, out, y, x.numel(), BLOCK=1024, **launch)
        return out
    return run
