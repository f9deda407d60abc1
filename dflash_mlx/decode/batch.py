"""Continuous batching: the DFlash loop (DFLASH_SPEC.md section 5) for many sequences at once.

Every step drafts a block for each active sequence, then verifies all of them in ONE
target forward ([N, B] tokens over a left-padded ``BatchKVCache``; sliding-window
layers too, their window in the mask, see :mod:`dflash_mlx.prompt_cache.batch_window`), and each sequence
keeps its own acceptance length: its own committed tokens, its own rollback
(:func:`dflash_mlx.prompt_cache.batch.rollback_ragged`) and its own drafter context.
Sequences join between steps (their prompts prefilled alone, one chunk at a time, by
:class:`~dflash_mlx.decode.batch_join.Joining`, then merged into the batch) and leave
between steps (finished, or dropped by the caller: a cancelled request).

Why not mlx-lm's ``BatchGenerator``: it decodes one token per sequence per step and
has no drafts, verify or per-sequence rollback; its cache classes are used here.

Prompt cache: with a store (:class:`dflash_mlx.prompt_cache.store.PrefixStore`), a joining
sequence resumes from the longest stored prefix of its prompt and prefills only the rest,
then stores its prompt, or for caches that cannot go back the states at its boundaries
(:mod:`dflash_mlx.prompt_cache.batch_prefix`); only where the drafter drafts the batch in one pass or
there is none (else ``prefix_refusal`` says why, and every prompt is prefilled whole).

Drafting: a drafter with ``batch_drafts`` drafts every sequence in one pass; any
other (scripted and simulated drafters) drafts sequence by sequence, lazily, so the
drafts and the verify are still one graph and one sync.

Each sequence's tokens are exactly those of the same request run alone: the target's
greedy tokens at T = 0, or draws by its own acceptance rule at T > 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .acceptance import count_accepted
from .batch_join import Joining, Sampler, context_rows
from .width import Plan, WidthChooser
from .generate import StepResult
from .stopping import StopCondition
from ..drafter.batch import pad_contexts
from ..errors import InputError
from ..prompt_cache.batch_prefix import BatchPrefix, batch_prefix_refusal
from ..prompt_cache.store import PrefixStore
from ..protocol import Drafter, Proposal
from ..stats import GenerationStats
from ..targets import TargetAdapter
from ..prompt_cache.batch import compact, extend, keep_rows, rollback_ragged, share_offsets


@dataclass
class BatchSequence:
    """One sequence of the batch.

    Attributes:
        key: the caller's handle (a request).
        rule: its acceptance rule (:func:`dflash_mlx.decode.acceptance.choose_rule`).
        stop: its stop condition (stop tokens, strings, max tokens).
        stats: its statistics (steps, acceptance histogram, tau).
        token: [1] int32, its last committed token (not in the target cache yet).
        pending: context rows [1, S, F] the drafter has not seen yet (the last
            verify's rows stay in the decoder's one array until a join, a leave or a
            plain step moves them here: :meth:`BatchDecoder._spill`).
        draft_cache: its drafter's context cache (None without a drafter).
        seed: its PRNG seed at T > 0, or None: each of its steps then draws from a
            PRNG state seeded by (seed, step), whatever else the batch holds, so the
            same seed gives the same text.
    """

    key: Any
    rule: Any
    stop: StopCondition
    stats: GenerationStats
    token: mx.array
    pending: List[mx.array] = field(default_factory=list)
    draft_cache: Optional[List[Any]] = None
    seed: Optional[int] = None

    def reseed(self, phase: int) -> None:
        """Seed the PRNG for this sequence's next draws (seeded sequences only)."""
        if self.seed is not None:
            mx.random.seed((self.seed * 1_000_003 + (self.stats.steps + self.stats.plain_steps) * 2 + phase) % 2**32)


class BatchDecoder:
    """The active sequences of a batch and their shared target cache.

    Args:
        target: a target adapter whose caches can batch
            (:func:`dflash_mlx.prompt_cache.batch.batch_refusal` is None).
        drafter: a bound drafter, or None (plain decoding, one token per step).
        block_size: B, tokens every verify feeds per sequence (2..the drafter's
            trained size; 1 without a drafter); with ``widths``, the widest.
        widths: chooses each step's width (:func:`dflash_mlx.decode.width.make_chooser`), or
            None: every step verifies B.
        store: the prompt cache, or None. Used where :attr:`prefix_refusal` is None.

    Attributes:
        sequences: the active sequences, in batch-row order.
        cache: one ``BatchKVCache`` per target layer, or None while the batch is empty.
        prefix: looks up and keeps prompt-cache entries (None: no store, or refused).
        prefix_refusal: why a given store is not used in this batch, or None.
    """

    def __init__(self, target: TargetAdapter, drafter: Optional[Drafter], block_size: int,
                 widths: Optional[WidthChooser] = None, store: Optional[PrefixStore] = None):
        self.target, self.drafter = target, drafter
        self.width = block_size if drafter is not None else 1
        self.widths = widths if drafter is not None else None
        self.capture = drafter.target_layer_ids if drafter is not None else None
        self.sequences: List[BatchSequence] = []
        self.cache = None
        # (features [N, B, F], rows [N]): the last verify's context rows, sequence i's first
        # rows[i], not yet in any sequence's pending rows (one slice for the drafter).
        self._context: Optional[Tuple[mx.array, List[int]]] = None
        # One drafter pass for the batch where the drafter has one; else per sequence.
        self.drafts = drafter.batch_drafts() if hasattr(drafter, "batch_drafts") else None
        self.prefix: Optional[BatchPrefix] = None
        self.prefix_refusal: Optional[str] = None
        if store is not None:
            self.prefix_refusal = batch_prefix_refusal(drafter, self.drafts is not None)
            if self.prefix_refusal is None:
                self.prefix = BatchPrefix(store, target, drafter, self.width)

    def __len__(self) -> int:
        return len(self.sequences)

    def start(self, key: Any, prompt: Sequence[int], sampler: Optional[Sampler], stop: StopCondition,
              step_size: int = 2048, should_stop: Optional[Callable[[], bool]] = None,
              seed: Optional[int] = None) -> Joining:
        """A :class:`Joining` for a new sequence (nothing runs until its ``advance``).

        Raises:
            InputError: an empty prompt, or a stop condition allowing no token.
        """
        if not prompt:
            raise InputError("the prompt is empty: give at least one token")
        if stop.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {stop.max_tokens}")
        return Joining(self, key, mx.array(list(prompt), dtype=mx.int32), sampler, stop, step_size, should_stop,
                       seed)

    def add(self, joining: Joining, token: mx.array, pending: List[mx.array]) -> None:
        """Merge a prefilled sequence into the batch as its last row."""
        draft_cache = self.drafter.make_cache() if self.drafter is not None and self.drafts is None else None
        if self.drafter is not None:
            joining.stats.acceptance_rule = joining.rule.name
        if self.drafts is not None:  # the prompt's context rows go to the batched drafter cache now
            self.drafts.join(context_rows(pending) if pending else None, joining.draft_cache)
            pending = []
        self._spill()
        self.cache = extend(self.cache, joining.cache)
        self.sequences.append(BatchSequence(joining.key, joining.rule, joining.stop, joining.stats, token,
                                            pending, draft_cache, joining.seed))

    def remove(self, keys: Sequence[Any]) -> None:
        """Drop the sequences of ``keys`` (finished or cancelled) from the batch."""
        gone = set(id(k) for k in keys)
        rows = [i for i, s in enumerate(self.sequences) if id(s.key) not in gone]
        if len(rows) == len(self.sequences):
            return
        self._spill()
        self.sequences = [self.sequences[i] for i in rows]
        self.cache = keep_rows(self.cache, rows)
        if self.drafts is not None:
            self.drafts.keep(rows)

    def clear(self) -> None:
        """Drop every sequence (after a failed step: the batch's caches are in no known state)."""
        self.sequences, self.cache, self._context = [], None, None
        if self.drafts is not None:
            self.drafts.keep([])

    def inconsistency(self) -> Optional[str]:
        """What is wrong with the batch's bookkeeping, or None: every layer cache (the
        target's and the batched drafter's) must hold one row per sequence, and none
        while the batch is empty."""
        caches = {"target": self.cache}
        if self.drafts is not None:
            caches["drafter"] = self.drafts.cache
        for name, cache in caches.items():
            if cache is None:
                if self.sequences:
                    return f"{len(self.sequences)} sequences but no {name} cache"
                continue
            rows = {int(c.left_padding.shape[0]) for c in cache if getattr(c, "left_padding", None) is not None}
            if rows and rows != {len(self.sequences)}:
                return f"the {name} cache holds {sorted(rows)} rows for {len(self.sequences)} sequences"
        return None

    def step(self) -> List[StepResult]:
        """One draft + verify for every active sequence; finished ones leave the batch.

        A failure that belongs to one sequence (its stop condition) ends that sequence
        only: its result carries the ``error`` and it leaves the batch. A failure of the
        batched work (drafting, the verify forward) empties the batch (:meth:`clear`)
        and is raised: every sequence of the batch has then left it.

        Returns:
            One :class:`StepResult` per sequence active before the step, in the order
            of :attr:`sequences` before it.
        """
        if not self.sequences:
            return []
        try:
            results = self._plain_step() if self.drafter is None else self._verify_step()
        except Exception:
            self.clear()
            raise
        return self._settle(results)

    def _verify_step(self) -> List[StepResult]:
        """The step with a drafter (a plain one where auto chose width 1), unsettled."""
        tic = time.perf_counter()
        seeded = any(s.seed is not None for s in self.sequences)
        plan = self.widths.plan(len(self.sequences), seeded) if self.widths else Plan(self.width, self.width)
        w = plan.width
        if w == 1:
            return self._plain_step(plan)
        tokens = mx.concatenate([s.token for s in self.sequences])  # [N] t_last
        drafts, proposals = self._propose(tokens, w)
        share_offsets(self.cache)
        h, features = self.target(mx.concatenate([tokens[:, None], drafts], axis=1), self.cache, self.capture)
        logits = self.target.lm_head(h)
        decided = self._decide(drafts, proposals, logits, features)
        results, rejected, seconds = [], [], time.perf_counter() - tic
        for i, (s, (a, out)) in enumerate(zip(self.sequences, decided)):
            rejected.append(w - 1 - a)
            s.stats.record_plan("chain", w, seconds, a, w - 1)
            s.token = mx.array(out[a : a + 1], dtype=mx.int32)
            results.append(StepResult(out[: a + 1], a, None))
        self._context = (features, [r.accepted + 1 for r in results])
        rollback_ragged(self.cache, rejected)
        compact(self.cache)
        if self.drafts is not None:
            compact(self.drafts.cache)
        if self.widths:
            self.widths.observe(plan, time.perf_counter() - tic, [r.accepted for r in results])
        return results

    def _greedy(self) -> List[bool]:
        """Per sequence, whether its rule is greedy (one argmax serves all those rows)."""
        return [bool(getattr(s.rule, "greedy", False)) for s in self.sequences]

    def _decide(self, drafts: mx.array, proposals: Optional[List[Proposal]], logits: mx.array,
                features: mx.array) -> List[tuple]:
        """Each sequence's acceptance rule on its verify rows (logits [N, B, V]; drafts
        [N, B-1]; ``proposals``: per sequence, or None for the drafts alone): one argmax for
        all greedy sequences, their own rule (and seed) for the others; one sync. Returns
        ``(accepted a, the target's tokens [B])`` per sequence, on the host."""
        greedy = self._greedy()
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32) if any(greedy) else None
        decided = []
        for i, s in enumerate(self.sequences):
            s.reseed(1)
            p = None if greedy[i] else proposals[i] if proposals is not None else Proposal(drafts[i])
            decided.append((None, None) if greedy[i] else s.rule.accept(p, logits[i]))
        mx.eval(argmax if argmax is not None else [], [d for pair in decided for d in pair if d is not None],
                features, drafts)
        drafts, argmax = drafts.tolist(), argmax.tolist() if argmax is not None else None
        out = []
        for i, (a, y) in enumerate(decided):
            y = argmax[i] if greedy[i] else y.tolist()
            out.append((count_accepted(drafts[i], y) if a is None else a.item(), y))
        return out

    def _propose(self, tokens: mx.array, width: int) -> Tuple[mx.array, Optional[List[Proposal]]]:
        """Drafts [N, width-1] of every sequence (lazy) from ``tokens`` [N] (``t_last``),
        and the per-sequence proposals (None from a batched pass: drafts alone). One
        batched pass when the drafter has one, its new context rows as one array: the
        last verify's features as they are, when no sequence has other pending rows."""
        if self.drafts is not None:
            if self._context is not None:  # then every pending list is empty (see _spill)
                context, rows = self._context
                context = context[:, : max(rows)]
            else:
                contexts = [context_rows(s.pending) if s.pending else None for s in self.sequences]
                rows = [0 if c is None else c.shape[1] for c in contexts]
                context = pad_contexts(contexts, rows)
            for s in self.sequences:
                s.pending = []
            self._context = None
            return self.drafts.draft(tokens, context, rows, width), None
        self._spill()
        proposals = []
        for s in self.sequences:
            s.reseed(0)
            context = context_rows(s.pending) if s.pending else None
            s.pending = []
            proposals.append(s.rule.propose(self.drafter, s.token, context, s.draft_cache, width))
        return mx.stack([p.tokens for p in proposals]), proposals

    def _spill(self) -> None:
        """Move the last verify's context rows into each sequence's pending rows (before
        the sequences change, or other rows are added after them)."""
        if self._context is not None:
            features, rows = self._context
            for i, (s, n) in enumerate(zip(self.sequences, rows)):
                s.pending.append(features[i : i + 1, :n])
            self._context = None

    def _plain_step(self, plan: Optional[Plan] = None) -> List[StepResult]:
        """Plain decoding: one token per sequence, one target forward for all, unsettled.
        With a drafter (auto chose ``plan``, width 1) each sequence's context row is kept
        for its next draft."""
        tic = time.perf_counter()
        self._spill()  # a plain step's row joins each sequence's pending rows
        inputs = mx.stack([s.token for s in self.sequences])
        share_offsets(self.cache)
        h, features = self.target(inputs, self.cache, self.capture)
        logits = self.target.lm_head(h[:, -1])
        greedy = self._greedy()
        argmax = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32) if any(greedy) else None
        picks = []
        for i, s in enumerate(self.sequences):
            s.reseed(1)
            picks.append(argmax[i] if greedy[i] else s.rule.choose(logits[i : i + 1]))
        mx.eval(picks, features if features is not None else [])
        results, seconds = [], time.perf_counter() - tic
        for i, (s, y) in enumerate(zip(self.sequences, picks)):
            s.token = y
            if self.drafter is None:
                s.stats.record_plain()
            else:
                s.stats.record_plan("plain", 1, seconds, 0, 0)
                s.pending.append(features[i : i + 1])
            results.append(StepResult(y.tolist(), None, None))
        compact(self.cache)  # sliding-window layers drop rows out of every window
        if plan is not None:
            self.widths.observe(plan, time.perf_counter() - tic, [0] * len(results))
        return results

    def _settle(self, results: List[StepResult]) -> List[StepResult]:
        """Cut each sequence's tokens at its stops; finished sequences, and those whose
        stop condition failed (``error`` set), leave."""
        done = []
        for s, r in zip(self.sequences, results):
            try:
                r.tokens, r.finish_reason = s.stop.cut(r.tokens)
            except Exception as e:  # this sequence's fault only: it leaves, the others go on
                r.tokens, r.error = [], e
            if r.finish_reason is not None or r.error is not None:
                done.append(s.key)
        self.remove(done)
        return results
