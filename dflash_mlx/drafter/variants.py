"""Config keys other tools write for the same drafter (vLLM, SGLang, SpecForge, speculators), read into
our fields or refused with one line naming the key:

- ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``num_target_layers`` at the top level or
  under ``dflash_config`` (SGLang, Muse-Glimmer); ``rope_parameters.rope_theta`` (newer transformers):
  either place, two different values refused;
- vLLM: ``dflash_config.causal`` (the ``is_causal`` override); ``dflash_config.use_swa``,
  ``.swa_window_size`` or ``.sliding_window`` (must agree with ``layer_types``, ``sliding_window``);
  ``target_hidden_size`` (only when equal to ours); ``draft_vocab_size`` K (EAGLE-3's, FR-Spec's reduced draft
  vocabulary: drafts only among the K tokens its ``d2t`` weight maps to); a ``mask_embedding`` weight.
"""

from typing import Any, Dict

from ..errors import ConfigError
from .formats import to_int

_MISSING = object()


def pick(config: dict, dflash: dict, key: str, top_first: bool, source: str, default: Any = None) -> Any:
    """A key at the top level or under ``dflash_config`` (``top_first``: the format's own place first),
    ``default`` when neither has it; ConfigError when both hold different values (names both)."""
    top, nested = config.get(key, _MISSING), dflash.get(key, _MISSING)
    if top is not _MISSING and nested is not _MISSING and top != nested:
        raise ConfigError(f"{source}: 'dflash_config.{key}' {nested!r} and top-level '{key}' {top!r} disagree")
    first, second = (top, nested) if top_first else (nested, top)
    value = first if first is not _MISSING else second
    return default if value is _MISSING or value is None else value


def rope_parameters(config: dict, source: str) -> Dict[str, Any]:
    """``rope_parameters`` ({} when absent); of Gemma 4's per layer type the ``full_attention`` ones (a drafter's
    layers are all full attention: DeepSpec gemma4/modeling.py); ConfigError naming a value that is no object."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: 'rope_parameters' must be an object, got {params!r}")
    return params


def rope_theta(config: dict, source: str) -> Any:
    """``rope_theta``, or ``rope_parameters.rope_theta`` (10000 when neither); ConfigError when they differ."""
    theta = _agree(rope_parameters(config, source).get("rope_theta"), config.get("rope_theta"),
                   "rope_parameters.rope_theta", "rope_theta", source)
    return 10000.0 if theta is None else theta


def engine_keys(config: dict, dflash: dict, source: str) -> Dict[str, Any]:
    """``layer_types``, and ``is_causal`` and ``sliding_window`` from vLLM's ``dflash_config`` keys where the top level
    lacks them; ConfigError naming a key that contradicts another, is malformed or asks for what is not supported."""
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    target_hidden = pick(config, dflash, "target_hidden_size", True, source)
    if target_hidden is not None and target_hidden != hidden:
        raise ConfigError(f"{source}: 'target_hidden_size' {target_hidden!r} differs from hidden_size {hidden!r}; "
                          "drafters for a target of another width are not supported")
    draft_vocab = pick(config, dflash, "draft_vocab_size", True, source)
    if draft_vocab is not None and not 1 <= to_int(draft_vocab, "draft_vocab_size", source) <= (vocab or 0):
        raise ConfigError(f"{source}: 'draft_vocab_size' {draft_vocab!r} must be 1 to vocab_size {vocab!r}")
    causal = _agree(config.get("is_causal"), dflash.get("causal"), "is_causal", "dflash_config.causal", source)
    window = config.get("sliding_window")
    for key in ("swa_window_size", "sliding_window"):
        window = _agree(window, dflash.get(key), "sliding_window", f"dflash_config.{key}", source)
    use_swa, types = dflash.get("use_swa"), config.get("layer_types") or []  # must say what layer_types says
    if use_swa is not None and not isinstance(use_swa, bool):
        raise ConfigError(f"{source}: 'dflash_config.use_swa' must be true or false, got {use_swa!r}")
    if use_swa is not None and use_swa != (isinstance(types, list) and "sliding_attention" in types):
        raise ConfigError(f"{source}: 'dflash_config.use_swa' is {str(use_swa).lower()} but 'layer_types' "
                          f"{'names no' if use_swa else 'has a'} sliding_attention layer")
    if causal is not None and not isinstance(causal, bool):
        raise ConfigError(f"{source}: 'is_causal' must be true, false or null, got {causal!r}")
    return {"is_causal": causal, "layer_types": config.get("layer_types") or None, "draft_vocab_size":
            None if draft_vocab in (None, vocab) else int(draft_vocab),
            "sliding_window": None if window is None else to_int(window, "sliding_window", source)}


def _agree(ours: Any, theirs: Any, our_key: str, their_key: str, source: str) -> Any:
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigError(f"{source}: '{their_key}' {theirs!r} and '{our_key}' {ours!r} disagree")
    return ours if ours is not None else theirs
