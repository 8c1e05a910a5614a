"""GPU micro-benchmark of the Triton kernels against the memory-bandwidth floor.

    python -m benchmarks.kernel_speed [--only read,decode,decode_mixed,decode_sweep,prefill,prefill_sweep,
                                              rms_norm,rotary,store,sample,skinny,skinny_sweep,mid_sweep]
                                      [--dtype bf16] [--gemm-shapes 0.6b|8b-tp2]

Floor = bytes the op must move / 4.24 TB/s (H200 device copy, read + write). Two timings:
`cold` is triton's do_bench (L2 flushed before each call, one launch per call: what a step sees
without CUDA graphs); `graph` replays the calls in a CUDA graph (no launch overhead, but the L2
stays warm, so ops whose working set fits the 50 MB L2 can beat the HBM floor). Prefill is
compute-bound, so its line also gives TFLOP/s against 787 (dense bf16). `sample` times the fused
sampler (kernels.sample) beside the torch path it replaces (dataplane.sampler's fp32 copy, softmax,
exponential noise, argmax), both against one read of the logits.

`skinny`, `skinny_sweep` and `mid_sweep` are the linear layers' benchmarks, in benchmarks/gemm.py
(its docstring says what each times).
"""

import argparse
import functools

import torch
import triton.testing

from benchmarks import gemm
from benchmarks.gemm import bench_mid_sweep, bench_skinny, bench_skinny_sweep
from benchmarks.timing import BANDWIDTH, report
from nanoplane.kernels import (
    apply_rotary,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    sample,
    store_kvcache,
)
from nanoplane.kernels import reference as ref
from nanoplane.kernels.sampling import sampling_uniforms

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B attention shape
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def paged(ctx_lens: list[int], page: int, dtype: torch.dtype):
    need = [-(-n // page) for n in ctx_lens]
    k_cache = torch.randn(sum(need), page, HKV, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.full((len(ctx_lens), max(need)), -1, dtype=torch.int32, device="cuda")
    perm, used = torch.randperm(sum(need), device="cuda").int(), 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


def bench_decode(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    for batch, ctx, page, splits in [(256, 1024, 16, None), (256, 1024, 256, None), (64, 4096, 16, None),
                                     (8, 8192, 16, None), (1, 32768, 16, None), (1, 32768, 16, 1)]:
        k_cache, v_cache, tables, lens = paged([ctx] * batch, page, dtype)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
        scale = D**-0.5
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits)  # noqa: B023
        check = lambda: (fn(), ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale))  # noqa: B023
        nbytes = batch * ctx * HKV * D * 2 * esize + 2 * q.numel() * esize + tables.numel() * 4
        name = f"decode B={batch} ctx={ctx} page={page} splits={splits or 'auto'}"
        report(name, fn, nbytes, check=check)


def bench_read(dtype: torch.dtype) -> None:
    """What reading alone reaches: the ceiling a decode-attention kernel (a pure read) is held to."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").view(dtype)
    report("read 1 GiB (torch.sum)", x.sum, x.numel() * x.element_size())


DECODE_SWEEP = [dict(block_n=bn, num_warps=w, num_stages=st, heads_fastest=hf)
                for hf in (False, True) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def bench_decode_sweep(dtype: torch.dtype) -> None:
    """The decode kernel's launch alternatives (kernels.decode_attention.TUNING), graph timings."""
    from nanoplane.kernels.decode_attention import TUNING, _choose_num_splits

    esize = torch.finfo(dtype).bits // 8
    for batch, ctx in ((256, 1024), (128, 1024), (64, 1024), (16, 1024)):
        k_cache, v_cache, tables, lens = paged([ctx] * batch, 256, dtype)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
        expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, D**-0.5)
        nbytes = batch * ctx * HKV * D * 2 * esize
        floor = nbytes / BANDWIDTH * 1e6
        for tune in DECODE_SWEEP:
            label = f"decode B={batch:<3} ctx={ctx} " + " ".join(f"{k}={v}" for k, v in tune.items())
            label += " (default)" if tune == TUNING else ""
            fn = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, D**-0.5, tuning=tune)
            try:
                err = ((fn().float() - expected.float()).norm() / expected.float().norm()).item()
                assert err < 2e-2, f"relative error {err:.2e}"
                t = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            except Exception as e:  # a tile that does not compile (shared memory) must not end the sweep
                print(f"{label:<96} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            print(f"{label:<96} {t:7.1f} us  {nbytes / t / 1e6:5.2f} TB/s  {floor / t:6.1%} of floor", flush=True)
        # Split-KV at the default launch: is the heuristic's choice (about two waves) the fastest?
        picked = _choose_num_splits(batch, HKV, tables.shape[1] * 256, q.device)
        for splits in (1, 2, 3, 4, 6, 8, 16):
            fn = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, D**-0.5,
                                   num_splits=splits)
            t = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            label = f"decode B={batch:<3} ctx={ctx} splits={splits}{' (heuristic)' if splits == picked else ''}"
            print(f"{label:<96} {t:7.1f} us  {nbytes / t / 1e6:5.2f} TB/s  {floor / t:6.1%} of floor", flush=True)


def workload_contexts(step: int) -> list[int]:
    """Context lengths of the sequences still running at decode step `step` of throughput.py's
    workload (same random draws), in request order: the batch a decode step of the bench sees."""
    import random

    random.seed(0)
    prompts = [len([random.randint(0, 10000) for _ in range(random.randint(100, 1024))]) for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    return [p + step + 1 for p, m in zip(prompts, max_tokens, strict=True) if m > step]


def bench_decode_mixed(dtype: torch.dtype) -> None:
    """Decode attention over the bench's own mix of context lengths (not one length for all), with
    the rows handed to programs in request order or longest first, against their read floor."""
    from nanoplane.kernels import decode_attention

    decode_attention.ORDER_MIN_WAVES = 0  # follow the given order at every batch size
    esize = torch.finfo(dtype).bits // 8
    for step in (0, 200, 400, 500, 600, 650, 700, 750, 800):
        lens_list = workload_contexts(step)
        batch = len(lens_list)
        k_cache, v_cache, tables, lens = paged(lens_list, 256, dtype)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
        expected = ref.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, D**-0.5)
        nbytes = sum(lens_list) * HKV * D * 2 * esize
        floor = nbytes / BANDWIDTH * 1e6
        longest = torch.argsort(lens, descending=True, stable=True).int()
        for label, order, splits in (("request order", None, None), ("longest first", longest, None),
                                     ("longest first, 2 splits", longest, 2), ("longest first, 3 splits", longest, 3),
                                     ("request order, 2 splits", None, 2)):
            fn = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, D**-0.5,
                                   seq_order=order, num_splits=splits)
            err = ((fn().float() - expected.float()).norm() / expected.float().norm()).item()
            assert err < 2e-2, f"relative error {err:.2e}"
            t = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
            name = f"decode mixed step={step} B={batch} mean ctx={sum(lens_list) // batch} {label}"
            print(f"{name:<84} {t:7.1f} us  {nbytes / t / 1e6:5.2f} TB/s  {floor / t:6.1%} of floor", flush=True)


def bench_prefill(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    # (query lengths, context lengths): one long prompt, many short ones, a chunk after a prefix
    for q_lens, ctx_lens in [([4096], [4096]), ([256] * 16, [256] * 16), ([512], [4096]),
                             ([1024] * 4, [1024, 2048, 3072, 4096])]:
        k_cache, v_cache, tables, lens = paged(ctx_lens, 16, dtype)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=dtype)
        args = (cu, lens, tables, max(q_lens), D**-0.5)
        fn = lambda: paged_prefill_attention(q, k_cache, v_cache, *args)  # noqa: B023
        check = lambda: (fn(), ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args))  # noqa: B023
        # Each query attends to (prefix + i + 1) keys: two matmuls of 2 flops per multiply-add.
        visible = sum(q_n * (c - q_n) + q_n * (q_n + 1) // 2 for q_n, c in zip(q_lens, ctx_lens, strict=True))
        flops = 4 * visible * HQ * D
        nbytes = (sum(ctx_lens) * HKV * D * 2 + 2 * q.numel()) * esize
        report(f"prefill q={q_lens[0]}x{len(q_lens)} ctx<={max(ctx_lens)}", fn, nbytes, flops, check)


PREFILL_SWEEP = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                 for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]


def bench_prefill_sweep(dtype: torch.dtype) -> None:
    """The prefill kernel's launch alternatives (kernels.prefill_attention.TUNING), cold timings: the
    bench's first prefill step (16,384 tokens of its own prompts) at the 0.6B and 8B head counts, one
    16k-token prompt, and a 2k-token chunk after a 14k-token prefix."""
    import random

    from nanoplane.kernels.prefill_attention import LONG_MIN_QUERY, LONG_TUNING, TUNING

    random.seed(0)
    prompts = [len([random.randint(0, 10000) for _ in range(random.randint(100, 1024))]) for _ in range(256)]
    first_step, total = [], 0
    for n in prompts:
        first_step.append(min(n, 16384 - total))
        total += first_step[-1]
        if total == 16384:
            break
    cases = [("bench step", first_step, first_step, HQ), ("bench step 8B heads", first_step, first_step, 32),
             ("one 16k prompt", [16384], [16384], HQ), ("2k chunk after 14k", [2048], [16384], HQ)]
    for name, q_lens, ctx_lens, hq in cases:
        k_cache, v_cache, tables, lens = paged(ctx_lens, 256, dtype)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), hq, D, device="cuda", dtype=dtype)
        args = (cu, lens, tables, max(q_lens), D**-0.5)
        expected = ref.paged_prefill_attention_ref(q, k_cache, v_cache, *args) if max(ctx_lens) <= 4096 else None
        visible = sum(q_n * (c - q_n) + q_n * (q_n + 1) // 2 for q_n, c in zip(q_lens, ctx_lens, strict=True))
        flops = 4 * visible * hq * D
        for tune in PREFILL_SWEEP:
            label = f"prefill {name} " + " ".join(f"{k}={v}" for k, v in tune.items())
            label += " (default)" if tune == (LONG_TUNING if max(q_lens) >= LONG_MIN_QUERY else TUNING) else ""
            fn = functools.partial(paged_prefill_attention, q, k_cache, v_cache, *args, tuning=tune)
            try:
                got = fn()
                if expected is not None:
                    err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
                    assert err < 2e-2, f"relative error {err:.2e}"
                t = triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3
            except Exception as e:  # a tile that does not compile (shared memory) must not end the sweep
                print(f"{label:<88} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            print(f"{label:<88} {t:8.1f} us  {flops / t / 1e6:5.0f} TFLOP/s", flush=True)


def bench_rms_norm(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    for tokens, hidden in [(256, 1024), (256, 4096), (8192, 1024), (8192, 4096)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device="cuda", dtype=dtype)
        report(f"rms_norm T={tokens} H={hidden}", lambda: rms_norm(x, w, 1e-6),  # noqa: B023
               2 * x.numel() * esize, check=lambda: (rms_norm(x, w, 1e-6), ref.rms_norm_ref(x, w, 1e-6)))  # noqa: B023
        report(f"rms_norm+residual T={tokens} H={hidden}", lambda: rms_norm(x, w, 1e-6, res),  # noqa: B023
               4 * x.numel() * esize)


def bench_rotary(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    freqs = torch.outer(torch.arange(40960, device="cuda").float(), torch.rand(D // 2, device="cuda"))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    for tokens in (256, 8192):
        # q and k as views of a fused QKV output, as the model hands them over
        qkv = torch.randn(tokens, HQ + 2 * HKV, D, device="cuda", dtype=dtype)
        q, k = qkv[:, :HQ], qkv[:, HQ : HQ + HKV]
        pos = torch.randint(0, 40960, (tokens,), device="cuda")
        nbytes = 2 * (HQ + HKV) * D * tokens * esize + tokens * (D * 4 + 8)
        report(f"rotary T={tokens}", lambda: apply_rotary(q, k, pos, cos_sin), nbytes)  # noqa: B023


def bench_store(dtype: torch.dtype) -> None:
    esize = torch.finfo(dtype).bits // 8
    k_cache = torch.empty(4096, 16, HKV, D, device="cuda", dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    for tokens in (256, 8192):
        qkv = torch.randn(tokens, HQ + 2 * HKV, D, device="cuda", dtype=dtype)
        key, value = qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
        slots = torch.randperm(k_cache.shape[0] * 16, device="cuda")[:tokens]
        nbytes = 4 * tokens * HKV * D * esize + tokens * 8
        report(f"store_kvcache T={tokens}", lambda: store_kvcache(key, value, k_cache, v_cache, slots),  # noqa: B023
               nbytes)


def bench_sample(dtype: torch.dtype) -> None:
    from nanoplane.dataplane.sampler import Sampler

    esize = torch.finfo(dtype).bits // 8
    vocab = 151936  # Qwen3
    torch_path = Sampler(torch.device("cuda"), fused=False)
    for rows, temp in [(1, 0.8), (32, 0.8), (256, 0.8), (512, 0.8), (256, 0.0)]:
        logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
        t = torch.full((rows,), temp, device="cuda")
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        offsets = torch.randint(0, 2**20, (rows,), device="cuda")
        ids = sample(logits, t, seeds, offsets)
        expected = ref.sample_reference(logits, t, sampling_uniforms(seeds, offsets, vocab))
        # Equal but for near-ties: the kernel sums a group's exponentials in fp32, the reference in fp64.
        assert (ids == expected).float().mean() >= 0.99, f"sample R={rows}: ids differ from the reference"
        nbytes = logits.numel() * esize
        name = f"R={rows} V={vocab} T={temp}"
        report(f"sample fused {name}", lambda: sample(logits, t, seeds, offsets), nbytes)  # noqa: B023
        k, p, m = (torch.zeros(rows, dtype=torch.int32, device="cuda"), torch.ones(rows, device="cuda"),
                   torch.zeros(rows, device="cuda"))
        # As rank 0 ran it before the fused kernel: argmax of the raw logits when all rows are greedy,
        # else the fp32 copy of the logits and the torch path.
        torch_fn = ((lambda: logits.argmax(dim=-1)) if temp == 0 else  # noqa: B023
                    lambda: torch_path(logits.float(), t, k, p, m, [None] * rows, all_greedy=False,  # noqa: B023
                                       filtered=False))
        report(f"sample torch {name}", torch_fn, nbytes, graph=False)
        if temp and rows in (1, 256):  # the launch's tile size, for tuning the launcher's default
            for block in (256, 512, 1024, 2048):
                report(f"sample fused {name} block={block}",
                       lambda: sample(logits, t, seeds, offsets, block=block), nbytes)  # noqa: B023


BENCHES = {"read": bench_read, "decode": bench_decode, "decode_mixed": bench_decode_mixed,
           "decode_sweep": bench_decode_sweep,
           "prefill": bench_prefill, "prefill_sweep": bench_prefill_sweep, "rms_norm": bench_rms_norm,
           "rotary": bench_rotary, "store": bench_store, "sample": bench_sample, "skinny": bench_skinny,
           "skinny_sweep": bench_skinny_sweep, "mid_sweep": bench_mid_sweep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = ",".join(name for name in BENCHES if not name.endswith("_sweep"))  # sweeps are for tuning only
    parser.add_argument("--only", default=default, help="comma-separated subset of " + ",".join(BENCHES))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--gemm-shapes", default="0.6b", choices=sorted(gemm.GEMM_SHAPES),
                        help="the linear layers skinny, skinny_sweep and mid_sweep time (one rank's shard)")
    args = parser.parse_args()
    gemm.SKINNY_SHAPES = gemm.GEMM_SHAPES[args.gemm_shapes]
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype}  floor at {BANDWIDTH / 1e12:.2f} TB/s")
    for name in args.only.split(","):
        BENCHES[name](DTYPES[args.dtype])


if __name__ == "__main__":
    main()
