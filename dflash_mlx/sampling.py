"""Sampling settings and the probabilities they give, exactly as mlx-lm's sampler.

mlx-lm's ``make_sampler`` filters log-probabilities at temperature 1 (top-p, then
min-p, then top-k) and draws from ``softmax(filtered / temp)``. Speculative sampling
needs those probabilities themselves (the target's p and the drafter's q, DFLASH_SPEC.md
section 9), so :meth:`Sampling.log_probs` applies the same mlx-lm filters in the same
order; :class:`Sampling` is also a sampler, so it can go wherever mlx-lm's does.

One rule is added for top-k: k at or above the vocabulary size keeps every token, so
it means "no top-k" (mlx-lm refuses such a k). And one for temperature: below
:data:`MIN_TEMP` it is greedy (0), since ``1 / temp`` overflows (``5e-324`` would
otherwise turn every score into inf or NaN and draw garbage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

Sampler = Callable[[mx.array], mx.array]

# Temperatures in (0, MIN_TEMP) sample as greedy. At 1e-3 a float16 log-probability of
# -12 (the most likely token's worst case at V = 2^17) scales to -12000, still finite.
MIN_TEMP = 1e-3


def effective_top_k(top_k: int, vocab_size: Optional[int]) -> int:
    """``top_k``, or 0 (off) when it is at least ``vocab_size`` (nothing to cut)."""
    return 0 if vocab_size is not None and top_k >= vocab_size else top_k


@dataclass(frozen=True)
class Sampling:
    """Temperature, top-p, min-p and top-k, as the CLI flags give them.

    Calling it samples like ``mlx_lm.sample_utils.make_sampler(temp, top_p, min_p, 1,
    top_k=top_k)``: [..., V] log-probabilities in, [...] int32 tokens out.

    Attributes:
        temp: temperature; 0, or anything below :data:`MIN_TEMP`, is greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 is off.
        min_p: min-p threshold in [0, 1]; 0 is off.
        top_k: keep the k most likely tokens; 0, or ``vocab_size`` and above, is off.
        vocab_size: the target's vocabulary size V (None: unknown).
    """

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    vocab_size: Optional[int] = None
    _sampler: Sampler = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if 0 < self.temp < MIN_TEMP:
            object.__setattr__(self, "temp", 0.0)
        top_k = effective_top_k(self.top_k, self.vocab_size)
        object.__setattr__(self, "_sampler", mlx_lm_make_sampler(self.temp, self.top_p, self.min_p, 1, top_k=top_k))

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sampler(logprobs)

    def log_probs(self, logits: mx.array) -> mx.array:
        """Log-probabilities of the distribution a sample is drawn from.

        Args:
            logits: [..., N] float scores over N outcomes (a vocabulary, or a
                drafter's N candidates); any shift per row gives the same result.

        Returns:
            [..., N] float32 ``log softmax(filter(log_softmax(logits)) / temp)``, -inf
            where a filter removed an outcome. top-k is applied only when k < N
            (keeping all N is what a larger k means).

        Raises:
            ValueError: at temperature 0 (greedy has no distribution to shape).
        """
        if self.greedy:
            raise ValueError("Sampling.log_probs needs temp > 0 (greedy decoding is an argmax)")
        x = logits.astype(mx.float32)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            x = apply_top_p(x, self.top_p)
        if self.min_p != 0.0:
            x = apply_min_p(x, self.min_p, 1)
        if 0 < self.top_k < x.shape[-1]:
            x = apply_top_k(x, self.top_k)
        x = x * (1.0 / self.temp)  # as mlx-lm's categorical_sampling scales it
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def probs(self, logits: mx.array) -> mx.array:
        """``exp`` of :meth:`log_probs`: [..., N] float32, rows summing to 1."""
        return mx.exp(self.log_probs(logits))


def make_sampler(temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                 vocab_size: Optional[int] = None) -> Sampling:
    """mlx-lm's ``make_sampler(temp, top_p, min_p, 1, top_k=...)`` over [N, V] log-probabilities,
    as a :class:`Sampling` (so speculative sampling can form p and q from it).

    Args:
        temp: temperature; 0 is greedy.
        top_p, min_p: nucleus mass and min-p threshold (1.0 and 0.0 are off).
        top_k: the k most likely tokens; 0, or ``vocab_size`` and above, is off.
        vocab_size: the target's vocabulary size V (the logits' last dimension).
    """
    return Sampling(temp, top_p, min_p, top_k, vocab_size)
