"""Tiny random checkpoints in Hugging Face format, written as transformers writes them.

No hub and no torch: the config comes from transformers' own config classes
(``save_pretrained``), the weights are a bf16 ``model.safetensors`` with Hugging Face
names and ``{"format": "pt"}`` metadata, and the tokenizer is a byte-level BPE
(256 byte tokens, no merges) saved by ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from conftest import tiny_drafter_args, tiny_target
from dflash_mlx import DFlashDrafter, save_drafter

EOS = "<|endoftext|>"  # id 256: outside the model's 256 logits, so never generated


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer: ids 0..255 are the bytes, id 256 is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out)


def hf_config(family: str, target):
    """The transformers config of a tiny target built by ``conftest.tiny_target``."""
    from transformers import LlamaConfig, Qwen3Config

    a = target.model.args
    common = dict(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                  num_key_value_heads=a.num_key_value_heads, rms_norm_eps=a.rms_norm_eps,
                  max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
                  rope_theta=a.rope_theta, dtype="bfloat16")
    if family == "qwen3":
        config = Qwen3Config(head_dim=a.head_dim, **common)
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    return config


def write_hf_target(out: Path, family: str = "qwen3", seed: int = 0, **kwargs) -> Path:
    """A tiny random llama or qwen3 target in Hugging Face format (bf16), in ``out``."""
    _, target = tiny_target(family, seed=seed, **kwargs)
    out.mkdir(parents=True, exist_ok=True)
    hf_config(family, target).save_pretrained(out)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(target.model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def write_drafter(out: Path, family: str = "qwen3", seed: int = 1, hidden: int = 64, **kwargs) -> Path:
    """A random drafter for ``write_hf_target``'s target (of width ``hidden``), in the
    released format (bf16)."""
    _, target = tiny_target(family, hidden=hidden)
    mx.random.seed(seed)
    drafter = DFlashDrafter(tiny_drafter_args(target, **kwargs))
    drafter.set_dtype(mx.bfloat16)
    mx.eval(drafter.parameters())
    return save_drafter(drafter, out)


def edit_config(folder: Path, **changes) -> None:
    """Set (value) or delete (None) top-level keys of ``folder/config.json``."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
