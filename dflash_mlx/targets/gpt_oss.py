"""gpt-oss targets (``gpt_oss``): attention sinks, alternating sliding-window and full
layers, MoE blocks.

The sinks and the experts live inside the model's own layers, which run as loaded;
the adapter gives each layer its mask, windowed for the sliding layers, whose
``RotatingKVCache`` becomes a :class:`~dflash_mlx.prompt_cache.window.WindowKVCache`.
"""

from typing import Any, List, Sequence

import mlx.core as mx

from .base import TargetAdapter
from .fused import attention_mask


class GptOssAdapter(TargetAdapter):
    """mlx_lm.models.gpt_oss: masks by ``layer_types``."""

    def masks(self, h: mx.array, cache: Sequence[Any]) -> List[Any]:
        inner = self.inner
        full = attention_mask(h, cache[inner.ga_idx])
        window = attention_mask(h, cache[inner.swa_idx], window_size=inner.window_size)
        return [full if kind == "full_attention" else window for kind in inner.layer_types]


# model_type -> adapter: targets/__init__.py collects these from every file in targets/
MODEL_TYPES = {"gpt_oss": GptOssAdapter}
