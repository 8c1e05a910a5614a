"""How fast can an H200 read? A plain Triton read of 1 GiB, laid out as a KV cache's rows.

    python benchmarks/read_ceiling.py

The decode attention is a read of the KV cache, so its ceiling is what a kernel that only reads
reaches, not the 4.24 TB/s device copy (read + write) the floors are quoted against, nor torch.sum.
Each program reads one head's 128 features of a run of tokens, from a cache laid out [tokens, heads,
D] (as the data plane's: a head's rows 2 KB apart) or [heads, tokens, D] (a head's rows contiguous).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def read_rows(x_ptr, out_ptr, tokens_per_prog, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
              HEAD_MAJOR: tl.constexpr, STAGES: tl.constexpr):
    """Each program reads tokens_per_prog tokens of one head: [BLOCK_T, D] tiles. HEAD_MAJOR: the
    head's tokens are contiguous (layout [heads, tokens, D]); else interleaved ([tokens, heads, D])."""
    pid = tl.program_id(0)
    head = pid % HEADS
    chunk = pid // HEADS
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    total_tokens = tl.num_programs(0) // HEADS * tokens_per_prog
    for t0 in tl.range(0, tokens_per_prog, BLOCK_T, num_stages=STAGES):
        tok = chunk * tokens_per_prog + t0 + t
        if HEAD_MAJOR:
            off = (head * total_tokens + tok).to(tl.int64)[:, None] * D + d[None, :]
        else:
            off = (tok.to(tl.int64) * HEADS + head)[:, None] * D + d[None, :]
        acc += tl.load(x_ptr + off).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def bench(fn, nbytes):
    ms = triton.testing.do_bench_cudagraph(fn, rep=50)
    return nbytes / ms / 1e9


def main():
    heads, d = 8, 128
    tokens = 1 << 19  # 512k tokens x 8 heads x 128 x 2 B = 1 GiB
    x = torch.randn(tokens * heads * d, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    print(f"torch.sum: {bench(lambda: x.sum(), nbytes):.2f} TB/s")
    print("| layout | tokens a program | BLOCK_T | warps | stages | programs | TB/s |")
    for head_major in (False, True):
        for tpp in (256, 1024):
            for bt in (32, 64):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        progs = tokens // tpp * heads
                        out = torch.empty(progs, device="cuda", dtype=torch.float32)

                        def fn(progs=progs, out=out, tpp=tpp, bt=bt, head_major=head_major, stages=stages,
                               warps=warps):
                            read_rows[(progs,)](x, out, tpp, HEADS=heads, D=d, BLOCK_T=bt, HEAD_MAJOR=head_major,
                                                STAGES=stages, num_warps=warps)
                        tbs = bench(fn, nbytes)
                        print(f"| {'head-major' if head_major else 'interleaved'} | {tpp} | {bt} | {warps} | "
                              f"{stages} | {progs} | {tbs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
