"""The model folder's tokenizer files as one zip and its SHA-256: what vllm.grpc.engine's GetTokenizer
streams, so a gateway builds the same tokenizer as the engine without reading its disk."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk, as the gateway's client expects
# The files a tokenizer (and the gateway's chat template and stop handling) may need, as SMG's
# servicers bundle them.
NAMES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
         "chat_template.json")
PATTERNS = ("*.tiktoken", "*.jinja")


def build(model_dir: Path) -> tuple[bytes, str]:
    """The zip's bytes and their SHA-256 hex digest; FileNotFoundError if the folder has no tokenizer."""
    files = [model_dir / n for n in NAMES] + sorted(p for pattern in PATTERNS for p in model_dir.glob(pattern))
    files = [f for f in dict.fromkeys(files) if f.is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            zf.write(f, f.name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes) -> Iterator[bytes]:
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start:start + CHUNK_BYTES]


class TokenizerArchive:
    """Built once, off the event loop, on first request (the folder is fixed for the server's life)."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._built: tuple[bytes, str] | None = None

    async def get(self) -> tuple[bytes, str]:
        if self._built is None:
            self._built = await asyncio.to_thread(build, self.model_dir)
        return self._built
