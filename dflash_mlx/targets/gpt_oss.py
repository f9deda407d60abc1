"""gpt-oss targets: sliding-window and full layers by ``layer_types`` (sinks and experts run as loaded)."""

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


MODEL_TYPES = {"gpt_oss": GptOssAdapter}
