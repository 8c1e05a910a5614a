"""One line per op for the kernel benchmarks (benchmarks/kernel_speed.py, benchmarks/gemm.py): its time
cold and replayed in a CUDA graph, against the H200's floors."""

import torch
import triton.testing

BANDWIDTH = 4.24e12  # bytes/s: an H200's device copy (read + write)
MATMUL_FLOPS = 787e12  # bf16 dense


def report(name: str, fn, nbytes: int, flops: float = 0.0, check=None, graph: bool = True) -> float:
    """`graph=False` for an op a CUDA graph cannot capture: its graph column then repeats the cold time.
    Returns the graph time (us)."""
    if check is not None:
        got, expected = check()
        err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < 2e-2, f"{name}: relative error {err:.2e}"
    cold = triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3
    graph = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3 if graph else cold
    floor = nbytes / BANDWIDTH * 1e6
    line = (f"{name:<44} cold {cold:9.1f} us  graph {graph:9.1f} us  floor {floor:9.1f} us  "
            f"{floor / graph:6.1%} of floor  {nbytes / graph / 1e3:7.0f} GB/s")
    if flops:
        line += f"  {flops / graph / 1e6:6.0f} TFLOP/s ({flops / MATMUL_FLOPS * 1e6:.1f} us at peak)"
    print(line, flush=True)
    return graph


def time_graph(fn, reps: int = 30) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph (after one eager call, which also
    compiles whatever needs compiling)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    return median_ms(graph.replay, reps)


def median_ms(fn, reps: int) -> float:
    """Median ms of `reps` calls of `fn` on the GPU's clock (CUDA events around each call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
