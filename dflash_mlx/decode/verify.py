"""The three kinds of target step the decode loop chooses between (spec sections 5 and 7).

- :func:`plain_step`: one token, as plain decoding (width 1), capturing its context
  features so the drafter can catch up later.
- :func:`chain_step`: the last committed token and the first ``width - 1`` drafts of
  one drafted block, verified in one forward built on the lazy drafts (drafting and
  verifying are one graph and one sync), then rolled back to the accepted prefix.
- :func:`tree_step`: DDTree, the ``budget`` most likely draft prefixes verified in one
  forward with tree positions and an ancestor-only mask, walked with the target's
  tokens, then compacted to the accepted path.

Each speculative step returns a :class:`Outcome`; every one keeps the output exactly the
target's (the acceptance rules of :mod:`dflash_mlx.decode.acceptance`, or the tree walk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .acceptance import count_accepted
from ..protocol import Proposal
from ..targets import TargetAdapter
from .tree import DraftTree, walk


@dataclass
class Outcome:
    """What one speculative verify committed.

    Attributes:
        tokens: committed ids: the accepted drafts, then the target's own token.
        accepted: a, drafts accepted (``len(tokens) - 1``).
        drafted: drafts the verify checked (``width - 1``, or the tree's node count).
        context: [1, a + 1, F] context features of the committed tokens but the last
            (the last committed token is not in the target cache yet).
        drafts: the drafted block's top-1 drafts d_1..d_{B-1} on the host, for the
            cost model's shadow acceptance.
        wait_s: seconds the host waited for the device (in ``mx.eval``), so the
            rest of the step's wall time is host work: graph building, dispatch,
            acceptance and rollback.
    """

    tokens: List[int]
    accepted: int
    drafted: int
    context: mx.array
    drafts: List[int]
    wait_s: float = 0.0


def plain_step(target: TargetAdapter, cache: List[Any], capture: Sequence[int], pick,
               token: mx.array) -> Tuple[mx.array, mx.array]:
    """One plain decoding step (lazy).

    Args:
        token: [1] int32, the last committed token (not in ``cache`` yet).
        pick: logits [N, V] -> [N] int32 tokens (the acceptance rule's ``choose``).

    Returns:
        ``(next_token [1] int32, features [1, 1, F] of ``token``)``.
    """
    h, features = target(token[None], cache, capture)
    return pick(target.lm_head(h[:, -1])), features


def chain_step(target: TargetAdapter, cache: List[Any], capture: Sequence[int], rule, token: mx.array,
               proposal: Proposal, width: int) -> Outcome:
    """Verify ``[token, d_1 .. d_{width-1}]``; one sync covers drafting and verifying.

    Args:
        token: [1] int32 last committed token.
        proposal: the drafted block (lazy), at least ``width - 1`` drafts.
        width: n, 2..B: tokens fed to the target.

    Raises:
        RollbackError: the cache cannot drop the rejected rows exactly.
    """
    head = proposal.head(width - 1)
    h, features = target(mx.concatenate([token, head.tokens])[None], cache, capture)
    a, out = rule.accept(head, target.lm_head(h)[0])
    wait_s = synced(out, features, proposal.tokens, *([] if a is None else [a]))
    out, drafts = out.tolist(), proposal.tokens.tolist()
    a = count_accepted(drafts[: width - 1], out) if a is None else a.item()
    target.rollback(cache, width - 1 - a)
    return Outcome(out[: a + 1], a, width - 1, features[:, : a + 1], drafts, wait_s)


def tree_step(target: TargetAdapter, cache: List[Any], capture: Sequence[int], pick, position: int,
              proposal: Proposal, tree: DraftTree) -> Outcome:
    """DDTree verify of a draft tree (spec section 7; :func:`dflash_mlx.decode.tree.build_tree`).

    Args:
        position: absolute position of the tree's root, the last committed token
            (the cache's committed rows).
        proposal: the drafted block the tree was built from (its top-1 drafts feed
            the cost model).
        tree: the root and the best draft prefixes.
        pick: the target's token at each node from its logits ([1+N, V] -> [1+N]):
            the argmax at T = 0, an independent sample of p at T > 0, so the walk
            commits exactly the target's tokens (each node's token is drawn from the
            target given that node's path).

    Raises:
        RollbackError: the cache cannot keep only the accepted path.
    """
    positions = position + np.asarray(tree.depths)
    inputs = mx.array(tree.tokens, dtype=mx.int32)[None]
    h, features = target(inputs, cache, capture, tree=(positions, tree.ancestors()))
    choice = pick(target.lm_head(h)[0])
    wait_s = synced(choice, features)
    path, tokens = walk(tree, choice.tolist())
    target.compact(cache, len(tree), path)
    context = mx.take(features, mx.array(path, dtype=mx.int32), axis=1)
    return Outcome(tokens, len(path) - 1, len(tree) - 1, context, proposal.tokens.tolist(), wait_s)


def synced(*arrays) -> float:
    """``mx.eval(*arrays)``; returns the seconds the host waited."""
    tic = time.perf_counter()
    mx.eval(*arrays)
    return time.perf_counter() - tic


def host_logprobs(proposal: Proposal) -> Optional[np.ndarray]:
    """The block's per-position log-probabilities [B-1, V] as float32 NumPy (a sync),
    or None when the drafter does not give them (scripted and simulated drafters)."""
    if proposal.logprobs is None:
        return None
    return np.array(proposal.logprobs.astype(mx.float32))
