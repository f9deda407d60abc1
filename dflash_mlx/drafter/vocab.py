"""A reduced draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's ``draft_vocab_size`` and ``d2t``): the
drafter drafts only among K frequent tokens, so its head is K rows of the target's, not V; the target
verifies as ever, so decoding stays exact."""

from dataclasses import replace
from typing import Callable, Optional

import mlx.core as mx


def head_columns(lm_head: Callable[[mx.array], mx.array], hidden_size: int, dtype: mx.Dtype,
                 columns: Optional[mx.array] = None) -> mx.array:
    """An output head as a matrix [H, C]: its logits of each unit vector (in ``dtype``; vocabulary ``columns``
    [C] only, default all), 256 at a time; the head's weights where it is linear (no softcapping)."""
    eye, rows = mx.eye(hidden_size, dtype=dtype), []
    for i in range(0, hidden_size, 256):
        part = lm_head(eye[i:i + 256])
        rows.append(part if columns is None else part[:, columns])
        mx.eval(rows[-1])
    head = mx.concatenate(rows)
    mx.eval(head)
    return head


def draft_vocab_head(lm_head: Callable[[mx.array], mx.array], ids: mx.array, hidden_size: int,
                     dtype: mx.Dtype) -> Callable[[mx.array], mx.array]:
    """FR-Spec's reduced head (Zhao et al. 2025): [..., H] -> [..., K] logits of the draft vocabulary ``ids`` [K],
    one [H, K] matmul of the head's rows (exact for a linear head); :func:`to_vocab` places them."""
    w = head_columns(lm_head, hidden_size, dtype, ids)
    return lambda h: h.astype(w.dtype) @ w


def to_vocab(logits: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """[..., K] logits of the draft vocabulary ``ids`` -> [..., V], -inf elsewhere (after any scale or softcap, so
    drafts and q stay inside)."""
    out = mx.full(logits.shape[:-1] + (vocab_size,), -mx.inf, dtype=logits.dtype)
    out[..., ids] = logits
    return out


def set_draft_vocab(drafter, ids: Optional[mx.array]) -> None:
    """Make ``drafter`` draft only among the tokens ``ids`` [K] int, ascending (saved as ``draft_vocab_size``
    and ``d2t``), or (None) the whole vocabulary; its head follows at the next ``bind``."""
    drafter.args = replace(drafter.args, draft_vocab_size=None if ids is None else ids.size)
    drafter.pop("d2t", None)
    if ids is not None:
        drafter.d2t = ids - mx.arange(ids.size)
