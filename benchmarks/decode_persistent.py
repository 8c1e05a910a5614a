"""Where the decode attention's time beyond its bytes goes, and a persistent kernel that does not win it.

    python benchmarks/decode_persistent.py

1. One context length for all 256 rows, 128 to 2,048 tokens, the production kernel, one split: the
   time grows by the same amount per 1,024 tokens (the marginal read rate) from a fixed part per
   launch, which is what keeps short contexts below the read ceiling (`benchmarks/read_ceiling.py`).
2. A persistent kernel over a host-made plan: each (KV head, lane) program walks one flat list of
   64-token tiles covering whole rows, the rows dealt to lanes longest first to the least-loaded
   lane. A row's start-up loads (its query, its first pages) then sit in the same pipelined loop as
   the previous row's tiles instead of in a new program's start. Compared with the production kernel
   (its own split choice and longest-first order) on throughput.py's context mixes, graph replay.
   Not used by the data plane: see BENCHMARKS.md, sixteenth session.
"""

import heapq
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/kernels.py's own imports (gemm, timing)
sys.path.insert(0, str(HERE.parent))  # ahead of it: `kernels` is the package
from kernels import paged_decode_attention  # noqa: E402

# benchmarks/kernels.py (its cache and context helpers) under another name: `kernels` is the package.
_spec = importlib.util.spec_from_file_location("kernel_benchmarks", HERE / "kernels.py")
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
HQ, HKV, D, paged, workload_contexts = _bench.HQ, _bench.HKV, _bench.D, _bench.paged, _bench.workload_contexts

BLOCK_N = 64


@triton.jit
def planned_attention(q_ptr, k_ptr, v_ptr, out_ptr, row_ptr, info_ptr, lane_ptr, scale_log2e, stride_qb,
                      stride_ob, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """Program (KV head, lane): tiles [lane_ptr[lane], lane_ptr[lane + 1]) of the plan. A tile's
    row_ptr entry is the cache row of its first token; info packs batch row << 9 | live tokens << 2 |
    last << 1 | first."""
    kv_head = tl.program_id(0)
    lane = tl.program_id(1)
    t0 = tl.load(lane_ptr + lane)
    t1 = tl.load(lane_ptr + lane + 1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    nt = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for t in tl.range(t0, t1, num_stages=STAGES):
        row0 = tl.load(row_ptr + t)
        info = tl.load(info_ptr + t)
        seq = info >> 9
        live = nt < ((info >> 2) & 127)
        # A vector, not a scalar: the interpreter takes no scalar in a store's mask.
        last = (((info >> 1) & 1) + g * 0) != 0
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + (heads * HEAD_DIM)[:, None] + d[None, :],
                    mask=g_mask[:, None], other=0.0)
        kv_off = (row0.to(tl.int64) + nt)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)
        # A row's first tile restarts the running softmax: alpha = 0 drops the previous row's state.
        m = tl.where((info & 1) != 0, float("-inf"), m)
        s = tl.dot(q, tl.trans(k), input_precision="tf32") * scale_log2e
        # Finite, so that an empty row's lone all-masked tile gives l = 64, acc = 0: zeros out.
        s = tl.where(live[None, :], s, -1e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32")
        m = m_new
        o = acc / l_sum[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + (heads * HEAD_DIM)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(g_mask & last)[:, None])


def make_plan(ctx: np.ndarray, tables: np.ndarray, lanes: int, page: int) -> tuple[np.ndarray, ...]:
    """(lane offsets [lanes + 1], first cache row [T], info [T]) int32: whole rows, longest first, each
    to the least-loaded lane (a row costs its tiles plus half a tile to start)."""
    tiles = np.maximum(-(-ctx // BLOCK_N), 1)  # an empty row gets one all-masked tile: its output is 0
    heap = [(0.0, lane) for lane in range(lanes)]
    members: list[list[int]] = [[] for _ in range(lanes)]
    for s in np.argsort(-ctx, kind="stable"):
        load, lane = heapq.heappop(heap)
        members[lane].append(s)
        heapq.heappush(heap, (load + tiles[s] + 0.5, lane))
    seqs = np.array([s for mem in members for s in mem], dtype=np.int64)
    offsets = np.zeros(lanes + 1, dtype=np.int32)
    np.cumsum([tiles[mem].sum() if mem else 0 for mem in members], out=offsets[1:])
    n = tiles[seqs]
    seq_of_tile = np.repeat(seqs, n)
    j = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # the tile's index within its row
    pos = j * BLOCK_N
    row0 = tables[seq_of_tile, pos // page].astype(np.int64) * page + pos % page
    live = np.minimum(ctx[seq_of_tile] - pos, BLOCK_N).clip(0)
    last = (j == np.repeat(n, n) - 1).astype(np.int64)
    info = (seq_of_tile << 9) | (live << 2) | (last << 1) | (j == 0)
    return offsets, row0.astype(np.int32), info.astype(np.int32)


def run_planned(q, k_cache, v_cache, out, plan, lanes: int) -> None:
    offsets, row0, info = plan
    planned_attention[(HKV, lanes)](q, k_cache, v_cache, out, row0, info, offsets, D**-0.5 * 1.4426950408889634,
                                    q.stride(0), out.stride(0), NUM_KV_HEADS=HKV, GROUP=HQ // HKV, HEAD_DIM=D,
                                    BLOCK_G=16, BLOCK_N=BLOCK_N, STAGES=3, num_warps=4, num_stages=3)


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=60) * 1e3


def tbs(nbytes: int, us: float) -> str:
    return f"{us:.1f} ({nbytes / us / 1e6:.2f})"


def uniform(n: int, dtype: torch.dtype) -> str:
    """256 rows of n tokens, the production kernel in one split: us (TB/s)."""
    k, v, tables, lens = paged([n] * 256, 256, dtype)
    q = torch.randn(256, HQ, D, device="cuda", dtype=dtype)
    us = graph_us(lambda: paged_decode_attention(q, k, v, tables, lens, D**-0.5, num_splits=1))
    return tbs(256 * n * HKV * D * 4, us)


def mix(step: int, lane_counts: tuple[int, ...], dtype: torch.dtype) -> str:
    """One table row: throughput.py's batch at decode step `step`, production against persistent."""
    ctx = workload_contexts(step)
    k, v, tables, lens = paged(ctx, 256, dtype)
    q = torch.randn(len(ctx), HQ, D, device="cuda", dtype=dtype)
    order = torch.argsort(lens, descending=True, stable=True).int()
    nbytes = sum(ctx) * HKV * D * 4
    want = paged_decode_attention(q, k, v, tables, lens, D**-0.5, seq_order=order)
    cells = [tbs(nbytes, graph_us(lambda: paged_decode_attention(q, k, v, tables, lens, D**-0.5, seq_order=order)))]
    for lanes in lane_counts:
        plan = tuple(torch.from_numpy(a).cuda() for a in make_plan(np.array(ctx), tables.cpu().numpy(), lanes, 256))
        out = torch.empty_like(q)
        run_planned(q, k, v, out, plan, lanes)
        err = (out.float() - want.float()).abs().max().item()
        assert err < 2e-2, f"persistent kernel off by {err} at step {step}, {lanes} lanes"
        cells.append(tbs(nbytes, graph_us(lambda plan=plan, lanes=lanes, out=out: run_planned(q, k, v, out, plan,
                                                                                              lanes))))
    return f"| {step} | {len(ctx)} | " + " | ".join(cells) + " |"


def main() -> None:
    dtype = torch.bfloat16
    print("| rows x context | production, 1 split: us (TB/s) |")
    for n in (128, 256, 512, 1024, 2048):
        print(f"| 256 x {n} | {uniform(n, dtype)} |", flush=True)
    lane_counts = (66, 132)
    print("| bench step | rows | production: us (TB/s) | "
          + " | ".join(f"persistent, {n} lanes" for n in lane_counts) + " |")
    for step in (0, 200, 400, 600, 800):
        print(mix(step, lane_counts, dtype), flush=True)


if __name__ == "__main__":
    main()
