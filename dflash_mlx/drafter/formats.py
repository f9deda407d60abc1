"""Drafter checkpoint formats, told apart by ``architectures[0]`` (DFLASH_SPEC.md sections 2, 9).

A format says where its ``config.json`` keeps the DFlash keys, how its weight names map
onto the network of :mod:`dflash_mlx.drafter.network`, and which network pieces it uses. The
pieces themselves (sliding-window layers, DFlash2's block convolution and candidate
selector) live in the drafter file, so the method is read in one place.

| ``architectures[0]`` | ids and mask token | weights | in-block attention |
|---|---|---|---|
| ``DFlashDraftModel`` (v1) | ``dflash_config`` | as the network | bidirectional; causal on sliding layers |
| ``DFlash2DraftModel`` | ``dflash_config`` (+ conv, selector, scales) | + ``layers.{i}.{attention,mlp}_conv.*``, ``candidate_selector.*`` | as v1 |
| ``MuseGlimmerAssistantModel`` | top level | ``encoder.fc.*`` -> ``fc.*``, ``encoder.output_norm_enc.*`` -> ``hidden_norm.*`` | bidirectional |

Any format may mix ``sliding_attention`` layers (``layer_types``, ``sliding_window``);
a top-level ``is_causal`` overrides the in-block attention of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..errors import ConfigError


@dataclass(frozen=True)
class DrafterFormat:
    """One released drafter layout.

    Attributes:
        architecture: ``architectures[0]`` of its ``config.json``.
        model_type: ``model_type`` written for a new checkpoint.
        ids_at_top: ``target_layer_ids`` and ``mask_token_id`` are top-level keys
            (else under ``dflash_config``).
        renames: ``(checkpoint prefix, network prefix)`` pairs for weight names.
        dflash2: DFlash2 pieces (block convolution, candidate selector, scales).
        bidirectional: in-block attention is bidirectional on every layer unless
            ``is_causal`` says otherwise (else causal on sliding layers).
    """

    architecture: str
    model_type: str
    ids_at_top: bool = False
    renames: Tuple[Tuple[str, str], ...] = ()
    dflash2: bool = False
    bidirectional: bool = False

    def network_key(self, key: str) -> str:
        """Checkpoint weight name -> the network's parameter name."""
        for stored, ours in self.renames:
            if key.startswith(stored):
                return ours + key[len(stored):]
        return key

    def checkpoint_key(self, key: str) -> str:
        """The network's parameter name -> checkpoint weight name (inverse of :meth:`network_key`)."""
        for stored, ours in self.renames:
            if key.startswith(ours):
                return stored + key[len(ours):]
        return key


V1 = DrafterFormat("DFlashDraftModel", "qwen3")
DFLASH2 = DrafterFormat("DFlash2DraftModel", "qwen3", dflash2=True)
MUSE_GLIMMER = DrafterFormat(
    "MuseGlimmerAssistantModel", "muse_glimmer_assistant", ids_at_top=True,
    renames=(("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm.")), bidirectional=True,
)
FORMATS: Dict[str, DrafterFormat] = {f.architecture: f for f in (V1, DFLASH2, MUSE_GLIMMER)}


def detect_format(config: dict, source: str = "config.json") -> DrafterFormat:
    """The format of a drafter ``config.json``, from ``architectures[0]``.

    A config with another (or no) architecture but a ``dflash_config`` is read as v1,
    as older checkpoints were.

    Raises:
        ConfigError: neither a known architecture nor a ``dflash_config``; names the
            file, ``architectures`` and the formats that load.
    """
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: 'architectures' must be a list, got {archs!r}")
    if archs and archs[0] in FORMATS:
        return FORMATS[archs[0]]
    if config.get("dflash_config"):
        return V1
    raise ConfigError(
        f"{source}: not a DFlash drafter config ('architectures' is {archs} and there is no "
        f"'dflash_config'); drafter formats that load: {', '.join(FORMATS)}. "
        "Pass the drafter folder to --draft-model"
    )


def format_named(architecture: Optional[str]) -> DrafterFormat:
    """The format for an architecture name (None: v1)."""
    return FORMATS[architecture or V1.architecture]
