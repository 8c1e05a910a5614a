"""Can one half of a decode batch's GEMMs run while the other half's attention streams the KV cache?

    python benchmarks/overlap.py [--batches 128 256] [--context 1024] [--programs 66 100 116 132 264]

At full batch a decode step is the attention at its KV-read floor plus ~1.2 ms of GEMMs and small
kernels that leave most SMs idle (BENCHMARKS.md). Rows are independent through the whole model, so
two half batches on two streams could overlap one half's GEMMs with the other's attention. The
ninth session's try lost 5%: an attention launch of ~1,000 programs holds every SM until its last
wave, so the other stream's GEMMs wait anyway. This times 28 layers of [QKV GEMM, decode attention,
o_proj, gate_up, silu·mul, down] at the 0.6B shapes as one CUDA graph: `serial` (the layers as the
model runs them), `halves` (two half batches on two streams, attention as it is), `halves pN` (the
same with the attention capped at N persistent programs, leaving the other SMs to the GEMMs),
`attention alone` (the 28 attentions alone, the step's bound if everything else hid behind them),
and `serial pN` (the layers as the model runs them with the capped attention: its own cost).
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l2_prefetch import HIDDEN, HKV, HQ, LAYERS, PAGE, D, linear, make_weights  # noqa: E402  (same layers)
from timing import median_ms, time_graph  # noqa: E402

from kernels import paged_decode_attention, silu_and_mul  # noqa: E402
from kernels.decode_attention import TUNING, _attend  # noqa: E402
from kernels.pdl import pdl_args, pdl_prologue  # noqa: E402


@triton.jit
def _decode_persistent_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, seq_order_ptr,
    out_ptr, scale_log2e, batch,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    HAS_ORDER: tl.constexpr, USE_PDL: tl.constexpr,
):
    # A fixed number of programs walk the (sequence, KV head) items: the launch holds only as many
    # SMs as it has programs, and leaves the rest to kernels on another stream (the GEMMs of the
    # other half of the batch).
    pdl_prologue(USE_PDL)
    for item in range(tl.program_id(0), batch * NUM_KV_HEADS, tl.num_programs(0)):
        kv_head = item % NUM_KV_HEADS
        seq = item // NUM_KV_HEADS
        if HAS_ORDER:
            seq = tl.load(seq_order_ptr + seq)
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                out_ptr, out_ptr, out_ptr, out_ptr, scale_log2e, 1,
                stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, seq, kv_head, 0,
                NUM_Q_HEADS, NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, True, BLOCK_G, BLOCK_D, BLOCK_N, PREC)


def persistent_attention(q, k_cache, v_cache, tables, lens, scale, order, programs: int) -> torch.Tensor:
    """paged_decode_attention in one split, at most `programs` programs."""
    batch, hq, d = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _, page, hkv, _ = k_cache.shape
    _decode_persistent_kernel[(min(programs, batch * hkv),)](
        q, k_cache, v_cache, tables, lens, order, out, scale * 1.4426950408889634, batch,
        q.stride(0), q.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, GROUP=hq // hkv, HEAD_DIM=d, PAGE_SIZE=page,
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=TUNING["block_n"], PREC="tf32", HAS_ORDER=True, num_warps=TUNING["num_warps"],
        num_stages=TUNING["num_stages"], **pdl_args(q.device))
    return out


def layers(x, weights, caches, tables, lens, order, programs, gemms=True):
    for layer in range(LAYERS):
        w = weights[layer]
        q = linear(x, w["qkv"])[:, : HQ * D].view(-1, HQ, D) if gemms else x.view(-1, HQ, D)
        k_cache, v_cache = caches[layer]
        if programs is None:
            a = paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, seq_order=order)
        else:
            a = persistent_attention(q, k_cache, v_cache, tables, lens, D**-0.5, order, programs)
        if gemms:
            h = linear(a.view(-1, HQ * D), w["o"])
            x = linear(silu_and_mul(linear(h, w["gate_up"])), w["down"])
    return x


def halves(x, weights, caches, tables, lens, orders, programs, side: torch.cuda.Stream):
    """Rows [0, b/2) on the current stream, the rest on `side`; joined at the end."""
    half = x.shape[0] // 2
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    a = layers(x[:half], weights, caches, tables[:half], lens[:half], orders[0], programs)
    with torch.cuda.stream(side):
        b = layers(x[half:], weights, caches, tables[half:], lens[half:], orders[1], programs)
    main.wait_stream(side)
    return a, b


def halves_prioritised(x, weights, caches, tables, lens, orders, streams):
    """`halves`, with each half's GEMMs on a high-priority stream and its attention on a low-priority
    one: when an attention block retires, the block scheduler gives the SM to a waiting GEMM block of
    the other half first, instead of to the next wave of the attention."""
    half = x.shape[0] // 2
    main = torch.cuda.current_stream()
    keep = []  # every intermediate lives to the end: no allocator reuse across the streams

    def run(rows, lens_half, tables_half, order, gemm_stream, attn_stream):
        gemm_stream.wait_stream(main)
        h = rows
        for layer in range(LAYERS):
            w = weights[layer]
            with torch.cuda.stream(gemm_stream):
                q = linear(h, w["qkv"])[:, : HQ * D].view(-1, HQ, D)
            attn_stream.wait_stream(gemm_stream)
            k_cache, v_cache = caches[layer]
            with torch.cuda.stream(attn_stream):
                a = paged_decode_attention(q, k_cache, v_cache, tables_half, lens_half, D**-0.5, seq_order=order)
            gemm_stream.wait_stream(attn_stream)
            with torch.cuda.stream(gemm_stream):
                o = linear(a.view(-1, HQ * D), w["o"])
                g = silu_and_mul(linear(o, w["gate_up"]))
                h = linear(g, w["down"])
            keep.extend((q, a, o, g, h))
        main.wait_stream(gemm_stream)
        return h

    a = run(x[:half], lens[:half], tables[:half], orders[0], *streams[0])
    b = run(x[half:], lens[half:], tables[half:], orders[1], *streams[1])
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--programs", type=int, nargs="+", default=[66, 100, 116, 132, 264])
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = make_weights(LAYERS)
    print("| rows | variant | ms a step | floor ms |")
    print("| --- | --- | --- | --- |")
    for b in args.batches:
        for name, ms, floor in measure(b, args.context, args.programs, weights):
            print(f"| {b} | {name} | {ms:.3f} | {floor:.3f} |", flush=True)


def measure(b: int, context: int, programs: list[int], weights) -> list[tuple[str, float, float]]:
    """(variant, ms a step, the step's floor) at b rows of the bench's context mix up to `context`."""
    pages = -(-context // PAGE)
    caches = [(torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(b * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    tables = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    # Contexts spread over [context / 8, context], handed to programs longest first.
    lens = torch.randint(context // 8, context + 1, (b,), device="cuda", dtype=torch.int32)
    order = torch.argsort(lens, descending=True, stable=True).int()
    half = b // 2
    orders = [torch.argsort(lens[:half], descending=True, stable=True).int(),
              torch.argsort(lens[half:], descending=True, stable=True).int()]
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    # One split, as the persistent kernel: the same sums in the same order, so equal to the bit.
    want = paged_decode_attention(q, *caches[0], tables, lens, D**-0.5, num_splits=1)
    for p in programs:
        assert torch.equal(persistent_attention(q, *caches[0], tables, lens, D**-0.5, order, p), want)
    x = torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
    qx = q.view(b, HQ * D)
    side = torch.cuda.Stream()
    # Priorities out of range are clamped to the highest (most negative) or lowest the device has.
    streams = [(torch.cuda.Stream(priority=-100), torch.cuda.Stream(priority=0)) for _ in range(2)]
    weight_bytes = sum(t.numel() * t.element_size() for w in weights for t in w.values())
    floor = (weight_bytes + LAYERS * int(lens.sum()) * 2 * HKV * D * 2) / 4.24e12 * 1e3
    variants = [("serial", lambda: layers(x, weights, caches, tables, lens, order, None)),
                ("attention alone", lambda: layers(qx, weights, caches, tables, lens, order, None, gemms=False)),
                ("halves", lambda: halves(x, weights, caches, tables, lens, orders, None, side)),
                ("halves, GEMMs first", lambda: halves_prioritised(x, weights, caches, tables, lens, orders, streams))]
    for p in programs:
        variants.append((f"serial p{p}", lambda p=p: layers(x, weights, caches, tables, lens, order, p)))
        variants.append((f"halves p{p}", lambda p=p: halves(x, weights, caches, tables, lens, orders, p, side)))
    rows = [(name, time_graph(fn), floor) for name, fn in variants]
    # Unreplayed too, in case a graph's nodes do not keep the priority of the stream they came from.
    for name, fn in variants[::3]:
        fn()
        torch.cuda.synchronize()
        rows.append((f"{name}, eager", median_ms(fn, 30), floor))
    return rows


if __name__ == "__main__":
    main()
