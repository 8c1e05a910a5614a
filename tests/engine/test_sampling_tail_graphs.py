"""The sampling tail in the decode-graph step on a CPU: processors run between the model's graph and
the sampling tail's graph, logprobs right after, and the results equal the eager step's. A step
with no processor, bitmask or logprobs row runs exactly today's path. A "graph" replays by calling
its function again (as in tests/engine/test_decode_graphs.py)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from support.plane_driver import PlaneDriver

from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.dataplane.cuda_graphs import DecodeGraphs
from nanoplane.dataplane.model_runner import ModelRunner
from nanoplane.proto.plane import SamplingSpec, int32_column

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1 and no GPU")


class Replay:
    def __init__(self, fn, out, counts: dict, name: str):
        self.fn, self.out, self.counts, self.name = fn, out, counts, name

    def replay(self) -> None:
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        result = self.fn()
        if result is not None and result is not self.out:
            self.out.copy_(result)


class EagerGraphs(DecodeGraphs):
    def __init__(self, *args, **kwargs):
        self.counts: dict[str, int] = {}
        self._recorded = 0
        super().__init__(*args, **kwargs)

    def _record(self, fn, pool):
        name = ["model", "greedy", "sample"][self._recorded % 3]
        self._recorded += 1
        out = fn()
        return Replay(fn, out, self.counts, name), out, pool


def specs():
    f32 = (lambda *v: np.array(v, dtype=np.float32))
    return [SamplingSpec(0.0, logprobs=2, repetition_penalty=1.4),
            SamplingSpec(0.9, seed=11, presence_penalty=1.0, frequency_penalty=0.5, logprobs=0),
            SamplingSpec(0.0),
            SamplingSpec(0.0, min_tokens=3, stop_ids=int32_column([7]), logit_bias_ids=int32_column([7]),
                         logit_bias_values=f32(100.0)),
            SamplingSpec(1.0, logprobs=4)]


def run(path, graphs: bool, chosen):
    from nanoplane import kernels

    r = ModelRunner(DataPlaneConfig(str(path), device="cpu", attention_backend="triton", block_size=16,
                                    num_kvcache_blocks=64, max_num_seqs=8))
    try:
        r.sampler.fused = r.tail.fused = True
        if graphs:
            r.graphs = EagerGraphs(r.model, r.state.token_buf, 8, r.state.max_blocks, r.hf_config.hidden_size,
                                   r.dtype, r.device, with_head=True, sample=kernels.sample)
        rng = random.Random(6)
        prompts = [[rng.randrange(1, 380) for _ in range(n)] for n in (4, 19, 9, 5, 12)]
        recs = PlaneDriver(r, 16).generate([prompts[i] for i in chosen], [specs()[i] for i in chosen], max_tokens=6)
        return recs, (r.graphs.counts if graphs else {})
    finally:
        r.close()


def test_processors_and_logprobs_in_the_graph_step_equal_the_eager_step(tiny_models):
    path = tiny_models["qwen3"]
    everything = list(range(5))
    eager, _ = run(path, graphs=False, chosen=everything)
    graphed, counts = run(path, graphs=True, chosen=everything)
    assert counts["model"] > 0 and counts.get("sample", 0) > 0  # the tail's graph after the processors
    for e, g in zip(eager, graphed, strict=True):
        assert g.tokens == e.tokens
        assert len(g.logprobs) == len(e.logprobs)
        for (lp, rank, ids, lps), (lp2, rank2, ids2, lps2) in zip(g.logprobs, e.logprobs, strict=True):
            assert abs(lp - lp2) < 1e-5 and rank == rank2 and ids == ids2
            np.testing.assert_allclose(lps, lps2, atol=1e-5)
    assert 7 not in eager[3].tokens[:3] and eager[3].tokens[3:] == [7] * 3


def test_a_step_without_tail_rows_takes_todays_path(tiny_models, monkeypatch):
    from nanoplane.dataplane.sampling_tail import SamplingTail

    calls = []
    for name in ("before", "after", "prompt_logprobs"):
        original = getattr(SamplingTail, name)
        monkeypatch.setattr(SamplingTail, name, lambda self, *a, _o=original, _n=name: (calls.append(_n), _o(self, *a)))
    recs, counts = run(tiny_models["qwen3"], graphs=True, chosen=[2])
    assert len(recs[0].tokens) == 6 and counts.get("greedy", 0) > 0
    assert calls == []
