"""Programmatic dependent launch (PDL, Hopper and later): a kernel is launched while the one before
it in the stream still runs, and waits on the device (`griddepcontrol.wait`) for its results.

A decode step at a few rows is ~300 small kernels in a CUDA graph, each a few microseconds, and
the gap between two dependent kernels (grid launch, CTAs rasterised onto SMs) is a large share of
each. With PDL that gap overlaps the previous kernel's tail.

The contract every kernel launched with `pdl_args` keeps: `pdl_prologue()` first, before any
global memory read or write. Its wait returns once the previous grid has completed and its writes
are visible, so a kernel never reads an unfinished result, nor overwrites a buffer its predecessor
still reads; completion is transitive (the predecessor itself waited on its own). Kernels launched
without PDL (cuBLAS, torch ops) keep the stream's usual full ordering. They must: cuBLAS's GEMMs
do not wait, and on an edge made programmatic they read their input before it is written.

One exception, by the same transitivity: a kernel's programs start only once every program of its
predecessor has passed its own wait, so everything queued before the predecessor has completed. A
kernel may therefore read, before its wait, what only those earlier operations write (a decode
step's context lengths and page tables, written at the step's start); the decode attention does
(kernels/decode_attention.py, EARLY_SETUP). Writes still come after the wait.

`set_pdl(False)` turns it off (the data plane does for NANOPLANE_PDL=0); it is off on CPUs (the
interpreter) and before compute capability 9.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a triton without grid dependency control: PDL stays off (USE_PDL is never true)
    _MISSING = True

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass
else:
    _MISSING = False


_wanted = [True]  # set_pdl's choice


def set_pdl(on: bool) -> None:
    """Launch the kernels with PDL where the GPU supports it (the default), or never."""
    _wanted[0] = on
    _supported.cache_clear()


@functools.cache
def _supported(device_index: int) -> bool:
    if not _wanted[0] or _MISSING:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and _supported(device.index if device.index is not None else 0)


def pdl_args(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes `USE_PDL: tl.constexpr` and starts with `pdl_prologue`."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        # Wait first, then let the next kernel launch: its CTAs then overlap this kernel's work,
        # not a chain of kernels all parked at their waits.
        gdc_wait()
        gdc_launch_dependents()
