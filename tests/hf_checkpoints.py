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


def write_dspark(out: Path, target, markov_rank: int = 16, confidence: bool = True, layers: int = 2,
                 block_size: int = 7, seed: int = 3, dtype=mx.bfloat16, **config_changes) -> Path:
    """A random ``Qwen3DSparkModel`` drafter for ``target`` (a tiny qwen3 adapter) in DeepSpec's released schema,
    written here from DFLASH_SPEC.md section 11 (not by ``save_drafter``): the target's Qwen3 config keys with the
    DSpark keys at the top level, ``embed_tokens``/``lm_head`` copies of the target's (in ``dtype``), a rank
    ``markov_rank`` Markov head (0: none, DeepSeek's DFlash block7) and a confidence head reading it."""
    import numpy as np

    a, H, V = target.model.args, target.hidden_size, target.vocab_size
    rng = np.random.default_rng(seed)

    def w(*shape, norm=False):
        v = 1.0 + 0.1 * rng.standard_normal(shape) if norm else rng.standard_normal(shape) / np.sqrt(shape[-1])
        return mx.array(v.astype(np.float32))

    embed = target.inner.embed_tokens
    weights = {"embed_tokens.weight": embed.weight, "lm_head.weight": getattr(target.text, "lm_head", embed).weight,
               "fc.weight": w(H, 2 * H), "hidden_norm.weight": w(H, norm=True), "norm.weight": w(H, norm=True)}
    for i in range(layers):
        p = f"layers.{i}."
        weights.update({p + "input_layernorm.weight": w(H, norm=True),
                        p + "post_attention_layernorm.weight": w(H, norm=True),
                        p + "self_attn.q_proj.weight": w(64, H), p + "self_attn.k_proj.weight": w(32, H),
                        p + "self_attn.v_proj.weight": w(32, H), p + "self_attn.o_proj.weight": w(H, 64),
                        p + "self_attn.q_norm.weight": w(16, norm=True),
                        p + "self_attn.k_norm.weight": w(16, norm=True),
                        p + "mlp.gate_proj.weight": w(128, H), p + "mlp.up_proj.weight": w(128, H),
                        p + "mlp.down_proj.weight": w(H, 128)})
    if markov_rank:
        weights.update({"markov_head.markov_w1.weight": 2 * w(V, markov_rank),
                        "markov_head.markov_w2.weight": 2 * w(V, markov_rank)})
    if confidence:
        weights.update({"confidence_head.proj.weight": w(1, H + markov_rank), "confidence_head.proj.bias": w(1)})
    config = {
        "architectures": ["Qwen3DSparkModel"], "attention_bias": False, "attention_dropout": 0.0,
        "block_size": block_size, "bos_token_id": None, "eos_token_id": None, "head_dim": a.head_dim,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 128,
        "layer_types": ["full_attention"] * layers, "mask_token_id": V - 1, "max_position_embeddings": 4096,
        "max_window_layers": 28, "model_type": "qwen3", "num_anchors": 512, "num_attention_heads": 4,
        "num_hidden_layers": layers, "num_key_value_heads": 2, "num_target_layers": target.num_layers,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": a.rope_theta, "sliding_window": None,
        "target_layer_ids": [1, target.num_layers - 1], "tie_word_embeddings": False,
        "torch_dtype": str(dtype).rsplit(".", 1)[-1],
        "use_cache": True, "use_sliding_window": False, "vocab_size": V, "markov_rank": markov_rank,
        "enable_confidence_head": confidence,
    }
    if markov_rank:
        config["markov_head_type"] = "vanilla"
    if confidence:
        config["confidence_head_with_markov"] = bool(markov_rank)
    config.update(config_changes)
    out.mkdir(parents=True, exist_ok=True)
    if dtype == mx.float32:  # as the hub's files are written (numpy has no bfloat16)
        from safetensors.numpy import save_file

        save_file({k: np.array(v) for k, v in weights.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()},
                            metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_hf_gemma4_target(out: Path, seed: int = 0) -> Path:
    """conftest's tiny gemma4_text target as an mlx-lm folder (its ``ModelArgs`` as ``config.json``, float32 weights
    under mlx-lm's names: MLX's CPU gather_mm of its MoE block takes float32 only; the byte tokenizer)."""
    import dataclasses

    model, _ = tiny_target("gemma4_text", seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    config = {**dataclasses.asdict(model.args), "architectures": ["Gemma4ForCausalLM"], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def write_gemma4_dspark(out: Path, target, seed: int = 3, dtype=mx.bfloat16, **config_changes) -> Path:
    """A random ``Gemma4DSparkModel`` drafter for ``target`` (conftest's tiny gemma4_text adapter, float32) as DeepSpec
    writes one (gemma4/config.py: the target's text config copied, the drafter's keys at the top level; weights
    under the names tests/test_formats.py's ``released_keys`` checks): 2 layers, rank-16 Markov head, a confidence
    head reading it, copies of the target's embedding and head."""
    from conftest import format_drafter

    drafter = format_drafter(target, "gemma4-dspark", seed=seed, bind=False)
    a, t = drafter.args, target.model.args
    config = {
        "architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_dropout": 0.0, "attention_k_eq_v": True, "block_size": a.block_size, "enable_moe_block": False,
        "final_logit_softcapping": t.final_logit_softcapping, "global_head_dim": 32, "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": a.hidden_size, "hidden_size_per_layer_input": 0,
        "intermediate_size": a.intermediate_size, "layer_types": ["full_attention"] * 2, "mask_token_id": 255,
        "max_position_embeddings": 4096, "num_attention_heads": 4, "num_global_key_value_heads": 1,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_kv_shared_layers": t.num_kv_shared_layers,
        "num_target_layers": target.num_layers, "rms_norm_eps": 1e-6, "sliding_window": t.sliding_window,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "target_layer_ids": a.target_layer_ids, "tie_word_embeddings": False, "use_double_wide_mlp": False,
        "vocab_size": a.vocab_size, "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "num_anchors": 512, "torch_dtype": str(dtype).rsplit(".", 1)[-1],
    }
    config.update(config_changes)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
