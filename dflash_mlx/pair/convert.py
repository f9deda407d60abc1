"""``dflash convert``: a target and its drafter into one folder (``target/`` in mlx-lm format, ``drafter/``
in the released format, the ``dflash.json`` manifest), staged beside the output, validated, then renamed
into place (an error or Ctrl-C leaves nothing)."""

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.convert import MODEL_CONVERSION_DTYPES

from ..atomic import check_out, staging
from ..drafter.checkpoint import DRAFTER_FILES, load_drafter, read_config
from ..errors import ConfigError, InputError, ValidationError
from ..hub import resolve_model_path
from .gguf import convert_gguf, is_gguf
from .loading import TARGET_FILES, check_pair, load_model
from .manifest import MANIFEST, hash_files, write_manifest
from ..owned import MARKER, mark, marked
from ..prompt import encode_messages
from ..targets import make_adapter
from .validation import VALIDATION_MESSAGES, Check, SourceRun, validate
from .writing import DRAFT_Q_GROUP_SIZE, make_manifest, write_drafter, write_target

Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")  # mlx-lm convert's --q-mode choices
DTYPES = tuple(MODEL_CONVERSION_DTYPES)
# Released layouts that keep target_layer_ids and mask_token_id in 'dflash_config'.
DFLASH_CONFIG_LAYOUTS = ("DFlashDraftModel", "DFlash2DraftModel")
LAYOUT_SCRIPT = "scripts/convert/drafter_layout.py"
WRITER = "convert"  # the mark of a target-only output folder (dflash_mlx.owned)
Progress = Callable[[str], None]


@dataclass
class ConvertResult:
    """What :func:`convert` wrote: the folder, its manifest and the validation checks."""

    out: Path
    manifest: dict
    checks: List[Check] = field(default_factory=list)


def convert(model: str, draft_model: Optional[str], out: str | Path, *, quantize: bool = False,
            q_bits: Optional[int] = None, q_group_size: Optional[int] = None, q_mode: str = "affine",
            draft_q_bits: Optional[int] = None, draft_q_group_size: int = DRAFT_Q_GROUP_SIZE,
            dtype: Optional[str] = None, force: bool = False, validate_output: bool = True,
            progress: Optional[Progress] = None) -> ConvertResult:
    """Convert a target and its drafter into one folder (``target/``, ``drafter/``, ``dflash.json``), or a
    target alone (``draft_model`` None) into an mlx-lm folder, as ``mlx_lm.convert`` writes one.

    Args:
        model: a folder, a repo id (fetched into the Hugging Face cache) or a ``.gguf`` file (:mod:`.gguf`).
        draft_model: the drafter's folder or repo id, or None for the target alone.
        out: output folder; must not exist unless ``force`` (replaced once the new one is complete).
        quantize, q_bits, q_group_size, q_mode: quantize the target with mlx-lm (a GGUF file: q_bits, q_group_size).
        draft_q_bits, draft_q_group_size: quantize the drafter (default: keep it float).
        dtype: float16, bfloat16 or float32 weights (default: as stored; dequantizes a GGUF file).
        validate_output: run :func:`validate` on a pair; ``progress``: called with each stage's name.

    Raises:
        InputError: a bad option, or ``out`` exists without ``force``. CheckpointError: a source is missing,
            unreadable (offline and not cached), a truncated or foreign GGUF file or one of a type MLX cannot
            read. ConfigError: an unknown architecture or tokenizer, or a drafter config of the older layout.
            MismatchError: the drafter does not fit the target. ValidationError: a check failed.
    """
    out = Path(out).expanduser()
    check_options(quantize or is_gguf(model), q_bits, q_group_size, q_mode, draft_q_bits, draft_q_group_size, dtype)
    check_source_options(model, draft_model, quantize, draft_q_bits)
    check_out(out, force)
    check_replaceable(out)
    say = progress or (lambda _: None)
    target_src, draft_src, draft_config = _sources(model, draft_model, say)
    check_not_inside(out, target_src, *([draft_src] if draft_src else []))
    with staging(out, force, say=say) as tmp:
        target_dir = tmp / "target" if draft_model is not None else tmp / ".target"
        write = partial(_write_target, target_src, target_dir, say, quantize=quantize, q_bits=q_bits,
                        q_group_size=q_group_size, q_mode=q_mode, dtype=dtype)
        target_entry = write() if draft_model is None or is_gguf(model) else None  # a folder: after the check
        if draft_model is None:
            _as_model_folder(target_dir)
            return ConvertResult(out, {"target": target_entry})
        say("checking that the drafter fits the target")  # against a GGUF file's conversion (no other source)
        source_net, tokenizer, _ = load_model(str(target_src if target_entry is None else target_dir),
                                              "target model", lazy=True)
        source = make_adapter(source_net)
        drafter = load_drafter(str(draft_src))
        check_pair(drafter, source, draft_model)
        target_entry = target_entry or write()
        say("writing the drafter and hashing every file")
        drafter_entry = write_drafter(drafter, tmp / "drafter", draft_q_bits, draft_q_group_size, dtype)
        manifest = make_manifest(model, draft_model, target_src, draft_src, draft_config, drafter.args,
                                 target_entry, drafter_entry, hash_files(tmp))
        write_manifest(tmp, manifest)
        checks: List[Check] = []
        if validate_output:
            say("validating the converted pair")
            prompt = encode_messages(tokenizer, VALIDATION_MESSAGES, {"enable_thinking": False})
            reference = SourceRun.of(source, prompt)
            del source_net, source, drafter  # peak memory: the larger target, not both
            mx.clear_cache()
            checks = _validated(out, tmp, reference, draft_src)
    return ConvertResult(out, manifest, checks)


def _as_model_folder(folder: Path) -> None:
    """Move ``folder``'s files into its parent, the output (an mlx-lm folder), and mark that as convert's (so
    that ``--force`` may replace it later)."""
    for f in folder.iterdir():
        f.rename(folder.parent / f.name)
    folder.rmdir()
    mark(folder.parent, WRITER)


def _sources(model: str, draft_model: Optional[str], say: Progress):
    """``(target source, drafter folder or None, drafter config or None)``: a GGUF file as it is, folders
    and repo ids resolved (fetched into the Hugging Face cache)."""
    if is_gguf(model):
        target_src = Path(model).expanduser()
    else:
        say(f"fetching the target {model}")
        target_src = resolve_model_path(model, TARGET_FILES, what="target model")
    if draft_model is None:
        return target_src, None, None
    say(f"fetching the drafter {draft_model}")
    draft_src = resolve_model_path(draft_model, DRAFTER_FILES, what="drafter")
    draft_config = read_config(draft_src / "config.json")
    require_dflash_config(draft_config, draft_src / "config.json")
    return target_src, draft_src, draft_config


def _write_target(src: Path, dst: Path, say: Progress, dtype: Optional[str], **quantization) -> dict:
    """The target written to ``dst`` in mlx-lm format: a GGUF file by :func:`convert_gguf`, a folder by
    mlx-lm's convert (:func:`write_target`); returns the manifest entry."""
    if is_gguf(src):
        return convert_gguf(src, dst, dtype, say, quantization["q_bits"], quantization["q_group_size"])
    say("converting the target with mlx-lm")
    return write_target(src, dst, dtype=dtype, **quantization)


def check_source_options(model: str, draft_model: Optional[str], quantize: bool, draft_q_bits: Optional[int]) -> None:
    """InputError for flags that cannot apply to these sources: ``-q`` on a GGUF file (it keeps its own
    quantization), ``--draft-q-bits`` without a drafter."""
    if is_gguf(model) and quantize:
        raise InputError(f"-q/--quantize: {model} is a GGUF file, which keeps its own quantization "
                         "(--dtype dequantizes it; convert that folder again with -q to quantize it with mlx-lm)")
    if draft_model is None and draft_q_bits is not None:
        raise InputError("--draft-q-bits needs --draft-model (there is no drafter to quantize)")


def _validated(out: Path, tmp: Path, reference: SourceRun, draft_src: Path) -> List[Check]:
    """The checks of the staged folder ``tmp``; ValidationError naming those that failed."""
    checks = validate(tmp, reference, draft_src)
    if failed := [c.name for c in checks if c.ok is False]:
        raise ValidationError(f"{out}: the converted pair failed {', '.join(failed)}; nothing was written", checks)
    return checks


def check_replaceable(out: Path) -> None:
    """``--force`` replaces only what convert writes: an empty folder, a pair (with a ``dflash.json``) or a
    target alone (marked ``.dflash-mlx`` as convert's); a model folder of anyone else's (a Hugging Face
    download, with a ``config.json``) is refused with an InputError naming ``out``."""
    if out.is_dir() and any(out.iterdir()) and not ((out / MANIFEST).is_file() or marked(out, WRITER)):
        raise InputError(f"--out {out} holds files that convert did not write (no {MANIFEST} or {MARKER} of "
                         "convert's); --force replaces only a converted folder: give another --out")


def check_options(quantize: bool, q_bits: Optional[int], q_group_size: Optional[int], q_mode: str,
                  draft_q_bits: Optional[int], draft_q_group_size: int, dtype: Optional[str]) -> None:
    """InputError naming the flag of a value outside its choices, or a target quantization flag without
    ``-q`` (``quantize``: true also for a GGUF file, quantized again where MLX does not read its types)."""
    for flag, value, choices in (("--q-bits", q_bits, Q_BITS), ("--q-group-size", q_group_size, Q_GROUP_SIZES),
                                 ("--q-mode", q_mode, Q_MODES), ("--draft-q-bits", draft_q_bits, Q_BITS),
                                 ("--draft-q-group-size", draft_q_group_size, Q_GROUP_SIZES),
                                 ("--dtype", dtype, DTYPES)):
        if value is not None and value not in choices:
            raise InputError(f"{flag} must be one of {', '.join(map(str, choices))}, got {value}")
    for flag, given in (("--q-bits", q_bits is not None), ("--q-group-size", q_group_size is not None),
                        ("--q-mode", q_mode != "affine")):
        if given and not quantize:
            raise InputError(f"{flag} needs -q/--quantize (the target is kept unquantized without it)")


def check_not_inside(out: Path, *sources: Path) -> None:
    """InputError naming ``--out`` and the source where ``out`` is, or contains, a source."""
    target = out.resolve()
    for src in sources:
        src = src.resolve()
        if target == src or target in src.parents:
            raise InputError(f"--out {out} holds the source {src}; choose another output folder")


def require_dflash_config(config: dict, source: Path) -> None:
    """Refuse a DFlash drafter config without ``dflash_config`` (the older layout): convert does not guess the ids, the
    older layout goes through :data:`LAYOUT_SCRIPT` first (ConfigError naming the file, the key and the script)."""
    archs = config.get("architectures") or []
    if "dflash_config" not in config and archs and archs[0] in DFLASH_CONFIG_LAYOUTS:
        raise ConfigError(f"{source}: missing key 'dflash_config' (the older drafter layout, with top-level "
                          f"target_layer_ids/mask_token_id); convert it to the released layout first: "
                          f"python {LAYOUT_SCRIPT} {source.parent} NEW_DIR")
