"""Two half batches, the attention on SMs of its own and everything else on the rest (green contexts).

    python benchmarks/green_contexts.py [--splits 88 96 104 112] [--batches 256 128 64]

The ninth and eleventh sessions' half batches lost because an attention launch holds every SM until
its last wave (benchmarks/overlap.py). Green contexts (CUDA 12.4+) partition the SMs between streams:
here the decode attention of one half runs on a partition of N SMs while the other half's GEMMs run
on the SMs left, in a two-stage pipeline captured in one CUDA graph. It first times each part alone
on partitions of several sizes (how the attention and the linear layers scale with SMs), then the
pipeline against the layers as the model runs them, its output checked against theirs.

`Partition` builds the two partitions through the driver API, which splits the SMs into a group and
the remainder, disjoint by construction (tests/test_green_contexts.py checks it with %smid). torch's
`GreenContext.create(num_sms)` makes one context of N SMs without saying which, so two of them need
not divide the chip.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

_RESOURCE_BYTES = 1024  # a CUdevResource is 144 bytes in CUDA 12.4; room for later versions' growth
_SM_COUNT_AT = 96  # its `type` (4 bytes) and padding (92), then the union's CUdevSmResource.smCount
_SM_RESOURCE = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM, required by cuGreenCtxCreate
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING, required by cuGreenCtxStreamCreate


def _ok(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def _sm_count(resource: ctypes.Array) -> int:
    return ctypes.c_uint.from_buffer(resource, _SM_COUNT_AT).value


class Partition:
    """Two green contexts over disjoint SMs of one device, each with a torch stream (`streams`) and
    its SM count (`sms`). The contexts are never destroyed: a benchmark makes a few and exits."""

    def __init__(self, first: int, device: int = 0):
        torch.cuda.init()
        lib = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        _ok(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
        _ok(lib.cuDeviceGetDevResource(dev, whole, _SM_RESOURCE), "cuDeviceGetDevResource")
        group, rest = ctypes.create_string_buffer(_RESOURCE_BYTES), ctypes.create_string_buffer(_RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        # The driver rounds `first` up to its SM granularity (8 on an H200): 100 gives 104.
        _ok(lib.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0, first),
            "cuDevSmResourceSplitByCount")
        self.device_sms = _sm_count(whole)
        self.sms = (_sm_count(group), _sm_count(rest))  # the first partition's SMs, the rest's
        self._contexts = []
        self.streams = []
        for resource in (group, rest):
            desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            _ok(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1), "cuDevResourceGenerateDesc")
            _ok(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _GREEN_DEFAULT_STREAM), "cuGreenCtxCreate")
            self._contexts.append(ctx)
            _ok(lib.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, _NON_BLOCKING, 0), "cuGreenCtxStreamCreate")
            self.streams.append(torch.cuda.ExternalStream(stream.value))


def halves_pipelined(x, weights, caches, tables, lens, orders, attn_stream, gemm_stream, keep: list):
    """The layers of benchmarks/overlap.py for two half batches: every attention on `attn_stream`,
    every GEMM and silu·mul on `gemm_stream`, so that one half's GEMMs run during the other's
    attention. `keep` holds every tensor one stream hands the other until the caller clears it, so
    the allocator does not reuse its memory while the other stream may still read it."""
    from l2_prefetch import HQ, LAYERS, D, linear

    from kernels import paged_decode_attention, silu_and_mul

    half = x.shape[0] // 2
    main = torch.cuda.current_stream()
    attn_stream.wait_stream(main)
    gemm_stream.wait_stream(main)
    rows = [(lens[:half], tables[:half], orders[0]), (lens[half:], tables[half:], orders[1])]
    hs, qs, q_ready = [x[:half], x[half:]], [None, None], [None, None]
    with torch.cuda.stream(gemm_stream):
        for i in (0, 1):
            qs[i] = linear(hs[i], weights[0]["qkv"])[:, : HQ * D].view(-1, HQ, D)
            q_ready[i] = gemm_stream.record_event()
    for layer in range(LAYERS):
        w, (k_cache, v_cache) = weights[layer], caches[layer]
        outs, out_ready = [None, None], [None, None]
        for i in (0, 1):
            attn_stream.wait_event(q_ready[i])
            with torch.cuda.stream(attn_stream):
                lens_i, tables_i, order_i = rows[i]
                outs[i] = paged_decode_attention(qs[i], k_cache, v_cache, tables_i, lens_i, D**-0.5, seq_order=order_i)
            out_ready[i] = attn_stream.record_event()
        for i in (0, 1):
            gemm_stream.wait_event(out_ready[i])
            with torch.cuda.stream(gemm_stream):
                h = linear(outs[i].view(-1, HQ * D), w["o"])
                hs[i] = linear(silu_and_mul(linear(h, w["gate_up"])), w["down"])
                keep.extend((qs[i], outs[i], h, hs[i]))
                if layer + 1 < LAYERS:
                    qs[i] = linear(hs[i], weights[layer + 1]["qkv"])[:, : HQ * D].view(-1, HQ, D)
                    q_ready[i] = gemm_stream.record_event()
    main.wait_stream(gemm_stream)
    main.wait_stream(attn_stream)
    return hs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", type=int, nargs="+", default=[88, 96, 104, 112], help="SMs asked for the attention")
    ap.add_argument("--parts", type=int, nargs="+", default=[32, 48, 64, 88, 104, 120],
                    help="partition sizes for the parts-alone table")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 128, 64])
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    # The root ahead of benchmarks/ (the script's own directory): `kernels` is the package, not benchmarks/kernels.py.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from l2_prefetch import HIDDEN, HKV, HQ, LAYERS, PAGE, D, linear, make_weights
    from overlap import layers
    from timing import time_graph

    from kernels import silu_and_mul

    torch.manual_seed(0)
    weights = make_weights(LAYERS)
    splits = [Partition(n) for n in args.splits]
    alone = {p.sms[0]: p for p in (Partition(n) for n in args.parts)}

    def gemms_only(x):
        for w in weights:
            h = linear(linear(x, w["qkv"])[:, : HQ * D], w["o"])
            x = linear(silu_and_mul(linear(h, w["gate_up"])), w["down"])
        return x

    def on(stream, fn):
        def run():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
        return run

    def serial(c):  # c: (x, q, caches, tables, lens, order, orders) of one batch size
        return lambda: layers(c[0], weights, c[2], c[3], c[4], c[5], None)

    def attention_only(c):
        return lambda: layers(c[1], weights, c[2], c[3], c[4], c[5], None, gemms=False)

    def pipelined(c, p, keep):
        return lambda: halves_pipelined(c[0], weights, c[2], c[3], c[4], c[6], *p.streams, keep)

    whole = torch.cuda.Stream()
    print("Each part alone, 28 layers, ms a step (graph replay), on a partition of N SMs:")
    print("| rows | part | " + " | ".join(f"{n} SMs" for n in alone) + f" | {splits[0].device_sms} SMs |")
    print("| --- | --- |" + " --- |" * (len(alone) + 1))
    cases = {}
    pages = -(-args.context // PAGE)
    for b in args.batches:
        caches = [(torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16),
                   torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
        tables = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        # Contexts spread over [context / 8, context], handed to programs longest first (as overlap.py).
        lens = torch.randint(args.context // 8, args.context + 1, (b,), device="cuda", dtype=torch.int32)
        orders = [torch.argsort(lens[: b // 2], descending=True, stable=True).int(),
                  torch.argsort(lens[b // 2:], descending=True, stable=True).int()]
        x = torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, HQ * D, device="cuda", dtype=torch.bfloat16)
        c = cases[b] = (x, q, caches, tables, lens, torch.argsort(lens, descending=True, stable=True).int(), orders)
        for name, fn in (("GEMMs and silu·mul", lambda x=x: gemms_only(x)), ("attention", attention_only(c))):
            cells = [time_graph(on(p.streams[0], fn)) for p in alone.values()] + [time_graph(on(whole, fn))]
            print(f"| {b} | {name} | " + " | ".join(f"{ms:.3f}" for ms in cells) + " |", flush=True)
    print("\nThe pipeline against the layers as the model runs them (one stream, every SM), ms a step (and its largest "
          "difference from their output):")
    print("| rows | serial | " + " | ".join(f"attention {p.sms[0]} / rest {p.sms[1]}" for p in splits) + " |")
    print("| --- | --- |" + " --- |" * len(splits))
    for b, c in cases.items():
        want = serial(c)().float()
        cells = [f"{time_graph(serial(c)):.3f}"]
        keep: list = []
        for p in splits:
            got = torch.cat(pipelined(c, p, keep)()).float()
            keep.clear()
            err = (got - want).abs().max().item()
            assert err < 1e-2, f"the pipeline's output is off by {err}"
            cells.append(f"{time_graph(pipelined(c, p, keep)):.3f} (off by {err:.1e})")
            keep.clear()
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
