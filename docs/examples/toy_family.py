"""Toy targets: a family added as one file in dflash_mlx/targets/ (docs/architecture.md).

The toy model is mlx-lm's qwen3 decoder under its own ``model_type``, so nothing differs
from the generic walk of :class:`TargetAdapter`. A real family overrides only what its
mlx-lm file does differently: ``embed`` (an embedding scale), ``masks`` (sliding
windows), ``run_layers`` (per-layer inputs), ``lm_head`` (softcapping), ``exact_cache``
(a cache that cannot roll back), and sets ``supports_tree`` where tree verify can run
its layers.
"""

from .base import TargetAdapter


class ToyAdapter(TargetAdapter):
    """The generic decoder: one causal mask, the loaded head."""

    supports_tree = True


# model_type -> adapter: targets/__init__.py collects these from every file in targets/
MODEL_TYPES = {"toy": ToyAdapter}
