"""Signs that a drafter in training collapses, as a learning rate too high for its width makes it: the
residual stream's RMS grows by orders of magnitude, every row of a block points the same way and the loss
stays at the data's unigram entropy (seen here at width 576 and lr 2e-3: RMS 5,400, row cosine 0.999)."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from ..drafter.network import DFlashDrafter
from .blocks import sample_anchors
from .data import TrainSequence
from .loss import make_batch

PUBLISHED_LR = 6e-4  # the DFlash recipe's peak rate (spec section 6), for drafters 2,560-4,096 wide
RMS_LIMIT = 1000.0  # residual RMS above this (healthy drafters here stay under 100)
COSINE_LIMIT = 0.99  # and the mean cosine of a block's rows above this (early on healthy runs are near 1 too)
EVERY = 50  # steps between two measurements


def lr_warning(lr: float, width: int) -> Optional[str]:
    """A one-line warning when ``lr`` is above the highest peak rate seen to train a drafter of hidden size
    ``width`` here, as a rule: 1e-3 * sqrt(1024 / width), never below :data:`PUBLISHED_LR` (width 64: 4e-3,
    where 3e-3 learns; width 576: 1.3e-3, between 6e-4, which learns, and 2e-3, which collapses); else None."""
    stable = max(PUBLISHED_LR, 1e-3 * (1024 / width) ** 0.5)
    if lr <= stable:
        return None
    return (f"--lr {lr:g} is high for a drafter {width} wide: above {stable:.1e} such drafters have collapsed "
            f"here (every block row alike, loss stuck); the default {PUBLISHED_LR:g} is the published rate")


@dataclass
class Health:
    """The residual stream's root mean square before the final norm, and the mean cosine between two rows
    of one block, over the blocks measured."""

    rms: float
    row_cosine: float

    def warning(self, lr: float) -> Optional[str]:
        """A one-line warning naming ``lr`` when both signs pass their limits, else None."""
        if self.rms <= RMS_LIMIT or self.row_cosine <= COSINE_LIMIT:
            return None
        return (f"the drafter is collapsing (residual RMS {self.rms:,.0f}, block rows alike: cosine "
                f"{self.row_cosine:.3f}): lower --lr (now {lr:g}) and train afresh")


def measure(drafter: DFlashDrafter, features: mx.array, seq: TrainSequence, block_size: int,
            blocks: int = 16) -> Health:
    """:class:`Health` over up to ``blocks`` blocks of ``seq`` (features [1, L, K*H]) at fixed anchors."""
    anchors = sample_anchors(np.random.default_rng(0), seq.tokens.size, seq.response_start, block_size, blocks)
    tokens, _, anchors_mx, mask = make_batch(seq, block_size, drafter.args.mask_token_id, anchors)
    h = drafter.block_hidden(tokens, features, anchors_mx, mask, residual=True).astype(mx.float32)  # [N, B-1, H]
    rms = mx.sqrt(mx.mean(h * h))
    unit = h / mx.maximum(mx.linalg.norm(h, axis=-1, keepdims=True), 1e-12)
    gram, rows = unit @ unit.transpose(0, 2, 1), h.shape[1]  # [N, B-1, B-1]
    cosine = (gram.sum(axis=(1, 2)) - mx.trace(gram, axis1=1, axis2=2)) / max(rows * (rows - 1), 1)
    return Health(float(rms.item()), float(mx.mean(cosine).item()))
