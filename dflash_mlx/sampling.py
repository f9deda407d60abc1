"""Sampling settings and the probabilities they give, exactly as mlx-lm's sampler filters them (top-p,
then min-p, then top-k, at temperature 1) and draws from ``softmax(filtered / temp)``. A top-k at or
above the vocabulary size is off; a temperature below :data:`MIN_TEMP` is greedy."""

from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler as mlx_lm_make_sampler

Sampler = Callable[[mx.array], mx.array]

MIN_TEMP = 1e-3  # temperatures in (0, MIN_TEMP) are greedy (1 / temp would overflow)


def effective_top_k(top_k: int, vocab_size: Optional[int]) -> int:
    """``top_k``, or 0 (off) when it is at least ``vocab_size`` (nothing to cut)."""
    return 0 if vocab_size is not None and top_k >= vocab_size else top_k


@dataclass(frozen=True)
class Sampling:
    """Temperature (0: greedy), top-p (1: off), min-p (0: off), top-k (0: off) and the vocabulary size V
    (None: unknown); calling it samples [..., V] log-probabilities to [...] int32 tokens as mlx-lm does."""

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

    def __call__(self, logprobs: mx.array, key: Optional[mx.array] = None) -> mx.array:
        """Tokens as mlx-lm samples them; with ``key``, from the same law drawn with that key (not MLX's global one)."""
        if key is None or self.greedy:
            return self._sampler(logprobs)
        return mx.random.categorical(self.log_probs(logprobs), key=key)

    def log_probs(self, logits: mx.array) -> mx.array:
        """[..., N] float32 ``log softmax(filter(log_softmax(logits)) / temp)`` of [..., N] scores: the
        distribution a sample is drawn from (spec section 9), -inf where a filter removed an outcome.

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


def next_key(rng: Optional[mx.array]) -> Tuple[Optional[mx.array], Optional[mx.array]]:
    """``(what is left, a key for one draw)`` of a sequence's own ``mx.random.key``; None: ``(None, None)``."""
    return (None, None) if rng is None else tuple(mx.random.split(rng))


def draw_path(scores: Callable[[int, mx.array], mx.array], first: mx.array, length: int,
              sampling: Optional[Sampling] = None, key: Optional[mx.array] = None,
              ids: Optional[mx.array] = None) -> Tuple[mx.array, Optional[mx.array]]:
    """One token per position, left to right, each depending on the one before (``first`` before position 0):
    ``scores(p, prev)`` gives position p's [..., k] scores of its candidates ``ids[p]`` [k] (None: the token ids
    0..k-1); the argmax (``sampling`` None or greedy), else a sample of ``sampling.log_probs`` drawn with ``key``.
    Returns ``(tokens [..., length] int32, q [..., length, k] float32, or None for the argmax)``."""
    prev, tokens, qs = first, [], []
    for p in range(length):
        score = scores(p, prev)
        if sampling is None or sampling.greedy:
            j = mx.argmax(score, axis=-1)
        else:
            log_q = sampling.log_probs(score)
            key, draw = next_key(key)
            j = mx.random.categorical(log_q, key=draw)
            qs.append(mx.exp(log_q))
        prev = j.astype(mx.int32) if ids is None else ids[p][j]
        tokens.append(prev)
    return mx.stack(tokens, axis=-1), (mx.stack(qs, axis=-2) if qs else None)
