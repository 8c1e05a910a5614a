"""The all-reduce the row-parallel layers call: the hook, the choice of implementation, and on two
GPUs the one-shot all-reduce over symmetric memory against NCCL (eager and inside a CUDA graph) and
the engine's greedy tokens with it."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.distributed as dist
from conftest import hf_greedy

from nanoplane.dataplane.allreduce import make_fast_all_reduce
from nanoplane.models.layers import parallel
from nanoplane.process import free_port
from nanoplane.settings import read_tuning


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        parallel.set_fast_all_reduce(None)
        dist.destroy_process_group()


def test_all_reduce_takes_the_fast_path_or_falls_back_to_the_group(single_rank_group):
    x = torch.arange(6.0)
    seen = []
    parallel.set_fast_all_reduce(lambda t: seen.append(t.numel()) or (t * 2 if t.numel() <= 4 else None))
    small = parallel.all_reduce(torch.ones(4))
    assert torch.equal(small, torch.full((4,), 2.0))  # the fast path's result
    big = parallel.all_reduce(x)
    assert big is x and torch.equal(big, torch.arange(6.0))  # declined: summed by the group (one rank)
    assert seen == [4, 6]


def test_choice_of_all_reduce():
    with pytest.raises(ValueError, match="expected 'nccl', 'symm_mem' or 'triton'"):
        read_tuning({"NANOPLANE_ALLREDUCE": "ring-of-fire"})
    with pytest.raises(ValueError, match="expected 'nccl', 'symm_mem' or 'triton'"):
        make_fast_all_reduce(torch.device("cpu"), torch.float32, 2, "ring-of-fire")
    assert make_fast_all_reduce(torch.device("cpu"), torch.float32, 2, "symm_mem") is None  # CPU ranks: gloo
    assert make_fast_all_reduce(torch.device("cuda", 0), torch.float32, 1, "symm_mem") is None  # one rank
    assert make_fast_all_reduce(torch.device("cuda", 0), torch.bfloat16, 2, "nccl") is None  # NCCL asked for
    assert read_tuning({}).allreduce == "triton"  # the default: more tokens/s than NCCL at TP=2 (BENCHMARKS.md)
    assert read_tuning({"NANOPLANE_ALLREDUCE": ""}).allreduce == "triton"


def _set_up(rank: int, port: int, fail: str, queue) -> None:
    from nanoplane.dataplane.allreduce import set_up_everywhere

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    met = []

    class Fake:
        def meet(self):
            if fail == f"meet{rank}":
                raise RuntimeError("no peer access")
            if fail == f"import{rank}":
                raise ImportError("No module named 'triton'")
            met.append(rank)

    def make():
        if fail == f"make{rank}":
            raise RuntimeError("out of memory")
        return Fake()

    try:
        got = set_up_everywhere(make, torch.device("cpu"))
        queue.put((rank, got is not None, met))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fail", ["", "make1", "meet0", "import0"])
def test_ranks_agree_on_the_fast_path(fail):
    """A rank that fails to allocate keeps every rank out of the rendezvous; one that fails in it
    (or cannot import its kernel) sends every rank back to NCCL; no failure: every rank has the fast path."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_set_up, args=(rank, port, fail, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    results = dict((rank, (ok, met)) for rank, ok, met in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    if fail == "":
        assert results == {0: (True, [0]), 1: (True, [1])}
    elif fail == "make1":
        assert results == {0: (False, []), 1: (False, [])}  # nobody entered the rendezvous
    else:
        assert results == {0: (False, []), 1: (False, [1])}


def _kill_trees(procs) -> None:
    import psutil

    for proc in procs:
        if proc.pid is None:
            continue
        try:
            tree = psutil.Process(proc.pid)
            victims = tree.children(recursive=True) + [tree]
        except psutil.NoSuchProcess:
            continue
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        proc.join(timeout=10)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _compare_with_nccl(rank: int, port: int, choice: str, queue) -> None:
    from nanoplane.dataplane.allreduce import CHOICES

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        errors = []
        for dtype in (torch.bfloat16, torch.float32):
            fast = CHOICES[choice](torch.device("cuda", rank), dtype, max_bytes=4 << 20)
            gen = torch.Generator(device="cuda").manual_seed(rank)
            for rows in (1, 7, 256):
                x = torch.randn(rows, 4096, device="cuda", generator=gen).to(dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                errors.append(float((fast(x) - ref).abs().max()))
            assert fast(torch.zeros(2048, 2048, device="cuda", dtype=dtype)) is None  # 8 or 16 MiB: NCCL
            # Captured in a graph, replayed on new inputs.
            static = torch.zeros(16, 4096, device="cuda", dtype=dtype)
            fast(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fast(static)
            for _ in range(3):
                static.copy_(torch.randn(16, 4096, device="cuda", generator=gen).to(dtype))
                ref = static.clone()
                dist.all_reduce(ref)
                graph.replay()
                errors.append(float((out - ref).abs().max()))
            # Calls back to back in one graph, of changing sizes (as a decode step's layers and the
            # embedding make them): no call may see a peer's buffer from the call before.
            inputs = [torch.zeros(rows, 4096, device="cuda", dtype=dtype) for rows in (3, 256, 1, 64) * 5]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [fast(x) for x in inputs]
            for x in inputs:
                x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(dtype))
            refs = [x.clone() for x in inputs]
            for ref in refs:
                dist.all_reduce(ref)
            graph.replay()
            errors.append(max(float((out - ref).abs().max()) for out, ref in zip(outs, refs, strict=True)))
        queue.put((rank, errors))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("choice", ["symm_mem", "triton"])
def test_one_shot_all_reduce_equals_nccl(choice):
    """Two operands: a + b is the same sum in either order, so the results must be equal, not close."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_compare_with_nccl, args=(rank, port, choice, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        _kill_trees(procs)  # a rank spinning in a kernel must fail the test, not hang pytest's exit
    assert sorted(results) == [0, 1]
    for errors in results.values():
        assert len(errors) == 14 and max(errors) == 0.0


def _engine_tokens(path: str, prompts: list[list[int]], choice: str, queue) -> None:
    """The engine's greedy tokens with `choice` as the all-reduce, in a process of its own: rank 0 of
    each engine is then a fresh process (a second engine's group in one process falls back to NCCL)."""
    import os

    from nanoplane.controlplane import LLM, SamplingParams

    os.environ["NANOPLANE_ALLREDUCE"] = choice  # the spawned rank inherits it
    llm = LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, attention_backend="triton",
              kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=8)
    try:
        fast = getattr(parallel._fast_all_reduce, "name", "nccl")
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        queue.put((fast, [o["token_ids"] for o in outs]))
    finally:
        llm.close()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("choice", ["symm_mem", "triton", ""])  # "": the default
def test_engine_tp2_with_one_shot_all_reduce_matches_transformers(tiny_models, choice):
    path = tiny_models["qwen3"]
    rng = random.Random(8)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (1, 17, 90)]
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine_tokens, args=(str(path), prompts, choice, queue))
    proc.start()
    try:
        fast, tokens = queue.get(timeout=300)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        _kill_trees([proc])  # the engine's rank 1 is a grandchild
    assert fast == (choice or "triton"), "rank 0 fell back to NCCL (see the warning)"
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(path, prompt, 16)


def test_a_set_up_for_a_second_process_group_is_refused(monkeypatch):
    from nanoplane.dataplane import allreduce

    monkeypatch.setattr(allreduce, "_first_group", [object()])  # an earlier engine's group
    for cls in allreduce.CHOICES.values():
        with pytest.raises(RuntimeError, match="for another process group"):
            cls(torch.device("cpu"), torch.float32, group=object(), meet=False)
