"""Drafter checkpoint formats, told apart by ``architectures[0]`` (spec sections 2 and 9): where the
DFlash keys sit, the format's own keys (:class:`FormatKey`) and how its weight names map onto the
network (:mod:`dflash_mlx.drafter.network`).

- ``DFlashDraftModel`` (v1): ids in ``dflash_config``; weights as the network; in-block attention
  bidirectional, causal on sliding layers.
- ``DFlash2DraftModel``: as v1, plus its ``dflash_config`` keys and ``layers.{i}.{attention,mlp}_conv.*``,
  ``candidate_selector.*`` weights.
- ``MuseGlimmerAssistantModel``: ids at the top level; ``encoder.fc.*`` -> ``fc.*``,
  ``encoder.output_norm_enc.*`` -> ``hidden_norm.*``; bidirectional.
- ``Qwen3DSparkModel`` (DSpark, and DeepSeek's DFlash block7 with ``markov_rank`` 0; spec section 11): ids and
  its keys at the top level; anchor-first (every block row drafts); ``embed_tokens.*``, ``lm_head.*`` (copies of
  the target's), ``markov_head.*``, ``confidence_head.*``; bidirectional.
- ``Gemma4DSparkModel``: as ``Qwen3DSparkModel`` with Gemma 4's layers and keys (:mod:`~dflash_mlx.drafter.layers`).

Any format may mix ``sliding_attention`` layers; a top-level ``is_causal`` overrides every layer.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..errors import ConfigError

REQUIRED = object()  # a FormatKey default: the key must be present


@dataclass(frozen=True)
class FormatKey:
    """One config key a format owns (in its ``dflash_config``, or at the top level with ``ids_at_top``), parsed
    into the DrafterArgs field ``name``: ``kind`` int or float (finite) of at least ``minimum``, or a tuple of the
    values that load; ``default`` when absent (:data:`REQUIRED`, or None: off)."""

    name: str
    kind: Any = int
    default: Any = REQUIRED
    minimum: Optional[float] = None

    def parse(self, value: Any, source: str, fmt: "DrafterFormat") -> Any:
        """The checked value (``value`` None: absent); ConfigError naming the key."""
        where = self.name if fmt.ids_at_top else f"dflash_config.{self.name}"
        if value is None:
            if self.default is REQUIRED:
                raise ConfigError(f"{source}: missing key '{where}' (needed by {fmt.architecture})")
            if (value := self.default) is None:
                return None
        if isinstance(self.kind, tuple):
            if value not in self.kind or type(value) is not type(self.kind[0]):
                raise ConfigError(f"{source}: '{where}' {value!r} is not supported ({fmt.architecture} loads "
                                  f"{' or '.join(map(repr, self.kind))})")
            return value
        value = to_int(value, where, source) if self.kind is int else to_number(value, where, source)
        if self.minimum is not None and value < self.minimum:
            bound = f"at least {self.minimum:g}" if self.kind is int else f">= {self.minimum:g} or null"
            raise ConfigError(f"{source}: '{where}' must be {bound}, got {value}")
        return value


@dataclass(frozen=True)
class DrafterFormat:
    """One released drafter layout.

    Attributes:
        architecture: ``architectures[0]``; model_type: written for a new checkpoint.
        ids_at_top: ``target_layer_ids`` and ``mask_token_id`` are top-level keys (else in ``dflash_config``).
        renames: ``(checkpoint prefix, network prefix)`` pairs for weight names.
        bidirectional: in-block attention bidirectional on every layer unless ``is_causal`` (else causal
            on sliding layers).
        anchor_first: every block row drafts, row k the token after it (the anchor's row too), so a verify of
            B tokens drafts with a block of B-1 rows; else row k drafts block position k, row 0 unused.
        stores_embeddings: the checkpoint holds copies of the target's ``embed_tokens`` and ``lm_head``.
        gemma4: Gemma 4's layers, embedding scale and capped head (:mod:`~dflash_mlx.drafter.layers`).
        keys: the config keys this format alone owns; check: their cross-checks (ConfigError).
    """

    architecture: str
    model_type: str
    ids_at_top: bool = False
    renames: Tuple[Tuple[str, str], ...] = ()
    bidirectional: bool = False
    anchor_first: bool = False
    stores_embeddings: bool = False
    gemma4: bool = False
    keys: Tuple[FormatKey, ...] = ()
    check: Optional[Callable[[Any, str], None]] = None

    def read_keys(self, lookup: Callable[[str], Any], source: str) -> Dict[str, Any]:
        """The DrafterArgs fields this format owns, from ``lookup(key)`` (None when absent); ConfigError."""
        return {k.name: k.parse(lookup(k.name), source, self) for k in self.keys}

    def validate_keys(self, args: Any, source: str) -> None:
        """Check this format's fields of ``args`` (ranges and cross-checks); ConfigError naming the key."""
        for k in self.keys:
            k.parse(getattr(args, k.name), source, self)
        if self.check is not None:
            self.check(args, source)

    def write_keys(self, args: Any, new: bool) -> Dict[str, Any]:
        """This format's own config entries (a new checkpoint leaves out defaults)."""
        values = {k.name: getattr(args, k.name) for k in self.keys}
        return {key: value for key, value in values.items() if not new or self.addable(key, value)}

    def addable(self, key: str, value: Any) -> bool:
        """Whether saving adds ``key`` to a config that lacked it: required, or away from its default."""
        spec = next((k for k in self.keys if k.name == key), None)
        return spec is not None and (spec.default is REQUIRED or value != spec.default)

    def network_key(self, key: str) -> str:
        """Checkpoint weight name -> the network's parameter name."""
        return _rename(key, self.renames)

    def checkpoint_key(self, key: str) -> str:
        """The network's parameter name -> checkpoint weight name."""
        return _rename(key, [(ours, stored) for stored, ours in self.renames])


def _rename(key: str, prefixes) -> str:
    return next((new + key[len(old):] for old, new in prefixes if key.startswith(old)), key)


def _check_dflash2(args: Any, source: str) -> None:
    """DFlash2 cross-checks: groups divide the width, candidates fit the vocabulary."""
    if args.hidden_size % args.conv_group_size:
        raise ConfigError(f"{source}: 'dflash_config.conv_group_size' {args.conv_group_size} does not divide "
                          f"hidden_size {args.hidden_size}")
    if args.selector_top_k > args.vocab_size:
        raise ConfigError(f"{source}: 'dflash_config.selector_top_k' {args.selector_top_k} exceeds vocab_size "
                          f"{args.vocab_size}")


# spec section 9: convolution taps K and channels per group g, selector rank r and top-k, three scalars
DFLASH2_KEYS = (
    FormatKey("conv_kernel_size", minimum=1), FormatKey("conv_group_size", minimum=1),
    FormatKey("selector_rank", minimum=1), FormatKey("selector_top_k", minimum=1),
    FormatKey("input_embedding_scale", float, default=1.0), FormatKey("output_multiplier", float, default=1.0),
    FormatKey("final_logit_softcapping", float, default=None, minimum=0.0))

# spec section 11: the Markov head's rank r (0: none) and type, the confidence head and its input
DSPARK_KEYS = (
    FormatKey("markov_rank", minimum=0), FormatKey("markov_head_type", ("vanilla",), default="vanilla"),
    FormatKey("enable_confidence_head", (False, True), default=False),
    FormatKey("confidence_head_with_markov", (False, True), default=False))

# DeepSpec gemma4/{config,modeling}.py: the attention's head width and K/V heads, K = V, the head's logit cap; keys
# whose other values DeepSpec's Gemma 4 drafter (no MoE block, no per-layer inputs) or mlx-lm's layer do not build
GEMMA4_KEYS = DSPARK_KEYS + (
    FormatKey("global_head_dim", minimum=1), FormatKey("num_global_key_value_heads", default=None, minimum=1),
    FormatKey("attention_k_eq_v", (False, True), default=False)) + DFLASH2_KEYS[-1:]
GEMMA4_FIXED = {"enable_moe_block": False, "hidden_size_per_layer_input": 0, "attention_bias": False,
                "hidden_activation": "gelu_pytorch_tanh"}


def _check_gemma4(args: Any, source: str) -> None:
    """A Gemma 4 DSpark config's :data:`GEMMA4_FIXED` keys (or null) and its K = V heads; ConfigError naming the key."""
    for key, value in (args.config or {}).items():
        if key in GEMMA4_FIXED and value is not None and repr(value) != repr(GEMMA4_FIXED[key]):
            raise ConfigError(f"{source}: '{key}' {value!r} is not supported ({args.architecture} loads "
                              f"{GEMMA4_FIXED[key]!r})")
    kv = args.num_global_key_value_heads
    if args.attention_k_eq_v and (kv is None or args.num_attention_heads % kv):
        raise ConfigError(f"{source}: 'num_global_key_value_heads' {kv!r} must divide num_attention_heads "
                          f"{args.num_attention_heads} (attention_k_eq_v is true)")


V1 = DrafterFormat("DFlashDraftModel", "qwen3")
DFLASH2 = DrafterFormat("DFlash2DraftModel", "qwen3", keys=DFLASH2_KEYS, check=_check_dflash2)
MUSE_GLIMMER = DrafterFormat("MuseGlimmerAssistantModel", "muse_glimmer_assistant", ids_at_top=True,
                             renames=(("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")),
                             bidirectional=True)
DSPARK = DrafterFormat("Qwen3DSparkModel", "qwen3", ids_at_top=True, bidirectional=True, anchor_first=True,
                       stores_embeddings=True, keys=DSPARK_KEYS)
GEMMA4_DSPARK = DrafterFormat("Gemma4DSparkModel", "gemma4_text", ids_at_top=True, bidirectional=True,
                              anchor_first=True, stores_embeddings=True, gemma4=True, keys=GEMMA4_KEYS,
                              check=_check_gemma4)
FORMATS: Dict[str, DrafterFormat] = {f.architecture: f for f in (V1, DFLASH2, MUSE_GLIMMER, DSPARK, GEMMA4_DSPARK)}


def detect_format(config: dict, source: str = "config.json") -> DrafterFormat:
    """The format of a drafter ``config.json`` from ``architectures[0]``; another (or no) architecture
    with a ``dflash_config`` is v1; else ConfigError naming the formats that load."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: 'architectures' must be a list, got {archs!r}")
    if archs and archs[0] in FORMATS:
        return FORMATS[archs[0]]
    if config.get("dflash_config"):
        return V1
    raise ConfigError(f"{source}: not a DFlash drafter config ('architectures' is {archs} and there is no "
                      f"'dflash_config'); drafter formats that load: {', '.join(FORMATS)}. "
                      "Pass the drafter folder to --draft-model")


def to_int(value: Any, key: str, source: str) -> int:
    """An integer config value (JSON numbers like 16.0 included), else ConfigError naming the key."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer())):
        raise ConfigError(f"{source}: '{key}' must be an integer, got {value!r}")
    return int(value)


def to_number(value: Any, key: str, source: str) -> float:
    """A finite number, else ConfigError naming the key."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: '{key}' must be a number, got {value!r} (finite)")
    return float(value)
