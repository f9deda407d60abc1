"""Tiny GGUF files as llama.cpp writes them (the `gguf` library's writer, llama.cpp's tensor names, Q/K
permutation and tokenizer keys), from tiny mlx-lm models and a byte-level vocabulary trained here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
GEMMA3_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
PHI3_NAMES = {**LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # fused, as llama.cpp's
TEXTS = ["Hello world! Once upon a time, 1234 apples.",
         "Emoji 🙂🚀 and CJK 世界你好, accents: café, naïve, Ærøskøbing, Zürich.",
         "def f(x):\n    return {'a': x ** 2}  # code\n\tif x != 0: print(f\"{x:>4}\")",
         "  leading spaces\n\nnew lines \r\n end"]


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name for an mlx-lm one."""
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        names = {"gemma3": GEMMA3_NAMES, "phi3": PHI3_NAMES}.get(arch, LAYER_NAMES)
        return f"blk.{index}.{names[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of llama's Q/K rows: Hugging Face's half-split rotary order to interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(dims: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int, **_) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py writes as ``rope_freqs.weight`` for Llama 3.1's RoPE scaling: per
    rotary frequency the number it is divided by (1 for short wavelengths, ``factor`` for long ones, smoothed
    between), from Meta's formula, by hand."""
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * np.pi * base ** (i / dims)
        if wavelen < original_max_position_embeddings / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_max_position_embeddings / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def byte_level_vocab():
    """A byte-level BPE (tokens in GPT-2's byte alphabet, merges) trained on a little text, with the
    SmolLM split (digits alone, then GPT-2's regex), and the `tokenizers` tokenizer it came from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    data = json.loads(tok.to_str())["model"]
    tokens = sorted(data["vocab"], key=data["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["merges"]]
    return tok, tokens, merges


# Where each type's fp16 scale(s) sit in its block (llama.cpp's ggml-common.h block structs).
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                 "IQ4_NL": (0,), "IQ4_XS": (0,)}


def blocks(x: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """``x`` [rows, cols] as ``qtype`` blocks (uint8 [rows, bytes]): the `gguf` package's quantizer where it
    has one; else random blocks of that type's layout with small fp16 scales (the package dequantizes every
    type, and that is what a reader must match)."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "BF16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    try:
        return gguf.quants.quantize(x, kind)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (x.shape[0], x.shape[1] // block, size), dtype=np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-5, 1e-4, data.shape[:2]).astype(np.float16)
        data[..., at:at + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(x.shape[0], -1)


def write_gguf(path: Path, model, tokens, *, arch: str = "llama", qtype: str = "F32", merges=None,
               scores=None, kind: str = "gpt2", pre: str = "smollm", extra=None, tied: bool = False,
               tensor_types=None, extra_tensors=None) -> Path:
    """``model`` (a tiny mlx-lm llama/qwen3/gemma3_text) as llama.cpp writes it: its tensors renamed, llama's Q
    and K permuted (unless the model's rope is traditional), Gemma's norms stored as ``1 + w``, 2-D weights in
    ``qtype`` (or ``tensor_types[gguf name]``; :func:`blocks`), norms in F32, no ``output.weight`` where
    ``tied``, linear RoPE scaling and Gemma's sliding window as keys, Llama 3's RoPE scaling as llama.cpp's
    ``rope_freqs`` tensor, ``extra_tensors`` (GGUF name: float32 array) as they are, and a tokenizer's metadata."""
    args = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(4096)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, args.rope_theta, **scaling))
    if arch == "gemma3":
        w.add_sliding_window(args.sliding_window)
    w.add_tokenizer_model(kind)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    types = [3 if t.startswith("<|") or t in ("<s>", "</s>", "<unk>") else 1 for t in tokens]
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for key, value in (extra or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int) else w.add_string)(key, value)
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        if tied and name == "lm_head.weight":
            continue
        x = np.array(value.astype(mx.float32))
        if arch == "llama" and not getattr(args, "rope_traditional", False) and name.endswith(
                ("q_proj.weight", "k_proj.weight")):  # a traditional-rope model is in llama.cpp's order already
            heads = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
            x = interleave(x, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1  # llama.cpp's convert_hf_to_gguf.py: Gemma3RMSNorm computes with (1 + w)
        named = gguf_name(name, arch)
        kind_of = (tensor_types or {}).get(named, qtype) if x.ndim == 2 else "F32"
        if kind_of == "F32":
            w.add_tensor(named, x)
        else:
            w.add_tensor(named, blocks(x, kind_of), raw_dtype=gguf.GGMLQuantizationType[kind_of])
    for named, x in (extra_tensors or {}).items():
        w.add_tensor(named, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
