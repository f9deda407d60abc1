"""How a verify decides which drafts to keep (spec sections 5 and 9), one rule per generation (:func:`choose_rule`):
``greedy`` (T = 0: drafts equal to the target's argmax), ``sample-and-match`` (T > 0, argmax drafts: d_i kept while it
equals y_{i-1} ~ p), ``speculative`` (T > 0, drafts sampled from q: d_i kept while u_i q_i(d_i) < p_i(d_i), then a
sample of normalize(max(p - q, 0)), or of p_B).

Every rule's ``accept`` returns ``(a, out)`` lazily: ``a`` accepted drafts (None where its ``accepted`` counts them on
the host) and ``out`` [B] int32 whose first ``a + 1`` entries are committed; after the step's one sync its ``accepted``
gives the count. ``key``: the sequence's own ``mx.random.key`` for the draw (None: MLX's global generator).
"""

from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from ..prompt_cache.pair import common_prefix
from ..protocol import Proposal, propose
from ..sampling import Sampling

GREEDY, SAMPLE_AND_MATCH, SPECULATIVE = "greedy", "sample-and-match", "speculative"


class MatchRule:
    """``greedy`` and ``sample-and-match``: argmax drafts kept while they equal the target's own choice
    (its argmax, or a sample of p at T > 0 by ``sampler``, over [N, V] log-probabilities)."""

    def __init__(self, sampler: Callable[[mx.array], mx.array]):
        self.sampler = sampler
        self.greedy = sampler is None or sampler is greedy_sampler or getattr(sampler, "greedy", False)
        self.name = GREEDY if self.greedy else SAMPLE_AND_MATCH

    def propose(self, drafter, token, context, cache, block_size, key=None) -> Proposal:
        """Argmax drafts (with the pass's lazy log-probabilities when the drafter gives them)."""
        return propose(drafter, token, context, cache, block_size)

    def choose(self, logits: mx.array, key: Optional[mx.array] = None) -> mx.array:
        """The target's own token per row of [N, V] logits ([N] int32): its argmax, or a sample of p."""
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return (self.sampler(logprobs) if key is None else self.sampler(logprobs, key)).astype(mx.int32)

    def accept(self, proposal: Proposal, logits: mx.array, key: Optional[mx.array] = None) -> Tuple[None, mx.array]:
        """logits [B, V] of the verify -> ``(None, out)``: the target's own choices (module doc)."""
        return None, self.choose(logits, key)

    @staticmethod
    def accepted(a: None, drafts: List[int], out: List[int]) -> int:
        """Drafts accepted, once evaluated: those equal to the target's own choices, up to the first that is not."""
        return common_prefix(drafts, out)


class SpeculativeRule:
    """``speculative``: standard speculative sampling with the drafter's q (``sampling`` shapes p and q)."""

    name, greedy = SPECULATIVE, False

    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def propose(self, drafter, token, context, cache, block_size, key=None) -> Proposal:
        return propose(drafter, token, context, cache, block_size, self.sampling, key)

    def choose(self, logits: mx.array, key: Optional[mx.array] = None) -> mx.array:
        """A sample of p per row of [N, V] logits ([N] int32), as mlx-lm samples."""
        return self.sampling(logits - mx.logsumexp(logits, axis=-1, keepdims=True), key).astype(mx.int32)

    @staticmethod
    def residual(p: mx.array, q: mx.array) -> mx.array:
        """max(p - q, 0) per row ([N, V], unnormalized); p where that is all zero (p == q)."""
        r = mx.maximum(p - q, 0.0)
        return mx.where(r.sum(axis=-1, keepdims=True) > 0, r, p)

    def accept(self, proposal: Proposal, logits: mx.array, key: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
        """logits [B, V] of the verify -> ``(a, out)`` (see the module doc)."""
        d = proposal.tokens
        p = self.sampling.probs(logits)  # [B, V]: p_i predicts the token after position i
        q = proposal.q_probs
        if q is None:  # deterministic drafts: a one-hot q
            q = mx.put_along_axis(mx.zeros(p[:-1].shape, dtype=mx.float32), d[:, None], mx.array(1.0), axis=-1)
        p_d = mx.take_along_axis(p[:-1], d[:, None], axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        keys = (None, None) if key is None else mx.random.split(key)
        a = mx.cumprod((mx.random.uniform(shape=d.shape, key=keys[0]) * q_d < p_d).astype(mx.int32)).sum()
        fixes = mx.random.categorical(mx.log(mx.concatenate([self.residual(p[:-1], q), p[-1:]])), key=keys[1])
        keep = mx.arange(d.size + 1) < a
        return a, mx.where(keep, mx.concatenate([d, d[:1]]), fixes).astype(mx.int32)

    @staticmethod
    def accepted(a: mx.array, drafts: List[int], out: List[int]) -> int:
        """Drafts accepted, once evaluated: the count :meth:`accept` drew."""
        return a.item()


def choose_rule(drafter, sampler) -> "MatchRule | SpeculativeRule":
    """``speculative`` when the drafter samples its drafts from q (``samples_drafts``) and the sampler is
    a :class:`Sampling` at T > 0; otherwise ``greedy`` or ``sample-and-match``."""
    if isinstance(sampler, Sampling) and not sampler.greedy and getattr(drafter, "samples_drafts", False):
        return SpeculativeRule(sampler)
    return MatchRule(sampler or greedy_sampler)

