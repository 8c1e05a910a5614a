"""The all-reduce of a tensor-parallel step on two GPUs: NCCL against the one-shot symmetric-memory
kernels (`dataplane/allreduce.py`: torch's, and the Triton one of kernels/one_shot_all_reduce.py), per
call, at the sizes decode and prefill steps sum; and the Triton one followed by the RMSNorm after it,
against the kernel that fuses the two.

Each size is timed inside a CUDA graph of 20 calls (as the decode graph runs them) and eagerly, back
to back. Floor: the bytes one rank must read from its peer over NVLink, at the link's ~450 GB/s one
way (NV18 on an H200 host).

    python -m benchmarks.allreduce            # needs two CUDA GPUs
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

HIDDEN = 4096  # Qwen3-8B
ROWS = (1, 16, 64, 128, 256, 512, 1024, 2048)
NVLINK = 450e9  # bytes/s one way, NV18


def timed(fn, reps: int = 20, graph: bool = True) -> float:
    """Microseconds a call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(reps):
                fn()
    run()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def worker(rank: int, port: int) -> None:
    from nanoplane.dataplane.allreduce import SymmMemAllReduce, TritonOneShotAllReduce
    from nanoplane.kernels import rms_norm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    fasts = [cls(device, torch.bfloat16, max_bytes=8 << 20) for cls in (SymmMemAllReduce, TritonOneShotAllReduce)]
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    triton_ar = fasts[1]
    rows_out = []
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        nbytes = x.numel() * x.element_size()
        cells = [timed(lambda x=x: dist.all_reduce(x)), timed(lambda x=x: dist.all_reduce(x), graph=False)]
        for fast in fasts:
            if fast(x) is not None:
                cells += [timed(lambda x=x, f=fast: f(x)), timed(lambda x=x, f=fast: f(x), graph=False)]
            else:
                cells += [float("nan")] * 2
        # A decoder layer's sum and the RMSNorm after it: two kernels, or the fused one (graph).
        if triton_ar(x) is not None:
            r = torch.randn_like(x)
            cells += [timed(lambda x=x, r=r: rms_norm(triton_ar(x), weight, 1e-6, r)),
                      timed(lambda x=x, r=r: triton_ar.add_rms_norm(x, r, weight, 1e-6))]
        else:
            cells += [float("nan")] * 2
        rows_out.append((rows, nbytes, *cells))
    if rank == 0:
        print("| rows x 4096 bf16 | bytes | NCCL graph us | NCCL eager us | torch one-shot graph us | "
              "torch one-shot eager us | Triton one-shot graph us | Triton one-shot eager us | "
              "Triton one-shot, then RMSNorm (graph) | fused (graph) | floor us |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for rows, nbytes, *cells in rows_out:
            times = " | ".join(f"{c:.1f}" if c == c else "over buffer" for c in cells)  # NaN: not taken
            print(f"| {rows} | {nbytes:,} | {times} | {nbytes / NVLINK * 1e6:.1f} |")
    dist.destroy_process_group()


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from nanoplane.process import free_port

    if torch.cuda.device_count() < 2:
        sys.exit("needs two CUDA GPUs")
    torch.multiprocessing.spawn(worker, args=(free_port(),), nprocs=2)


if __name__ == "__main__":
    main()
