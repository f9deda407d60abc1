"""What ``dflash convert`` writes: the target through mlx-lm's own convert, the drafter in its released
format (cast and quantized if asked), and the ``dflash.json`` manifest's contents."""

import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.convert import convert as mlx_lm_convert

from ..drafter.checkpoint import read_config, save_drafter
from ..drafter.network import DFlashDrafter
from ..errors import CheckpointError, InputError
from .loading import QUANTIZED_DRAFTER_DTYPE, TARGET_FILES, float_dtype
from .manifest import MANIFEST_VERSION, dtype_name

DRAFT_Q_GROUP_SIZE = 64


def weights_format(path: Path) -> Optional[str]:
    """The ``format`` metadata of a folder's first safetensors file ("mlx": mlx-lm's, "pt": transformers')."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    try:
        with safe_open(str(files[0]), "numpy") as f:
            return (f.metadata() or {}).get("format")
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{files[0]}: cannot read safetensors file ({e})") from None


def write_target(src: Path, dst: Path, *, quantize: bool = False, q_bits: Optional[int] = None,
                 q_group_size: Optional[int] = None, q_mode: str = "affine", dtype: Optional[str] = None) -> dict:
    """Write the target in mlx-lm format with mlx-lm's own convert. An mlx-lm folder is copied unless a
    dtype or another quantization is asked for (a quantized one is then dequantized and quantized again).
    Returns the manifest entry: ``method``, ``model_type``, ``dtype``, ``quantization``.

    Raises:
        InputError: mlx-lm refused the quantization flags (names them).
        CheckpointError: mlx-lm could not convert the folder.
    """
    config = read_config(src / "config.json")
    existing = config.get("quantization")
    is_mlx = existing is not None or weights_format(src) == "mlx"
    asked = {"bits": q_bits, "group_size": q_group_size, "mode": q_mode}
    same = existing is not None and all(
        v is None or existing.get(k, "affine" if k == "mode" else None) == v for k, v in asked.items()
    )
    if is_mlx and dtype is None and (not quantize or same):
        dst.mkdir(parents=True)
        for f in sorted(src.iterdir()):  # the files mlx-lm itself downloads (weights, configs, tokenizer)
            if f.is_file() and any(fnmatch(f.name, p) for p in TARGET_FILES):
                shutil.copy(f, dst / f.name)
        method = "copied (already mlx-lm format)"
    elif existing is not None and quantize:
        mid = dst.with_name(f".{dst.name}-dequantized")
        _mlx_lm_convert(src, mid, dequantize=True, dtype=dtype)
        _mlx_lm_convert(mid, dst, quantize=True, q_bits=q_bits, q_group_size=q_group_size, q_mode=q_mode)
        shutil.rmtree(mid)
        method = "re-quantized with mlx_lm.convert"
    else:
        _mlx_lm_convert(src, dst, quantize=quantize, q_bits=q_bits, q_group_size=q_group_size,
                        q_mode=q_mode, dtype=dtype)
        method = "mlx_lm.convert"
    written = read_config(dst / "config.json")
    return {"method": method, "model_type": written.get("model_type"),
            "dtype": _folder_dtype(dst), "quantization": written.get("quantization")}


def _mlx_lm_convert(src: Path, dst: Path, *, quantize: bool = False, q_bits=None, q_group_size=None,
                    q_mode: str = "affine", dtype: Optional[str] = None, dequantize: bool = False) -> None:
    """``mlx_lm.convert.convert`` with its errors turned into one-line DFlashErrors."""
    try:
        mlx_lm_convert(str(src), str(dst), quantize=quantize, q_group_size=q_group_size, q_bits=q_bits,
                       q_mode=q_mode, dtype=dtype, dequantize=dequantize)
    except (ValueError, RuntimeError) as e:
        detail = " ".join(str(e).split())
        if quantize:
            flags = [f"{f} {v}" for f, v in (("--q-mode", q_mode), ("--q-bits", q_bits),
                                              ("--q-group-size", q_group_size)) if v is not None]
            raise InputError(f"{' '.join(flags)}: mlx-lm cannot quantize {src} this way ({detail})") from None
        raise CheckpointError(f"{src}: mlx-lm could not convert the target ({detail})") from None


def _folder_dtype(path: Path) -> str:
    """The dtype of a folder's float weights (the first floating tensor found)."""
    for f in sorted(path.glob("*.safetensors")):
        for v in mx.load(str(f)).values():
            if mx.issubdtype(v.dtype, mx.floating):
                return dtype_name(v.dtype)
    return "none"


def quantize_drafter(drafter: nn.Module, bits: int, group_size: int = DRAFT_Q_GROUP_SIZE) -> dict:
    """Quantize, in place, the ``layers.*`` linears and a DSpark Markov head (rank a multiple of ``group_size``);
    ``fc``, the norms, DSpark's stored copies and a DFlash2 ``candidate_selector`` stay float. Scales from float32.
    Returns ``{"group_size", "bits", "mode"}``, as :func:`save_drafter` records it."""
    dtype = float_dtype(drafter)
    drafter.set_dtype(mx.float32)

    def predicate(path: str, module: nn.Module) -> bool:
        return (path.startswith(("layers.", "markov_head.")) and "candidate_selector" not in path
                and isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[-1] % group_size == 0)

    nn.quantize(drafter, group_size, bits, class_predicate=predicate)
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def write_drafter(drafter: DFlashDrafter, dst: Path, q_bits: Optional[int] = None,
                  q_group_size: int = DRAFT_Q_GROUP_SIZE, dtype: Optional[str] = None) -> dict:
    """Write the drafter in the released format (cast to ``dtype``, quantized if asked); returns the
    manifest entry: ``dtype``, ``quantization``, ``compute_dtype``."""
    if dtype is not None:
        drafter.set_dtype(getattr(mx, dtype))
    quantization = quantize_drafter(drafter, q_bits, q_group_size) if q_bits else None
    save_drafter(drafter, dst)
    entry = {"dtype": dtype_name(float_dtype(drafter)), "quantization": quantization}
    if quantization is not None:
        entry["float_modules"] = sorted({p.split(".")[0] for p, m in drafter.named_modules()
                                         if isinstance(m, (nn.Linear, nn.Embedding, nn.RMSNorm)) and "layers" not in p})
        entry["compute_dtype"] = dtype_name(QUANTIZED_DRAFTER_DTYPE)
    return entry


def _origin(name: str, path: Path) -> dict:
    """``source``: the folder given, resolved, or the repo id; ``revision``: the commit of a Hugging Face cache
    snapshot folder (``.../snapshots/<commit>``), else None."""
    return {"source": str(path.resolve()) if Path(name).expanduser().is_dir() else name,
            "revision": path.name if path.parent.name == "snapshots" else None}


def make_manifest(model: str, draft_model: str, target_src: Path, draft_src: Path, draft_config: dict,
                  args, target_entry: dict, drafter_entry: dict, files: dict) -> dict:
    """The ``dflash.json`` contents (:mod:`.manifest`); ``args``: the loaded drafter's."""
    from importlib.metadata import version

    import mlx_lm

    archs = draft_config.get("architectures") or ["DFlashDraftModel"]
    return {
        "dflash_convert": MANIFEST_VERSION,
        "created_by": f"dflash-mlx {version('dflash-mlx')}, mlx-lm {mlx_lm.__version__}",
        "target": {"path": "target", **_origin(model, target_src), **target_entry},
        "drafter": {"path": "drafter", **_origin(draft_model, draft_src), "format": archs[0],
                    "block_size": args.block_size, "target_layer_ids": list(args.target_layer_ids),
                    "mask_token_id": args.mask_token_id, **drafter_entry},
        "files": files}
