"""Drafter hyper-parameters: the released ``config.json`` parsed and validated
(DFLASH_SPEC.md section 2), and written back in the same layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from .errors import ConfigError

DRAFTER_ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """Target layers spread evenly, as older checkpoints without the key assume.

    Formula (spec section 2): ``round(1 + i * (N_target - 4) / (N_draft - 1))``,
    which gives ``[1, 9, 17, 25, 33]`` for 36 target layers and 5 drafter layers.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DrafterArgs:
    """Drafter hyper-parameters, as read from a released ``config.json``.

    Attributes:
        hidden_size: Width H; equals the target's hidden size.
        num_hidden_layers: Drafter layers.
        num_attention_heads, num_key_value_heads, head_dim: GQA shape.
        intermediate_size: SwiGLU MLP width.
        vocab_size: Equals the target's vocabulary size.
        target_layer_ids: 0-based target layers whose output is captured
            (``dflash_config.target_layer_ids``).
        mask_token_id: Unused vocabulary row used for masked block positions
            (``dflash_config.mask_token_id``).
        block_size: Trained block size B (top-level ``block_size``).
        num_target_layers: Layers of the target the drafter was trained for.
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
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "DrafterArgs":
        """Parse and validate a drafter config.

        Raises:
            ConfigError: a required key is missing or a value is out of range; the
                message names ``source`` and the key.
        """
        def need(key: str) -> Any:
            if key not in config:
                raise ConfigError(f"{source}: missing key '{key}'")
            return config[key]

        def number(key: str, value: Any, kind=int) -> Any:
            """``kind(value)``, or a ConfigError naming the key (e.g. "hidden_size": "wide")."""
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not float(value).is_integer()):
                raise ConfigError(f"{source}: '{key}' must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {value!r}")
            return kind(value)

        if not isinstance(config, dict):
            raise ConfigError(f"{source}: expected a JSON object, found {type(config).__name__}")
        dflash = config.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"{source}: 'dflash_config' must be an object, got {dflash!r}")
        archs = config.get("architectures") or []
        if not dflash and DRAFTER_ARCHITECTURE not in archs:
            raise ConfigError(
                f"{source}: not a DFlash drafter config (no 'dflash_config' and "
                f"'architectures' is {archs}); pass the drafter folder to --draft-model"
            )
        layer_types = config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(
                f"{source}: 'layer_types' {sorted(set(layer_types))} is not supported yet; "
                "only full_attention drafters load"
            )
        n_heads = number("num_attention_heads", need("num_attention_heads"))
        hidden = number("hidden_size", need("hidden_size"))
        n_layers = number("num_hidden_layers", need("num_hidden_layers"))
        n_target = config.get("num_target_layers")
        n_target = None if n_target is None else number("num_target_layers", n_target)
        layer_ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
        if layer_ids is None:
            if n_target is None:
                raise ConfigError(
                    f"{source}: missing key 'dflash_config.target_layer_ids' "
                    "(and no 'num_target_layers' to derive it)"
                )
            layer_ids = default_target_layer_ids(n_target, n_layers)
        if not isinstance(layer_ids, list):
            raise ConfigError(f"{source}: 'dflash_config.target_layer_ids' must be a list, got {layer_ids!r}")
        mask_id = dflash.get("mask_token_id", config.get("mask_token_id"))
        if mask_id is None:
            raise ConfigError(f"{source}: missing key 'dflash_config.mask_token_id'")
        rope_params = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = config.get("rope_scaling") or (rope_params or None)
        args = cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=number("num_key_value_heads", config.get("num_key_value_heads", n_heads)),
            head_dim=number("head_dim", config.get("head_dim") or hidden // max(n_heads, 1)),
            intermediate_size=number("intermediate_size", need("intermediate_size")),
            vocab_size=number("vocab_size", need("vocab_size")),
            target_layer_ids=[number("dflash_config.target_layer_ids", i) for i in layer_ids],
            mask_token_id=number("dflash_config.mask_token_id", mask_id),
            block_size=number("block_size", dflash.get("block_size", config.get("block_size", 16))),
            num_target_layers=n_target,
            rms_norm_eps=number("rms_norm_eps", config.get("rms_norm_eps", 1e-6), float),
            rope_theta=number("rope_theta", rope_theta, float),
            rope_scaling=rope_scaling,
            max_position_embeddings=number("max_position_embeddings",
                                           config.get("max_position_embeddings") or 40960),
        )
        args.validate(source)
        return args

    def validate(self, source: str = "config.json") -> None:
        """Check ranges that do not need the target.

        Raises:
            ConfigError: naming ``source`` and the offending key.
        """
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"{source}: 'dflash_config.mask_token_id' {self.mask_token_id} is outside "
                f"the vocabulary [0, {self.vocab_size})"
            )
        if self.block_size < 2:
            raise ConfigError(f"{source}: 'block_size' {self.block_size} must be at least 2")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(
                f"{source}: 'dflash_config.target_layer_ids' {self.target_layer_ids} "
                "must be a non-empty list of layer indices >= 0"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{source}: '{key}' must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )

    def to_config(self, dtype: str = "bfloat16") -> dict:
        """The ``config.json`` the authors' loader reads (Qwen3Config keys)."""
        return {
            "architectures": [DRAFTER_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
            },
            "torch_dtype": dtype,
        }
