"""Drafter hyper-parameters: ``config.json`` parsed, validated and written back in the same layout
(spec sections 2 and 9). Format keys: :mod:`~dflash_mlx.drafter.formats`; other tools' keys:
:mod:`~dflash_mlx.drafter.variants`."""

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import ConfigError
from .formats import FORMATS, V1, DrafterFormat, detect_format, to_int, to_number
from .variants import engine_keys, pick, rope_parameters, rope_theta as read_rope_theta

DRAFTER_ARCHITECTURE = V1.architecture
LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Target layers spread evenly (spec section 2): ``round(1 + i * (N_target - 4) / (N_draft - 1))``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterArgs:
    """Drafter hyper-parameters, as read from a released ``config.json`` (spec sections 2 and 9).

    Attributes:
        target_layer_ids, mask_token_id: ``dflash_config`` keys (top level for Muse-Glimmer).
        block_size: trained block size B; num_target_layers: layers of the target it was trained for.
        architecture: ``architectures[0]``, the format (:mod:`dflash_mlx.drafter.formats`).
        layer_types: per layer ``full_attention`` or ``sliding_attention`` (None: all full);
            sliding_window: W in tokens; is_causal: in-block causality override (None: the format's rule).
        mask_embedding: the checkpoint has its own ``mask_embedding`` [H] weight (set by the loader).
        conv_kernel_size ... final_logit_softcapping: DFlash2's keys (0 / 1.0 / None: off).
        markov_rank ... confidence_head_with_markov: DSpark's keys (rank 0: no Markov head).
        global_head_dim ... attention_k_eq_v: Gemma 4 DSpark's attention keys (:mod:`~dflash_mlx.drafter.layers`).
        draft_vocab_size: K, drafts only among the tokens ``d2t`` [K] maps to (None: the whole vocabulary).
        config: the ``config.json`` parsed, so saving writes the same keys back (None for a new drafter).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: List[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    architecture: str = DRAFTER_ARCHITECTURE
    layer_types: Optional[List[str]] = None
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    mask_embedding: bool = False
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    global_head_dim: Optional[int] = None
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    draft_vocab_size: Optional[int] = None
    config: Optional[dict] = field(default=None, repr=False, compare=False)

    @property
    def format(self) -> DrafterFormat:
        return FORMATS[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_causal_layer(self, layer: int) -> bool:
        """``is_causal`` when set, else causal on sliding layers of formats not bidirectional (spec section 9)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.is_sliding(layer) and not self.format.bidirectional

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "DrafterArgs":
        """Parse and validate a drafter config of any format (:mod:`~dflash_mlx.drafter.formats`) in any
        layout (:mod:`~dflash_mlx.drafter.variants`); ConfigError: a required key is missing or a value does
        not fit (names ``source`` and the key)."""
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(config).__name__}")
        fmt = detect_format(config, source)
        dflash = config.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"{source}: 'dflash_config' must be an object, got {dflash!r}")

        def drafter_key(key: str, default: Any = None) -> Any:  # in the format's place or the other (agreeing)
            return pick(config, dflash, key, fmt.ids_at_top, source, default)

        args = cls(**_shape(config, source), **_dflash_keys(config, dflash, fmt, drafter_key, source),
                   **engine_keys(config, dflash, source), architecture=fmt.architecture, config=copy.deepcopy(config),
                   **fmt.read_keys(drafter_key, source))
        args.validate(source)
        return args

    def validate(self, source: str = "config.json") -> None:
        """Check ranges that do not need the target; ConfigError naming ``source`` and the key."""
        where = "" if self.format.ids_at_top else "dflash_config."
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"{source}: '{where}mask_token_id' {self.mask_token_id} is outside "
                              f"the vocabulary [0, {self.vocab_size})")
        if self.block_size < 2:
            raise ConfigError(f"{source}: 'block_size' {self.block_size} must be at least 2")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(f"{source}: '{where}target_layer_ids' {self.target_layer_ids} "
                              "must be a non-empty list of layer indices >= 0")
        for key in _SHAPE_KEYS[:7]:
            if getattr(self, key) <= 0:
                raise ConfigError(f"{source}: '{key}' must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads {self.num_attention_heads} is not a "
                              f"multiple of num_key_value_heads {self.num_key_value_heads}")
        types = self.layer_types
        if types is not None and (not isinstance(types, list) or len(types) != self.num_hidden_layers):
            raise ConfigError(f"{source}: 'layer_types' must list one type per layer ({self.num_hidden_layers}), "
                              f"got {types!r}")
        for i, t in enumerate(types or []):
            if t not in LAYER_TYPES:
                raise ConfigError(f"{source}: 'layer_types[{i}]' is {t!r}; expected one of {list(LAYER_TYPES)}")
        if types and "sliding_attention" in types and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(f"{source}: 'sliding_window' must be a positive number of tokens when a layer is "
                              f"sliding_attention, got {self.sliding_window!r}")
        self.format.validate_keys(self, source)

    def to_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` of this drafter: a loaded one's config with the same keys in the same
        places (values from these fields); a new one in its format's released layout (Qwen3Config keys)."""
        fmt = self.format
        top = {"architectures": [fmt.architecture], "model_type": fmt.model_type}
        top.update({key: getattr(self, key) for key in _SHAPE_KEYS})
        top.update(attention_bias=False, attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False,
                   layer_types=self.layer_types or ["full_attention"] * self.num_hidden_layers,
                   block_size=self.block_size, num_target_layers=self.num_target_layers)
        if self.sliding_window is not None:
            top["sliding_window"] = self.sliding_window
        if self.config is None and self.layer_types and "sliding_attention" in self.layer_types:
            top["use_sliding_window"] = True  # else transformers' Qwen3Config drops sliding_window
        top.update({key: getattr(self, key) for key in ("is_causal", "draft_vocab_size")
                    if getattr(self, key) is not None})
        if self.draft_vocab_size is None and "draft_vocab_size" in (self.config or {}):
            top["draft_vocab_size"] = self.vocab_size  # the map dropped: the whole vocabulary, no d2t
        own = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
               **fmt.write_keys(self, new=self.config is None)}
        dflash = {} if fmt.ids_at_top else own
        if fmt.ids_at_top:
            top.update(own)
        if self.config is None:
            return {**top, **({"dflash_config": dflash} if dflash else {}), "torch_dtype": dtype}
        return _merge(self.config, top, dflash, dtype, fmt)


def _merge(original: dict, top: dict, dflash: dict, dtype: str, fmt: DrafterFormat) -> dict:
    """``original`` with values from ``top`` and ``dflash``, each key where the original keeps it; a key
    it lacks is added only when it carries information (sliding layers, a causality override, ...)."""
    out = copy.deepcopy(original)
    nested = out.get("dflash_config") if isinstance(out.get("dflash_config"), dict) else None
    for key, value in list(top.items()) + list(dflash.items()):
        if key == "rope_scaling" and isinstance(out.get("rope_parameters"), dict):
            continue  # parsed from rope_parameters, which stays as it was
        if nested is not None and key in nested:
            nested[key] = value
        elif key in out:
            out[key] = value
        elif key == "rope_theta" and isinstance(out.get("rope_parameters"), dict):
            rope_parameters(out, "")["rope_theta"] = value  # Gemma 4's: in its full_attention entry
        elif key in dflash and key not in top:
            if key in _IDS or fmt.addable(key, value):
                out.setdefault("dflash_config", {})[key] = value
        elif key in _ADDABLE and value is not None and (key != "layer_types" or "sliding_attention" in value):
            out[key] = value
    for key in ("torch_dtype", "dtype"):
        if key in out:
            out[key] = dtype
    return out


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings")
_IDS = ("target_layer_ids", "mask_token_id")
_ADDABLE = ("sliding_window", "is_causal", "layer_types", "block_size", "num_target_layers", "draft_vocab_size")


def _shape(config: dict, source: str) -> Dict[str, Any]:
    """The network's shape: widths, heads, norm and RoPE settings."""

    def need(key: str) -> int:
        if key not in config:
            raise ConfigError(f"{source}: missing key '{key}'")
        return to_int(config[key], key, source)

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    rope_params = rope_parameters(config, source)
    return dict(
        hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=need("num_hidden_layers"),
        num_key_value_heads=to_int(config.get("num_key_value_heads", heads), "num_key_value_heads", source),
        head_dim=to_int(config.get("head_dim") or hidden // max(heads, 1), "head_dim", source),
        intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
        rms_norm_eps=to_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope_theta=to_number(read_rope_theta(config, source), "rope_theta", source),
        rope_scaling=config.get("rope_scaling") or (rope_params or None),
        max_position_embeddings=to_int(config.get("max_position_embeddings") or 40960, "max_position_embeddings",
                                       source))


def _dflash_keys(config: dict, dflash: dict, fmt: DrafterFormat, drafter_key: Callable, source: str) -> Dict[str, Any]:
    """``target_layer_ids`` (spread evenly when absent), ``mask_token_id``, ``block_size``, ``num_target_layers``."""
    where = "" if fmt.ids_at_top else "dflash_config."
    n_target = pick(config, dflash, "num_target_layers", True, source)
    n_target = None if n_target is None else to_int(n_target, "num_target_layers", source)
    layer_ids = drafter_key("target_layer_ids")
    if layer_ids is None:
        if n_target is None:
            raise ConfigError(f"{source}: missing key '{where}target_layer_ids' (and no 'num_target_layers' "
                              "to derive it)")
        layer_ids = default_target_layer_ids(n_target, to_int(config["num_hidden_layers"], "num_hidden_layers", source))
    if not isinstance(layer_ids, list):
        raise ConfigError(f"{source}: '{where}target_layer_ids' must be a list, got {layer_ids!r}")
    mask_id = drafter_key("mask_token_id")
    if mask_id is None:
        raise ConfigError(f"{source}: missing key '{where}mask_token_id'")
    return dict(target_layer_ids=[to_int(i, f"{where}target_layer_ids", source) for i in layer_ids],
                mask_token_id=to_int(mask_id, f"{where}mask_token_id", source),
                block_size=to_int(drafter_key("block_size", 16), "block_size", source), num_target_layers=n_target)
