#!/usr/bin/env python3
r"""Convert a llama2.c checkpoint and its SentencePiece tokenizer for mlx-lm.

llama2.c (https://github.com/karpathy/llama2.c) stores a Llama model as one
flat binary file. This script reads the legacy "v0" export format and writes a
folder that ``mlx_lm.load(folder)`` loads:

* ``config.json``: an mlx-lm ``llama`` config (no chat template: base model).
* ``model.safetensors``: the weights under mlx-lm's llama names.
* ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``: the
  SentencePiece tokenizer, converted for transformers' ``AutoTokenizer``
  (fast, offline; loading the folder does not need ``sentencepiece``).

v0 file layout (little-endian)::

    int32 header[7]: dim, hidden_dim, n_layers, n_heads, n_kv_heads,
                     vocab_size (negative: untied output head), seq_len
    fp32 tok_embeddings[V, D], rms_att[L, D], wq[L, D, D],
         wk[L, KV*hd, D], wv[L, KV*hd, D], wo[L, D, D], rms_ffn[L, D],
         w1[L, H, D], w2[L, D, H], w3[L, H, D], rms_final[D],
         freq_cis_real[S, hd/2], freq_cis_imag[S, hd/2]   (unused here),
         wcls[V, D]                                       (untied head only)

Matrices are already ``[out_features, in_features]`` like ``nn.Linear``.
llama2.c rotates adjacent (even, odd) pairs in RoPE, so the config sets
``rope_traditional: true`` and q/k are copied as is. That key is mlx-lm's:
Hugging Face transformers ignores it, so the folder is meant for mlx-lm only.

Example:
    python scripts/convert/llama2c.py \
        --checkpoint ../shared/models/stories260K/stories260K.bin \
        --tokenizer ../shared/models/stories260K/tok512.model \
        --out /tmp/stories260K-mlx

Requires numpy, mlx, transformers and sentencepiece.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER_FIELDS = 7
HEADER_BYTES = HEADER_FIELDS * 4
# llama2.c export versions >= 1 start with this magic ("ak42") instead of dim.
LLAMA2C_MAGIC = 0x616B3432
DTYPES = ("float32", "float16", "bfloat16")
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Llama2cHeader:
    """The seven header fields of a llama2.c v0 checkpoint.

    Attributes:
        dim: Model (residual stream) width D.
        hidden_dim: Feed-forward width H.
        n_layers: Number of transformer blocks L.
        n_heads: Number of query heads.
        n_kv_heads: Number of key/value heads (grouped-query attention).
        vocab_size: Vocabulary size V (always positive here).
        seq_len: Maximum sequence length S the model was trained with.
        tied: True when the output head shares the token embedding.
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    tied: bool

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection output."""
        return self.n_kv_heads * self.head_dim


def tensor_layout(h: Llama2cHeader) -> list[tuple[str, tuple[int, ...]]]:
    """Lists the fp32 tensors stored after the header, in file order.

    Args:
        h: The checkpoint header.

    Returns:
        ``(name, shape)`` pairs using llama2.c's names.
    """
    L, D, H, V = h.n_layers, h.dim, h.hidden_dim, h.vocab_size
    layout = [
        ("tok_embeddings", (V, D)),
        ("rms_att", (L, D)),
        ("wq", (L, D, D)),
        ("wk", (L, h.kv_dim, D)),
        ("wv", (L, h.kv_dim, D)),
        ("wo", (L, D, D)),
        ("rms_ffn", (L, D)),
        ("w1", (L, H, D)),
        ("w2", (L, D, H)),
        ("w3", (L, H, D)),
        ("rms_final", (D,)),
        ("freq_cis_real", (h.seq_len, h.head_dim // 2)),
        ("freq_cis_imag", (h.seq_len, h.head_dim // 2)),
    ]
    if not h.tied:
        layout.append(("wcls", (V, D)))
    return layout


def expected_size(h: Llama2cHeader) -> int:
    """Returns the exact byte size of a v0 checkpoint with header ``h``."""
    n_floats = sum(math.prod(shape) for _, shape in tensor_layout(h))
    return HEADER_BYTES + 4 * n_floats


def read_header(path: Path) -> Llama2cHeader:
    """Reads and validates the header of a llama2.c v0 checkpoint.

    Args:
        path: The ``.bin`` checkpoint.

    Returns:
        The parsed header.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The header is invalid or disagrees with the file size.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(
            f"{path}: {size} bytes, too short for the {HEADER_BYTES}-byte "
            "llama2.c header"
        )
    fields = np.fromfile(path, dtype="<i4", count=HEADER_FIELDS).tolist()
    if fields[0] == LLAMA2C_MAGIC:
        raise ValueError(
            f"{path}: llama2.c export version {fields[1]}; only the legacy "
            "v0 format is supported (export with --version 0)"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len = fields
    h = Llama2cHeader(
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab), seq_len, vocab > 0
    )
    named = (
        f"dim={dim}, hidden_dim={hidden_dim}, n_layers={n_layers}, "
        f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, vocab_size={vocab}, "
        f"seq_len={seq_len}"
    )
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, h.vocab_size, seq_len) <= 0:
        raise ValueError(f"{path}: not a llama2.c v0 checkpoint (header {named})")
    if dim % n_heads or n_heads % n_kv_heads or h.head_dim % 2:
        raise ValueError(
            f"{path}: inconsistent header ({named}): dim must split into "
            "n_heads even-width heads and n_heads must be a multiple of n_kv_heads"
        )
    want = expected_size(h)
    if size != want:
        raise ValueError(
            f"{path}: header ({named}) implies {want} bytes but the file has "
            f"{size}; it is truncated, corrupt or not a llama2.c v0 checkpoint"
        )
    return h


def read_tensors(path: Path, h: Llama2cHeader) -> dict[str, np.ndarray]:
    """Maps the checkpoint's tensors without copying them.

    Args:
        path: The ``.bin`` checkpoint, already checked by :func:`read_header`.
        h: Its header.

    Returns:
        llama2.c tensor name -> read-only fp32 array view.
    """
    data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER_BYTES)
    tensors, pos = {}, 0
    for name, shape in tensor_layout(h):
        n = math.prod(shape)
        tensors[name] = data[pos : pos + n].reshape(shape)
        pos += n
    return tensors


def to_mlx_lm_names(
    t: dict[str, np.ndarray], h: Llama2cHeader
) -> dict[str, np.ndarray]:
    """Renames llama2.c tensors to mlx-lm llama parameter names.

    Args:
        t: Tensors from :func:`read_tensors`.
        h: The checkpoint header.

    Returns:
        mlx-lm parameter name -> array. RoPE tables are dropped (mlx-lm
        computes its own); ``lm_head.weight`` exists only for untied heads.
    """
    per_layer = {
        "rms_att": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "rms_ffn": "post_attention_layernorm.weight",
        "w1": "mlp.gate_proj.weight",
        "w2": "mlp.down_proj.weight",
        "w3": "mlp.up_proj.weight",
    }
    out = {
        "model.embed_tokens.weight": t["tok_embeddings"],
        "model.norm.weight": t["rms_final"],
    }
    for i in range(h.n_layers):
        for src, dst in per_layer.items():
            out[f"model.layers.{i}.{dst}"] = t[src][i]
    if not h.tied:
        out["lm_head.weight"] = t["wcls"]
    return out


def make_config(h: Llama2cHeader, bos_id: int, eos_id: int, dtype: str) -> dict:
    """Builds an mlx-lm ``llama`` config.json for the checkpoint.

    Args:
        h: The checkpoint header.
        bos_id: Beginning-of-sequence token id.
        eos_id: End-of-sequence token id.
        dtype: Name of the stored weight dtype.

    Returns:
        The config as a JSON-ready dict.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h.dim,
        "intermediate_size": h.hidden_dim,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.n_heads,
        "num_key_value_heads": h.n_kv_heads,
        "head_dim": h.head_dim,
        "vocab_size": h.vocab_size,
        "max_position_embeddings": h.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_traditional": True,  # llama2.c rotates adjacent pairs
        "tie_word_embeddings": h.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def save_weights(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Writes the weights as safetensors in ``dtype`` using MLX.

    Args:
        weights: Parameter name -> fp32 array.
        path: Destination ``.safetensors`` file.
        dtype: One of :data:`DTYPES`.
    """
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    arrays = {
        k: mx.array(np.ascontiguousarray(v)).astype(mx_dtype)
        for k, v in weights.items()
    }
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


@dataclass(frozen=True)
class SpecialTokens:
    """Special pieces of a SentencePiece model and their ids."""

    unk: str
    bos: str
    eos: str
    unk_id: int
    bos_id: int
    eos_id: int


def read_special_tokens(tokenizer_model: Path, vocab_size: int) -> SpecialTokens:
    """Checks a SentencePiece model against the checkpoint; reads its specials.

    Args:
        tokenizer_model: The SentencePiece ``.model`` file.
        vocab_size: The checkpoint's vocabulary size.

    Returns:
        The model's ``<unk>``, BOS and EOS pieces and ids.

    Raises:
        FileNotFoundError: ``tokenizer_model`` does not exist.
        ValueError: It is unreadable, lacks BOS/EOS/UNK or its vocabulary
            size differs from ``vocab_size``.
    """
    import sentencepiece as spm

    if not tokenizer_model.is_file():
        raise FileNotFoundError(f"{tokenizer_model}: tokenizer model not found")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(tokenizer_model))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{tokenizer_model}: not a SentencePiece model ({e})") from e
    if sp.get_piece_size() != vocab_size:
        raise ValueError(
            f"{tokenizer_model}: {sp.get_piece_size()} pieces, but the "
            f"checkpoint's vocab_size is {vocab_size}"
        )
    ids = sp.unk_id(), sp.bos_id(), sp.eos_id()
    if min(ids) < 0:
        raise ValueError(f"{tokenizer_model}: needs <unk>, BOS and EOS pieces")
    return SpecialTokens(*(sp.id_to_piece(i) for i in ids), *ids)


def write_tokenizer(
    tokenizer_model: Path, out_dir: Path, special: SpecialTokens, max_length: int
) -> None:
    """Writes Hugging Face tokenizer files for a SentencePiece model.

    Copies ``tokenizer.model``, writes ``tokenizer_config.json`` (a
    ``LlamaTokenizer`` that prepends BOS, no chat template) and converts the
    model to ``tokenizer.json`` with transformers, so that loading needs
    neither ``sentencepiece`` nor a conversion step. The ``tokenizer.json``
    decoder is the SentencePiece one, for which mlx-lm picks its
    ``SPMStreamingDetokenizer``.

    Args:
        tokenizer_model: The SentencePiece ``.model`` file.
        out_dir: The output folder.
        special: Its special tokens, from :func:`read_special_tokens`.
        max_length: Context length to record as ``model_max_length``.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on stderr
    from transformers import AutoTokenizer

    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": special.bos,
        "eos_token": special.eos,
        "unk_token": special.unk,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    # Convert in a scratch folder so stale files in out_dir cannot interfere.
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        shutil.copyfile(tokenizer_model, stage / "tokenizer.model")
        (stage / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2) + "\n"
        )
        tok = AutoTokenizer.from_pretrained(stage)
        tok.backend_tokenizer.save(str(stage / "tokenizer.json"))
        for name in ("tokenizer.model", "tokenizer_config.json", "tokenizer.json"):
            shutil.copyfile(stage / name, out_dir / name)


def convert_llama2c(
    checkpoint: Path, tokenizer_model: Path, out_dir: Path, dtype: str = "float32"
) -> Path:
    """Converts a llama2.c v0 checkpoint and tokenizer into an mlx-lm folder.

    Args:
        checkpoint: The llama2.c ``.bin`` file.
        tokenizer_model: Its SentencePiece ``.model`` file.
        out_dir: Folder to write (created; files of the same name are replaced).
        dtype: Stored weight dtype: ``float32``, ``float16`` or ``bfloat16``.

    Returns:
        ``out_dir``, ready for ``mlx_lm.load``.

    Raises:
        FileNotFoundError: An input file is missing.
        ValueError: An input file is invalid, the two inputs disagree, or
            ``dtype`` is unknown.
    """
    checkpoint, tokenizer_model, out_dir = (
        Path(checkpoint),
        Path(tokenizer_model),
        Path(out_dir),
    )
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    # Validate every input before writing anything.
    header = read_header(checkpoint)
    special = read_special_tokens(tokenizer_model, header.vocab_size)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: output path exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)

    write_tokenizer(tokenizer_model, out_dir, special, header.seq_len)
    weights = to_mlx_lm_names(read_tensors(checkpoint, header), header)
    save_weights(weights, out_dir / "model.safetensors", dtype)
    config = make_config(header, special.bos_id, special.eos_id, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line."""
    p = argparse.ArgumentParser(
        description="Convert a llama2.c v0 checkpoint plus its SentencePiece "
        "tokenizer into a folder that mlx_lm.load() reads.",
    )
    p.add_argument(
        "--checkpoint", type=Path, required=True, help="llama2.c .bin checkpoint"
    )
    p.add_argument(
        "--tokenizer", type=Path, required=True, help="SentencePiece .model file"
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="stored weight dtype (default: %(default)s)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; prints a one-line error and returns 1 on bad input."""
    args = parse_args(argv)
    try:
        out = convert_llama2c(args.checkpoint, args.tokenizer, args.out, args.dtype)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
