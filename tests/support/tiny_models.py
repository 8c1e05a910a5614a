"""Tiny seeded random checkpoints in HuggingFace format, made by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 384
EOS = "<|end|>"


def make_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: real multi-byte merges, no network."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "paged attention keeps the cache in blocks",
              "héllo wörld ünïcode ☃ 東京 🙂", "continuous batching serves many requests at once"] * 20
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: Path, arch: str = "qwen3", tie: bool = False, seed: int = 0,
                    num_kv_heads: int = 2, dtype: torch.dtype = torch.float32) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                  tie_word_embeddings=tie, eos_token_id=tok.eos_token_id, bos_token_id=None, rms_norm_eps=1e-6)
    if arch == "qwen3":
        config, cls = Qwen3Config(head_dim=16, rope_theta=10000.0, **common), Qwen3ForCausalLM
    else:
        config, cls = LlamaConfig(rope_theta=10000.0, **common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif p.dim() == 1:
                # Norm weights other than ones: a norm folded into the projection after it
                # (models/norm_fold.py) must carry them over, column by column.
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
