"""A GGUF file (llama.cpp's format, as Ollama and LM Studio keep models) as an mlx-lm model folder:
``config.json``, ``model.safetensors`` and the tokenizer files (:mod:`.gguf_tokenizer`).

MLX reads the tensors (``mx.load``): F32 and F16 as they are, Q4_0, Q4_1 and Q8_0 as MLX affine-quantized
weights (group size 32, 4 or 8 bits) that stay quantized unless a dtype is asked for. BF16 is read here from
the raw bytes (MLX would narrow it to float16). Every other type (K-quants, I-quants, ...) is refused:
the ``gguf`` library's reader names each tensor's type before anything is loaded.

Architectures (``general.architecture``): ``llama`` (Q and K stored in the interleaved rotary order, read
by mlx-lm's llama with ``rope_traditional``), ``qwen2`` and ``qwen3`` (rotary order as in Hugging Face)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..errors import CheckpointError, ConfigError

GROUP_SIZE = 32  # the block of every GGUF quantization MLX reads (Q4_0, Q4_1, Q8_0)
READ_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF tensor names (llama.cpp's gguf-py tensor_mapping) -> mlx-lm module paths, per layer and outside.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "bias", "scales", "biases")


def is_gguf(path: str | Path) -> bool:
    """True for a path to a file whose name ends in ``.gguf`` (what ``--model`` treats as a GGUF file)."""
    return str(path).lower().endswith(".gguf")


def read_gguf(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    """The tensors (GGUF names; quantized ones as ``NAME.weight``/``.scales``/``.biases``) and the metadata.

    Raises:
        CheckpointError: the file is missing, not GGUF, truncated, or holds a tensor type MLX does not read
            (names the file, the tensor and the type).
    """
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, KeyError, ... on a cut file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file, an incomplete download? ({_reason(e)})"
                              ) from None
    bf16 = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in READ_TYPES:
            raise CheckpointError(f"{path}: tensor '{tensor.name}' is {kind}, a GGUF type MLX cannot read "
                                  f"(readable: {', '.join(READ_TYPES)}); use a Q4_0, Q4_1, Q8_0, F16 or F32 file")
        if kind == "BF16":
            bf16[tensor.name] = mx.array(tensor.data.view("uint16")).view(mx.bfloat16)
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({_reason(e)})") from None
    weights.update(bf16)
    return weights, metadata


def _reason(e: Exception) -> str:
    return " ".join(str(e).replace("[load_gguf] ", "").split()) or type(e).__name__


def metadata_value(metadata: dict, key: str, source: Path, default=None, required: bool = False):
    """``metadata[key]`` as Python values (``mx.load`` gives numbers as arrays), else ``default``;
    ConfigError naming the file and the key when it is ``required`` and absent."""
    value = metadata.get(key, default)
    if required and value is None:
        raise ConfigError(f"{source}: missing GGUF metadata key '{key}'")
    return value.tolist() if hasattr(value, "tolist") else value


def mlx_lm_config(weights: Dict[str, mx.array], metadata: dict, source: Path) -> dict:
    """mlx-lm's ``config.json`` for the model in a GGUF file (without ``quantization``).

    Raises:
        ConfigError: ``general.architecture`` is not supported, a key it needs is missing, or the file uses
            RoPE scaling (``rope_freqs``) that is not supported yet (names the file and the key).
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: general.architecture '{arch}' is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    if "rope_freqs.weight" in weights or f"{arch}.rope.scaling.type" in metadata:
        raise ConfigError(f"{source}: {arch}.rope.scaling / rope_freqs (RoPE scaling, as in Llama 3.1 and later) "
                          "is not supported yet")

    def key(name, default=None):
        return metadata_value(metadata, f"{arch}.{name}", source, default, required=True)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = weights["token_embd.weight"].shape[0] if "token_embd.weight" in weights else None
    if vocab is None:
        raise ConfigError(f"{source}: no tensor 'token_embd.weight' (the token embedding)")
    config = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in weights,
        "rope_traditional": arch == "llama",  # llama.cpp permutes llama's Q and K to the interleaved order
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_gate.bias" in weights,
    }
    for name, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = metadata.get(f"tokenizer.ggml.{meta}")
        if value is not None:
            config[name] = metadata_value(metadata, f"tokenizer.ggml.{meta}", source)
    return config


def mlx_lm_weights(weights: Dict[str, mx.array], source: Path) -> Dict[str, mx.array]:
    """The tensors under mlx-lm's names (ConfigError naming a tensor it does not know)."""
    renamed = {}
    for name, value in weights.items():
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if suffix in _SUFFIXES and len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            renamed[f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"] = value
        elif suffix in _SUFFIXES and base in _TOP_NAMES:
            renamed[f"{_TOP_NAMES[base]}.{suffix}"] = value
        else:
            raise ConfigError(f"{source}: tensor '{name}' is not one of a {', '.join(ARCHITECTURES)} model's")
    return renamed


def quantization(weights: Dict[str, mx.array]) -> Optional[dict]:
    """mlx-lm's ``quantization`` entry for the quantized tensors (``{"group_size", "bits"}`` of the most common
    width, plus a per-module entry for each module of another width), or None when nothing is quantized."""
    bits = {name[:-len(".scales")]: weights[f"{name[:-len('.scales')]}.weight"].shape[-1] * 32
            // (value.shape[-1] * GROUP_SIZE) for name, value in weights.items() if name.endswith(".scales")}
    if not bits:
        return None
    common = max(set(bits.values()), key=list(bits.values()).count)
    entry: dict = {"group_size": GROUP_SIZE, "bits": common}
    entry.update({module: {"group_size": GROUP_SIZE, "bits": b} for module, b in bits.items() if b != common})
    return entry


def dequantized(weights: Dict[str, mx.array], config: dict, dtype: mx.Dtype) -> Dict[str, mx.array]:
    """Every tensor as ``dtype``: quantized modules dequantized (their ``.scales``/``.biases`` dropped)."""
    quant = config.get("quantization") or {}
    out = {}
    for name, value in weights.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases") and f"{module}.scales" in weights:
            continue
        if suffix == "weight" and f"{module}.scales" in weights:
            bits = quant.get(module, quant)["bits"]
            value = mx.dequantize(value, weights[f"{module}.scales"], weights[f"{module}.biases"], GROUP_SIZE, bits)
        out[name] = value.astype(dtype)
    return out


def convert_gguf(path: Path, dst: Path, dtype: Optional[str] = None,
                 say: Callable[[str], None] = lambda _: None) -> dict:
    """Write the model in the GGUF file ``path`` as an mlx-lm folder ``dst`` (created; must not exist).

    Args:
        dtype: "float32", "float16" or "bfloat16" dequantizes every tensor to it; None keeps the file's
            quantized tensors quantized and the float ones as stored.

    Returns:
        the manifest entry: ``method``, ``model_type``, ``dtype``, ``quantization``.

    Raises:
        CheckpointError: a file that is not GGUF, truncated, or holds a type MLX cannot read.
        ConfigError: an architecture, tokenizer or tensor not supported here.
    """
    say(f"reading {path.name}")
    weights, metadata = read_gguf(path)
    config = mlx_lm_config(weights, metadata, path)
    from .gguf_tokenizer import build_tokenizer

    tokenizer = build_tokenizer(metadata, path)
    weights = mlx_lm_weights(weights, path)
    quant = quantization(weights)
    if quant is not None:
        config["quantization"] = config["quantization_config"] = quant
    if dtype is not None:
        weights = dequantized(weights, config, getattr(mx, dtype))
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    say(f"writing the mlx-lm folder ({'quantized as in the file' if dtype is None and quant else dtype or 'as stored'})")
    dst.mkdir(parents=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(dst))
    floats = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating) and v.ndim == 2]
    from .loading import dtype_name

    return {"method": "GGUF read by MLX", "model_type": config["model_type"],
            "dtype": dtype or (dtype_name(floats[0]) if floats else "none"),
            "quantization": config.get("quantization")}
