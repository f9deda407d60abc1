"""A GGUF file (llama.cpp's format, as Ollama and LM Studio keep models) as an mlx-lm model folder:
``config.json``, ``model.safetensors`` and the tokenizer files (:mod:`.gguf_tokenizer`).

A file of only the types MLX reads (``mx.load``: F32, F16, and Q4_0, Q4_1 and Q8_0 as MLX affine groups of 32) is
read by MLX. Any other type (BF16, K-quants, I-quants): the file is read by :func:`parse_gguf`, each matrix
:data:`CHUNK_ROWS` rows at a time dequantized by the ``gguf`` package and cast to the dtype asked for, or kept
quantized: types whose groups of 32 are affine (:data:`EXACT_TYPES`: Q4_K, Q5_K, Q5_0, ...) keep their codes, scales
and biases, the others (Q2_K, Q3_K, Q6_K, I-quants) are quantized again by MLX (``bits``, 8 for types of 6 bits or
more, and ``group_size``). A folder kept quantized holds its float tensors in its scales' dtype (float16).

Architectures (:data:`ARCHITECTURES`): ``llama`` (Q and K in the interleaved rotary order: mlx-lm's llama with
``rope_traditional``), ``qwen2``, ``qwen3``, ``phi3`` (``attn_qkv``, ``ffn_up`` gate then up) and ``gemma3`` (norm
weights stored with the 1 of ``(1 + w)`` added, taken off here). Linear RoPE scaling and Llama 3's (``rope_freqs``)
are read; other kinds (YaRN, Phi-3's long-context factors) are refused."""

import glob
import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
from collections import namedtuple
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..atomic import staging
from ..errors import CheckpointError, ConfigError
from ..fingerprint import file_identity
from ..owned import cache_root
from .gguf_tokenizer import metadata_value, save_tokenizer
from .manifest import dtype_name

GROUP_SIZE = 32  # the block of every GGUF quantization MLX reads (Q4_0, Q4_1, Q8_0)
MLX_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")  # mx.load narrows BF16 to float16: the gguf package reads it
WIDE_TYPES = ("Q6_K", "Q8_1", "Q8_K")  # 6 bits or more: quantized again at 8 bits
# Types whose groups of 32 are MLX affine groups (w = scale * q + bias): bits, and per byte range of a block holding
# codes, the bytes storing the lowest code and the next (llama.cpp's ggml-common.h: Q4_K is d, dmin, scales, codes).
EXACT_TYPES = {"Q4_0": (4, ((2, 18, 0, 0x11),)), "Q4_1": (4, ((4, 20, 0, 0x11),)), "Q8_0": (8, ((2, 34, 0x80, 0x81),)),
               "Q5_0": (5, ((2, 6, 0, 0), (6, 22, 0, 0x11))), "Q5_1": (5, ((4, 8, 0, 0), (8, 24, 0, 0x11))),
               "Q4_K": (4, ((16, 144, 0, 0x11),)), "Q5_K": (5, ((16, 48, 0, 0), (48, 176, 0, 0x11)))}
CHUNK_ROWS = 1024  # rows of a matrix dequantized (and quantized again) at once
OLLAMA = "ollama:"
CONVERSION = 2  # in cache folder names: what an older conversion cached (re-quantized Q4_K, ...) is converted anew

# GGUF tensor names (llama.cpp's gguf-py tensor_mapping) -> mlx-lm module paths, per layer and outside.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GEMMA3_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",  # llama.cpp's gemma3 names
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # both fused
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
Tensor = namedtuple("Tensor", "name tensor_type shape data")  # GGUF shape (columns first); data: uint8 [rows, bytes]
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUFValueType
Arch = namedtuple("Arch", "model_type architecture names")  # mlx-lm's model_type, Hugging Face's, layer tensors
ARCHITECTURES = {  # general.architecture -> Arch
    "llama": Arch("llama", "LlamaForCausalLM", _LAYER_NAMES),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", _LAYER_NAMES),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", _LAYER_NAMES),
    "phi3": Arch("phi3", "Phi3ForCausalLM", _PHI3_NAMES),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_NAMES)}
_SUFFIXES = ("weight", "bias", "scales", "biases")


def is_gguf(path: str | Path) -> bool:
    """True for a path to a file whose name ends in ``.gguf`` (what ``--model`` treats as a GGUF file)."""
    return str(path).lower().endswith(".gguf")


def gguf_folder(model: str) -> Optional[Path]:
    """The mlx-lm folder of a ``.gguf`` file (any case) or an Ollama model (``ollama:NAME[:TAG]``), converted
    once (kept quantized) into ``CACHE/gguf/NAME-KEY-vN`` (the blob's digest, or one of the file's unread
    :func:`~dflash_mlx.fingerprint.file_identity`) and reused after, a line on stderr saying which (where
    the cache cannot be written: a warning and a temporary folder); None for any other ``model``.

    Raises:
        CheckpointError: a missing file or Ollama model, a folder named ``.gguf``, a bad file (:func:`read_gguf`)."""
    ollama, path = model.startswith(OLLAMA), Path(model).expanduser()
    if ollama:
        path = ollama_blob(model[len(OLLAMA):])
    elif not is_gguf(model):
        return None
    elif not path.is_file():
        raise CheckpointError(f"{path}: {'a folder, not a GGUF file' if path.is_dir() else 'GGUF file not found'}")
    key = path.name[len("sha256-"):] if ollama else hashlib.sha256(file_identity(path).encode()).hexdigest()
    folder = cache_root() / "gguf" / f"{Path(model.replace(':', '-')).stem}-{key[:16]}-v{CONVERSION}"
    if (folder / "config.json").is_file():
        print(f"{model}: converted earlier into {folder}", file=sys.stderr)
        return folder
    print(f"{model}: converting once into {folder}", file=sys.stderr)
    try:
        with staging(folder, force=True) as tmp:
            convert_gguf(path, tmp)
    except OSError as e:  # WriteError included
        print(f"warning: cannot keep the conversion ({e}); converting for this run only", file=sys.stderr)
        convert_gguf(path, folder := Path(tempfile.mkdtemp(prefix="dflash-gguf-")) / "model")
    for old in folder.parent.glob(f"{glob.escape(folder.name.rsplit('-v', 1)[0])}-v*"):  # older versions'
        try:
            if old != folder and old.name.rsplit("-v", 1)[1].isdigit():
                shutil.rmtree(old)
                print(f"{model}: removed {old}, an older version's conversion", file=sys.stderr)
        except OSError as e:
            print(f"warning: cannot remove {old}, an older version's conversion ({e})", file=sys.stderr)
    return folder


def ollama_blob(name: str) -> Path:
    """The GGUF blob of an Ollama model in the local store (``$OLLAMA_MODELS``, else ``~/.ollama/models``),
    through ``manifests/registry.ollama.ai/library/NAME/TAG`` (TAG ``latest`` by default)."""
    root = Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()
    repo, _, tag = name.partition(":")
    manifest = root / "manifests" / "registry.ollama.ai" / (repo if "/" in repo else f"library/{repo}") / (tag or "latest")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        return root / "blobs" / next(x["digest"] for x in layers
                                     if x["mediaType"] == "application/vnd.ollama.image.model").replace(":", "-")
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise CheckpointError(f"ollama:{name}: not in the Ollama store {root} (no readable manifest "
                              f"{manifest}); `ollama pull {name}` first") from None


def read_gguf(path: Path, bits: int = 4, group_size: int = 64,
              dtype: Optional[mx.Dtype] = None) -> Tuple[Dict[str, mx.array], dict, dict, Dict[str, dict]]:
    """The tensors (GGUF names; quantized ones as ``NAME.weight``/``.scales``/``.biases``), the metadata
    (:func:`parse_gguf`), a summary (``method``, ``gguf_types``: tensors per type, ``requantized``: tensors
    quantized again) and per quantized module ``{"group_size", "bits"}``. ``dtype``: every tensor
    dequantized by the package (exactly as llama.cpp's reference) and cast to it, none quantized again.

    Raises:
        CheckpointError: the file is missing, not GGUF, truncated, or holds a type the ``gguf`` package cannot
            dequantize (names the file, the tensor and the type)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        if (magic := f.read(4)) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        metadata, tensors = parse_gguf(pages)
    except Exception as e:  # struct.error, ValueError, UnicodeDecodeError, ... on a cut file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file, an incomplete download? ({_reason(e)})"
                              ) from None
    kinds = [t.tensor_type.name for t in tensors]
    summary = {"method": "GGUF read by MLX", "gguf_types": {k: kinds.count(k) for k in sorted(set(kinds))}}
    if dtype is None and all(kind in MLX_TYPES for kind in kinds):
        try:
            weights = mx.load(str(path), format="gguf")  # the name may be NAME.GGUF or an Ollama blob
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({_reason(e)})") from None
        return weights, metadata, {**summary, "requantized": 0}, {t.name[: -len(".weight")]: {
            "group_size": GROUP_SIZE, "bits": EXACT_TYPES[t.tensor_type.name][0]} for t in tensors
            if t.tensor_type.name in EXACT_TYPES}
    weights, quant, requantized = {}, {}, 0
    for t in tensors:
        qtype, module, exact = t.tensor_type, t.name[: -len(".weight")], t.tensor_type.name in EXACT_TYPES
        if qtype.name in ("F32", "F16", "BF16") or dtype is not None or len(t.shape) != 2:
            weights[t.name] = _by_rows(t, path, pages, lambda x: _float(x, qtype) if dtype is None else
                                       _float(x, qtype).astype(dtype))
            continue
        b = EXACT_TYPES[qtype.name][0] if exact else 8 if qtype.name in WIDE_TYPES else bits
        w, scales, biases = _by_rows(t, path, pages, (lambda x: _exact(x, qtype)) if exact else (
            lambda x: mx.quantize(_float(x, qtype).astype(mx.float16), group_size, b)))
        weights.update({t.name: w, f"{module}.scales": scales, f"{module}.biases": biases})
        quant[module] = {"group_size": GROUP_SIZE if exact else group_size, "bits": b}
        requantized += not exact
    summary.update(method="GGUF dequantized by the gguf package", requantized=requantized)
    return weights, metadata, summary, quant


def parse_gguf(buf) -> tuple[dict, list[Tensor]]:
    """The metadata (values as ``GGUFReader``'s ``contents()`` gives them) and tensors (``data``: a view of ``buf`` in
    the rows the ``gguf`` package dequantizes) of a GGUF file's bytes ``buf`` (its memory map), by the specification
    (ggml's docs/gguf.md), not by ``gguf.GGUFReader``, which keeps a numpy view of every array entry: on a large
    vocabulary that alone breaks the bound of twice the output's size (docs/benchmarks.md, Gemma 3 270M).

    Raises:
        ValueError, struct.error, UnicodeDecodeError, KeyError: a cut or corrupt file."""
    from gguf import GGMLQuantizationType, GGUFValueType
    from gguf.quants import quant_shape_to_byte_shape

    at = 4  # after the magic

    def take(fmt: str) -> tuple:
        nonlocal at
        values, at = struct.unpack_from(f"<{fmt}", buf, at), at + struct.calcsize(f"<{fmt}")
        return values

    def value(kind: int):
        if kind == GGUFValueType.STRING:
            return str(take(f"{take('Q')[0]}s")[0], "utf-8")
        if kind == GGUFValueType.ARRAY:
            kind, count = take("IQ")
            return list(take(f"{count}{_SCALARS[kind]}")) if kind in _SCALARS else [value(kind) for _ in range(count)]
        return take(_SCALARS[kind])[0]

    version, count, keys = take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, not 2 or 3")
    metadata = {value(GGUFValueType.STRING): value(take("I")[0]) for _ in range(keys)}
    infos = [(value(GGUFValueType.STRING), take(f"{take('I')[0]}Q"), *take("IQ")) for _ in range(count)]
    start, tensors = at + -at % metadata.get("general.alignment", 32), []
    for name, dims, kind, offset in infos:  # np.frombuffer: ValueError where the file ends before the tensor
        qtype = GGMLQuantizationType(kind)
        shape = quant_shape_to_byte_shape(dims[::-1], qtype)
        rows = np.frombuffer(buf, np.uint8, int(np.prod(shape)), start + offset).reshape(shape)
        tensors.append(Tensor(name, qtype, dims, rows))
    return metadata, tensors


def _float(rows, qtype) -> mx.array:
    """Rows of a GGUF tensor of ``qtype`` as the ``gguf`` package dequantizes them (float32), BF16 and F16 as stored."""
    from gguf.quants import dequantize

    return mx.array(rows.view("uint16")).view(mx.bfloat16) if qtype.name == "BF16" else mx.array(dequantize(rows, qtype))


def _exact(rows, qtype) -> Tuple[mx.array, mx.array, mx.array]:
    """Rows (uint8 [rows, bytes]) of a type in :data:`EXACT_TYPES` as MLX's packed codes (uint32 [rows, cols *
    bits / 32]), scales and biases (float16 [rows, cols / 32]) of the same weights: each group's bias and scale
    what the ``gguf`` package (the one reader of each layout) dequantizes with every code the lowest and the next,
    the codes the weights put back on that grid. Exact up to float16 scales and biases, as MLX's reader of Q4_0."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    bits, spans = EXACT_TYPES[qtype.name]
    blocks, grid = rows.reshape(len(rows), -1, GGML_QUANT_SIZES[qtype][1]), []
    for which in (0, 1):  # every code the lowest, then the next
        probe = blocks.copy()
        for start, end, *stored in spans:
            probe[..., start:end] = stored[which]
        grid.append(dequantize(probe.reshape(rows.shape), qtype).reshape(len(rows), -1, GROUP_SIZE)[..., :1])
    bias, scale = grid[0], grid[1] - grid[0]
    w = dequantize(rows, qtype).reshape(scale.shape[:2] + (GROUP_SIZE,))
    q = np.rint((w - bias) / np.where(scale == 0, 1, scale)).clip(0, 2 ** bits - 1).astype(np.uint8)
    packed = q if bits == 8 else q[..., ::2] | q[..., 1::2] << 4 if bits == 4 else np.packbits(
        (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1, bitorder="little")  # MLX: a little-endian bit stream
    return (mx.array(packed.reshape(len(rows), -1).view(np.uint32)), mx.array(scale[..., 0].astype(np.float16)),
            mx.array(bias[..., 0].astype(np.float16)))


def _by_rows(tensor: Tensor, path: Path, pages: mmap.mmap, read: Callable[[Any], Any]) -> Any:
    """``read`` of one tensor (an array or a tuple), :data:`CHUNK_ROWS` rows (numpy, as stored) at a time, each part
    evaluated into the whole tensor's arrays in place (MLX updates an array nothing else holds), the file's ``pages``
    read so far dropped first: never a large float copy, nor the parts beside the whole."""
    data, out = tensor.data, []
    step = CHUNK_ROWS if data.ndim == 2 else len(data)  # quantized rows are whole blocks; else all at once
    for i in range(0, len(data), step):
        pages.madvise(mmap.MADV_DONTNEED)
        try:
            part = read(data[i: i + step])
        except NotImplementedError:
            raise CheckpointError(f"{path}: tensor '{tensor.name}' is {tensor.tensor_type.name}, a GGUF type the gguf "
                                  "package cannot read; use a file of another quantization (Q4_K_M, Q8_0)") from None
        except ValueError as e:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({_reason(e)})") from None
        parts = (part,) if isinstance(part, mx.array) else part
        out = out or [mx.zeros((len(data) if data.ndim == 2 else len(p), *p.shape[1:]), p.dtype) for p in parts]
        for whole, p in zip(out, parts):
            whole[i: i + step] = p
        mx.eval(out)
    return out[0] if isinstance(part, mx.array) else tuple(out)


def _reason(e: Exception) -> str:
    return " ".join(str(e).replace("[load_gguf] ", "").split()) or type(e).__name__


def mlx_lm_config(weights: Dict[str, mx.array], metadata: dict, source: Path) -> dict:
    """mlx-lm's ``config.json`` for the model in a GGUF file (without ``quantization``).

    Raises:
        ConfigError: ``general.architecture`` is not supported, a key it needs is missing, or the file uses
            RoPE scaling other than linear and Llama 3's (YaRN) (names the file and the key)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: general.architecture '{arch}' is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(f"{source}: RoPE scaling '{scaling}' is not supported yet (linear and Llama 3's are)")

    def key(name, default=None):
        return metadata_value(metadata, f"{arch}.{name}", source, default, required=True)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    if "token_embd.weight" not in weights:
        raise ConfigError(f"{source}: no tensor 'token_embd.weight' (the token embedding)")
    config = {
        "model_type": ARCHITECTURES[arch].model_type, "architectures": [ARCHITECTURES[arch].architecture],
        "hidden_size": hidden, "num_hidden_layers": key("block_count"), "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads), "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")), "max_position_embeddings": key("context_length"),
        "vocab_size": weights["token_embd.weight"].shape[0], "tie_word_embeddings": "output.weight" not in weights,
        "rope_traditional": arch == "llama",  # llama.cpp permutes llama's Q and K to the interleaved order
        "attention_bias": "blk.0.attn_q.bias" in weights, "mlp_bias": "blk.0.ffn_gate.bias" in weights}
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    if "rope_freqs.weight" in weights:  # Llama 3.1 and later
        config["rope_scaling"] = llama3_scaling(weights["rope_freqs.weight"], config, source)
    if arch == "gemma3":  # as llama.cpp: every 6th layer global, local RoPE base 10,000, attention scaled by
        scale = hidden // heads if config["num_hidden_layers"] == 62 else config["head_dim"]  # 27B: hidden / heads
        config.update(sliding_window=key("attention.sliding_window"), sliding_window_pattern=6,
                      rope_local_base_freq=10000.0, query_pre_attn_scalar=scale)
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    ends = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]  # Llama 3: <|eot_id|>
    ends = list(dict.fromkeys(i for i in ends if i is not None))
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return config


def llama3_scaling(factors: mx.array, config: dict, source: Path) -> dict:
    """mlx-lm's ``llama3`` rope_scaling reproducing ``rope_freqs.weight`` ([head_dim / 2]: llama.cpp's divisor of each
    rotary frequency, from Meta's constants: factors 1 and 4, context 8,192, the largest ``factor``), or ConfigError."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    dims, base = config["head_dim"], config["rope_theta"]
    scaling = {"rope_type": "llama3", "factor": float(factors.max().item()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rebuilt = Llama3RoPE(dims, base=base, scaling_config=scaling)._freqs / base ** (mx.arange(0, dims, 2) / dims)
    if factors.shape != rebuilt.shape or not mx.allclose(factors.astype(mx.float32), rebuilt, rtol=1e-4).item():
        raise ConfigError(f"{source}: tensor 'rope_freqs.weight' is not Llama 3's RoPE scaling (not supported)")
    return scaling


def mlx_lm_name(name: str, source: Path, arch: str = "llama") -> str:
    """mlx-lm's name of a GGUF tensor (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``);
    ConfigError naming a tensor it does not know."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    names = ARCHITECTURES[arch].names
    if suffix in _SUFFIXES and len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if suffix in _SUFFIXES and base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ConfigError(f"{source}: tensor '{name}' is not one of a {', '.join(ARCHITECTURES)} model's")


def convert_gguf(path: Path, dst: Path, dtype: Optional[str] = None, say: Callable[[str], None] = lambda _: None,
                 bits: Optional[int] = None, group_size: Optional[int] = None) -> dict:
    """Write the model in the GGUF file ``path`` as an mlx-lm folder ``dst`` (created where it does not exist).

    Args:
        dtype: "float32", "float16" or "bfloat16" dequantizes every tensor to it; None keeps the file's
            quantized tensors quantized (types MLX does not read quantized again at ``bits``, default 4, and
            ``group_size``, default 64: mlx-lm's defaults) and casts the float ones to the scales' float16.

    Returns:
        the manifest entry: ``method``, ``model_type``, ``dtype``, ``quantization``, ``gguf_types`` (tensors
        per GGUF type), ``requantized`` (tensors quantized again), ``bits_per_weight`` (of the matrices).

    Raises:
        CheckpointError: a file that is not GGUF, truncated, or holds a type the ``gguf`` package cannot read.
        ConfigError: an architecture, tokenizer or tensor not supported here."""
    say(f"reading {path.name}")
    dst.mkdir(parents=True, exist_ok=True)
    weights, metadata, summary, quant = read_gguf(path, bits or 4, group_size or 64, dtype and getattr(mx, dtype))
    config = mlx_lm_config(weights, metadata, path)
    arch, shift = metadata["general.architecture"], config["model_type"] == "gemma3_text"  # (1 + w) stored
    weights = {mlx_lm_name(name, path, arch): v - 1 if shift and name.endswith("norm.weight") else v
               for name, v in weights.items() if name != "rope_freqs.weight"}  # now in config's rope_scaling
    quant = {mlx_lm_name(f"{module}.weight", path, arch)[: -len(".weight")]: q for module, q in quant.items()}
    if quant:  # float tensors in the scales' float16, as mlx-lm's own quantized folders: it computes in it
        weights = {n: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for n, v in weights.items()}
        kinds = [tuple(q.items()) for q in quant.values()]  # mlx-lm's entry: the most common, and every other module's
        common = dict(max(set(kinds), key=kinds.count))
        config["quantization"] = config["quantization_config"] = {
            **common, **{module: q for module, q in quant.items() if q != common}}
    say(f"writing the mlx-lm folder ({'quantized' if 'quantization' in config else dtype or 'as stored'})")
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    matrices = [n for n, v in weights.items() if n.endswith(".weight") and v.ndim == 2]
    floats = [weights[n].dtype for n in matrices if mx.issubdtype(weights[n].dtype, mx.floating)]
    stored = sum(sum(weights[f"{n[:-7]}.{s}"].nbytes for s in ("weight", "scales", "biases")
                     if f"{n[:-7]}.{s}" in weights) for n in matrices)
    params = sum(weights[n].size * (32 // quant[n[:-7]]["bits"] if n[:-7] in quant else 1) for n in matrices)
    del weights  # the tokenizer, the peak of the conversion, in the memory the tensors leave
    mx.clear_cache()
    save_tokenizer(metadata, path, dst)
    return {**summary, "model_type": config["model_type"], "dtype": dtype or dtype_name(floats[0] if floats else mx.float16),
            "quantization": config.get("quantization"), "bits_per_weight": round(8 * stored / max(params, 1), 2)}
