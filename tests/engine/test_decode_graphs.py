"""The decode-graph step on a CPU: static input packing per bucket, padding rows, the LM head and the
sampling tails (argmax, the fused sampler in Triton's interpreter, the token write-back) give the
tokens of the eager step. A "graph" here replays by calling its function again; on a GPU
tests/engine/test_gpu_engine.py runs the same comparison with captured CUDA graphs."""

from __future__ import annotations

import os
import random

import pytest
import torch

from nanoplane.controlplane import LLM, SamplingParams
from nanoplane.dataplane.cuda_graphs import DecodeGraphs, bucket_sizes

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1 and no GPU")


class Replay:
    def __init__(self, fn, out, counts: dict, name: str):
        self.fn, self.out, self.counts, self.name = fn, out, counts, name

    def replay(self) -> None:
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        result = self.fn()
        if result is not None and result is not self.out:
            self.out.copy_(result)  # a graph rewrites its output tensor in place


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose capture records the function instead of a CUDA graph."""

    def __init__(self, *args, **kwargs):
        self.counts: dict[str, int] = {}
        self._recorded = 0
        super().__init__(*args, **kwargs)

    def _record(self, fn, pool):
        # Per bucket the capture order is: model, greedy tail, sampling tail (with the head).
        kinds = ["model", "greedy", "sample"] if self.with_head else ["model"]
        name = kinds[self._recorded % len(kinds)]
        self._recorded += 1
        out = fn()
        return Replay(fn, out, self.counts, name), out, pool


def prompts_and_params():
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (3, 21, 9, 30, 5)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.1, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, top_k=5, max_tokens=4, ignore_eos=True)]
    return prompts, params


def generate(tiny_models, prompts, params, graphs: bool, with_head: bool = True):
    from nanoplane import kernels

    llm = LLM(str(tiny_models["qwen3"]), device="cpu", attention_backend="triton", kvcache_block_size=16,
              max_num_seqs=8, seed=1)
    try:
        runner = llm.engine.data_plane.runner
        runner.sampler.fused = True
        counts = {}
        if graphs:
            runner.graphs = EagerGraphs(runner.model, runner.state.token_buf, 8, runner.state.max_blocks,
                                        runner.hf_config.hidden_size, runner.dtype, runner.device,
                                        with_head=with_head, sample=kernels.sample)
            counts = runner.graphs.counts
        outs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()
    return outs, counts


def test_bucket_sizes():
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(256)[-3:] == [224, 240, 256]


def test_graph_step_equals_the_eager_step(tiny_models):
    prompts, params = prompts_and_params()
    eager, _ = generate(tiny_models, prompts, params, graphs=False)
    graphed, counts = generate(tiny_models, prompts, params, graphs=True)
    assert graphed == eager
    assert [len(t) for t in graphed] == [p.max_tokens for p in params]
    # Decode steps went through the model graph and both tails; the top-k row's steps did not use a tail.
    assert counts.get("model", 0) > counts.get("greedy", 0) + counts.get("sample", 0) > 0
    assert counts.get("greedy", 0) > 0 and counts.get("sample", 0) > 0


def test_graph_step_without_the_head_equals_the_eager_step(tiny_models):
    """The tensor-parallel layout (graph ends at the hidden states, eager head and sampling), on one rank."""
    prompts, params = prompts_and_params()
    eager, _ = generate(tiny_models, prompts[:3], params[:3], graphs=False)
    graphed, counts = generate(tiny_models, prompts[:3], params[:3], graphs=True, with_head=False)
    assert graphed == eager and counts.get("model", 0) > 0 and "greedy" not in counts
