"""Real data-plane launchers (`python -m nanoplane.dataplane.launcher`, a tiny model on the CPU) and an engine
over them, checked against the embedded engine's greedy tokens."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from nanoplane.controlplane.config import EngineConfig
from nanoplane.controlplane.dataplane_client import RemoteDataPlane
from nanoplane.controlplane.engine import Engine
from nanoplane.controlplane.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LENGTHS = [1, 17, 40, 130, 5, 70]  # 130 and 70 do not fit a 64-token step: chunked prefill
SIZES = dict(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=64)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 380) for _ in range(n)] for n in lengths]


def launch(model: Path, address: str, tp: int, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanoplane.dataplane.launcher", "--model", str(model), "--control", address,
           "--tensor-parallel-size", str(tp), "--device", "cpu", "--num-kvcache-blocks", "256",
           "--heartbeat-interval", "0.2", "--control-timeout", "3"]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()] + list(extra)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)


def engine_over(client: RemoteDataPlane, model: Path) -> Engine:
    return Engine(EngineConfig(str(model), device="cpu", kvcache_block_size=16, **SIZES), client, ())


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    return [s.completion_token_ids for s in seqs]


def check_tokens(engine: Engine, reference: dict, seed: int) -> None:
    prompts = random_prompts(LENGTHS, seed)
    chunked = engine.scheduler.num_chunked_prefills
    for p, out in zip(prompts, generate(engine, prompts), strict=True):
        assert out == reference[(seed, len(p))], f"prompt of {len(p)} tokens"
    assert engine.scheduler.num_chunked_prefills > chunked


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill each launcher still running, with whatever ranks it left (they run in its session)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def embedded_reference(model: Path) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of the embedded engine (in-process data plane) on the seeds' prompts."""
    from nanoplane.controlplane.llm import LLM

    llm = LLM(str(model), device="cpu", kvcache_block_size=16, **SIZES)
    try:
        out = {}
        for seed in (0, 1):
            prompts = random_prompts(LENGTHS, seed)
            for p, o in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False), strict=True):
                out[(seed, len(p))] = o["token_ids"]
        return out
    finally:
        llm.close()
