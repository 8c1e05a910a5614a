"""nanoplane.settings defines every knob once: the engine's config, the LLM keywords, the data plane's
config and command line, and the tuning variables all follow from it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from nanoplane import settings
from nanoplane.controlplane.config import EngineConfig
from nanoplane.dataplane.config import DataPlaneConfig
from nanoplane.settings import TUNING_VARIABLES, Tuning, read_tuning

ROOT = Path(__file__).resolve().parents[2]
# Reads in files other engineers own, which take their values from settings once the branches merge.
PENDING: set[str] = set()  # files still reading the environment themselves


def test_engine_config_takes_its_fields_and_defaults_from_settings():
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "hf_config")]
    assert sorted(f.name for f in fields) == sorted(settings.ENGINE_OPTIONS)
    for f in fields:
        assert f.default == settings.BY_NAME[f.name].default, f.name


def test_llm_refuses_a_keyword_that_is_no_engine_option(tiny_models):
    from nanoplane.controlplane import LLM

    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_models["qwen3"]), max_num_seq=4)


def test_the_data_plane_gets_every_engine_option_it_reads(tiny_models):
    config = EngineConfig(str(tiny_models["qwen3"]), device="cpu", kvcache_block_size=32, tensor_parallel_size=2,
                          seed=5, enforce_eager=True)
    fields = settings.dataplane_fields(config)
    dp = DataPlaneConfig(**fields)
    assert (dp.block_size, dp.world_size, dp.seed, dp.enforce_eager, dp.device) == (32, 2, 5, True, "cpu")
    # what is not set from the engine: the launcher's numbering, the control plane's epoch, the launcher's own
    assert {f.name for f in dataclasses.fields(DataPlaneConfig)} - set(fields) == {
        "rank", "epoch", "dist_init", "dist_timeout_s"}


def test_tuning_variables_are_the_tuning_fields_with_their_defaults():
    assert [v.field for v in TUNING_VARIABLES] == [f.name for f in dataclasses.fields(Tuning)]
    assert read_tuning({}) == Tuning()
    for v in TUNING_VARIABLES:
        assert getattr(Tuning(), v.field) == v.default, v.env


def test_tuning_is_read_and_checked():
    tuning = read_tuning({"NANOPLANE_PDL": "0", "NANOPLANE_SKINNY_MAX_ROWS": "32", "NANOPLANE_DECODE_ORDER_WAVES": "0",
                          "NANOPLANE_FUSED_SAMPLER": "1", "NANOPLANE_ALLREDUCE": "nccl", "NANOPLANE_CACHE": "/c",
                          "NANOPLANE_STEP_TIMEOUT": "2.5", "NANOPLANE_ENGINE_PROCESS": "0", "OTHER": "x"})
    assert (tuning.pdl, tuning.skinny_max_rows, tuning.decode_order_waves) == (False, 32, 0.0)
    assert tuning.fused_sampler is True
    assert (tuning.allreduce, tuning.cache, tuning.step_timeout, tuning.engine_process) == ("nccl", "/c", 2.5, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.pdl = True
    for env, raw in (("NANOPLANE_SKINNY_MAX_ROWS", "-1"), ("NANOPLANE_SKINNY_MAX_ROWS", "many"),
                     ("NANOPLANE_STEP_TIMEOUT", "0"), ("NANOPLANE_PDL", "sometimes"), ("NANOPLANE_ALLREDUCE", "mpi")):
        with pytest.raises(ValueError, match=f"{env}='{raw}'"):
            read_tuning({env: raw})


def test_the_operations_guide_lists_every_tuning_variable():
    text = (ROOT / "docs" / "operations.md").read_text()
    assert settings.tuning_table() in text, "regenerate the table: python -m nanoplane.settings"


def _environment_reads(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
    return lines


def test_planes_read_no_environment_but_through_settings():
    """kernels and models receive values; the data plane reads its tuning once, through settings."""
    allowed = {"dataplane/allreduce.py"}  # it sets a torch variable (TORCH_SYMM_MEM_DISABLE_MULTICAST)
    found = []
    for package in ("kernels", "models", "dataplane", "controlplane"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if name not in allowed | PENDING and _environment_reads(path):
                found.append(f"{name}:{_environment_reads(path)}")
    assert not found, found
