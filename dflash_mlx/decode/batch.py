"""The DFlash step (spec section 5) for N >= 1 sequences: draft, verify, accept, roll back. What differs between
one sequence and a batch lives in the caches (:class:`OwnCaches`: one sequence in its own, trees there, spec
section 7; :class:`BatchedCaches`: left-padded layers rolled back per sequence) and the draft source (each
sequence's drafter cache, or one batched pass). Sequences join (:class:`Joining`) and leave between steps.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from .batch_join import BatchedCaches, Joining, OwnCaches, StepResult, context_rows
from .lookup import PromptLookup
from .stopping import StopCondition
from .tree import build_tree, verify_tree
from .width import Plan, WidthChooser, make_chooser
from ..drafter.batch import batch_drafts, pad_contexts
from ..errors import InputError
from ..prompt_cache.batch_prefix import BatchPrefix, prefix_not_batchable
from ..prompt_cache.store import PrefixStore
from ..protocol import MAX_COPY, Drafter, Proposal, attention_of
from ..sampling import Sampler, next_key
from ..stats import GenerationStats, weight_bytes
from ..targets import TargetAdapter
from ..prompt_cache.batch import compact

PLAIN = Plan(1, 0)


@dataclass
class BatchSequence:
    """One sequence: last committed ``token`` ([1] int32, not in the target cache), its new context features, rows the
    drafter has not read (``new_context``, [1, S, F] each; spec section 5), its drafter cache (None where the batch
    drafts in one pass), its own PRNG key ``rng`` (``mx.random.key``; None: MLX's global generator)."""

    key: Any
    rule: Any
    stop: StopCondition
    stats: GenerationStats
    token: mx.array
    new_context: List[mx.array] = field(default_factory=list)
    draft_cache: Optional[List[Any]] = None
    rng: Optional[mx.array] = None
    first: float = 0.0  # ``time.perf_counter()`` of its first token
    lookup: Optional[PromptLookup] = None

    def draw(self) -> Optional[mx.array]:
        """The key of this sequence's next draw (None where it has no key of its own)."""
        self.rng, key = next_key(self.rng)
        return key


class BatchDecoder:
    """The active sequences and their target cache.

    Args:
        target: a target adapter (batched: :func:`~dflash_mlx.prompt_cache.batch.not_batchable` is None).
        drafter: a bound drafter, or None (plain decoding).
        block_size: B, the widest verify (1 without a drafter).
        chooser: each step's :class:`~dflash_mlx.decode.width.Plan` (default: always B).
        store: the prompt cache (used where :attr:`prefix_off` is None).
        caches: where sequences decode: :class:`BatchedCaches` (default) or :class:`OwnCaches` (one at a time;
            trees need them: InputError for a chooser with tree budgets otherwise).
        lookup: drafts copied from each sequence's context where they match (:mod:`.lookup`).
        capture: without a drafter, target layers whose context features each sequence keeps and leaves
            with (:attr:`StepResult.features`), as training data (``dflash data``).
    """

    def __init__(self, target: TargetAdapter, drafter: Optional[Drafter], block_size: int,
                 chooser: Optional[WidthChooser] = None, store: Optional[PrefixStore] = None,
                 caches: OwnCaches | BatchedCaches | None = None, capture: Optional[List[int]] = None,
                 lookup: bool = False):
        self.caches = caches or BatchedCaches()
        self.target, self.drafter, self.lookup = target, drafter, lookup
        self.bytes = (weight_bytes(target.model), weight_bytes(drafter) if hasattr(drafter, "parameters") else 0)
        self.width = block_size if drafter is not None else 1
        if drafter is not None and chooser is None:
            chooser = make_chooser(target, drafter, block_size, None)
        if chooser and self.caches.batched and any(p and p.tree_budget for p in [*chooser.options, chooser.fixed]):
            raise InputError("trees verify one sequence in its own caches, not a batch: no --tree-budget here")
        self.chooser = chooser
        self.rows = max(chooser.max_verify if chooser else self.width, MAX_COPY + 1 if self.lookup else 1)  # per verify
        self.capture = drafter.target_layer_ids if drafter is not None else capture
        self.sequences: List[BatchSequence] = []
        self.turns = 0  # steps run by :meth:`turn`
        self.waiting = False  # requests wait to join (the server says): tokens per step, not the last reply, count
        self.cache = None
        self._verified: Optional[Tuple[mx.array, List[int]]] = None  # the last verify's context rows, all sequences
        self._queued = None  # the next (plan, tokens, features, keys): a plain step dispatched early, or (plan,)
        # a plain step dispatches the next before it reads its own on a GPU, which runs it while the host reads and
        # plans; MLX's CPU backend returns from async_eval once most of a forward has run: there it only adds overhead
        self.ahead = target.rollback_spans_forwards and mx.default_device() == mx.gpu
        self.batch_drafter = batch_drafts(drafter) if self.caches.batched else None
        self.prefix: Optional[BatchPrefix] = None
        self.prefix_off: Optional[str] = None
        if store is not None:
            self.prefix_off = prefix_not_batchable(drafter, self.batch_drafter is not None)
            if self.prefix_off is None:
                self.prefix = BatchPrefix(store, target, drafter, self.rows)

    def __len__(self) -> int:
        return len(self.sequences)

    def start(self, key: Any, prompt: Sequence[int], sampler: Optional[Sampler], stop: StopCondition,
              step_size: int = 2048, should_stop: Optional[Callable[[], bool]] = None,
              seed: Optional[int] = None, **own: Any) -> Joining:
        """A :class:`Joining` for a new sequence of request id ``key`` (hashable, distinct among the decoder's; nothing
        runs until its ``advance``); ``own``: ``cache``, ``draft_cache``, ``stats``, ``history`` of a sequence decoding
        in :class:`OwnCaches`. Raises InputError for an empty prompt or a stop condition allowing no token."""
        if len(prompt) == 0:
            raise InputError("the prompt is empty: give at least one token")
        if stop.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {stop.max_tokens}")
        ids = prompt if isinstance(prompt, mx.array) else mx.array(list(prompt), dtype=mx.int32)
        return Joining(self, key, ids, sampler, stop, step_size, should_stop, seed, **own)

    def add(self, joining: Joining, token: mx.array, new_context: List[mx.array], first: float) -> None:
        """Merge a prefilled sequence into the batch as its last row (its first token at ``first`` seconds)."""
        draft_cache = None
        if self.drafter is not None and self.batch_drafter is None:
            draft_cache = joining.draft_cache if joining.draft_cache is not None else self.drafter.make_cache()
        if self.batch_drafter is not None:  # the prompt's context rows go to the batched drafter cache now
            self.batch_drafter.join(context_rows(new_context) if new_context else None, joining.draft_cache)
            new_context = []
        self._split_context()
        self._unqueue()
        self.cache = self.caches.join(self.cache, joining)
        lookup = PromptLookup(joining.history + joining.prompt.tolist() + token.tolist()) if self.lookup else None
        self.sequences.append(BatchSequence(joining.key, joining.rule, joining.stop, joining.stats, token,
                                            new_context, draft_cache, joining.rng, first, lookup))

    def remove(self, keys: Sequence[Any]) -> None:
        """Drop the sequences of ``keys`` (:meth:`OwnCaches.leave`, :meth:`BatchedCaches.leave`)."""
        gone = set(keys)
        rows = [i for i, s in enumerate(self.sequences) if s.key not in gone]
        if len(rows) == len(self.sequences):
            return
        self._split_context()
        self._unqueue()
        self.cache = self.caches.leave(self, rows)
        self.sequences = [self.sequences[i] for i in rows]
        if self.batch_drafter is not None:
            self.batch_drafter.keep(rows)

    def clear(self) -> None:
        """Drop every sequence (after a failed step: the batch's caches are in no known state)."""
        self.sequences, self.cache, self._verified, self._queued = [], None, None, None
        if self.batch_drafter is not None:
            self.batch_drafter.keep([])

    def inconsistency(self) -> Optional[str]:
        """What is wrong with the bookkeeping (a batched cache not holding one row per sequence), or None."""
        caches = {"target": self.cache}
        if self.batch_drafter is not None:
            caches["drafter"] = self.batch_drafter.cache
        for name, cache in caches.items():
            if cache is None:
                if self.sequences:
                    return f"{len(self.sequences)} sequences but no {name} cache"
                continue
            rows = {int(c.left_padding.shape[0]) for c in cache if getattr(c, "left_padding", None) is not None}
            if rows and rows != {len(self.sequences)}:
                return f"the {name} cache holds {sorted(rows)} rows for {len(self.sequences)} sequences"
        return None

    def turn(self, joining: Deque[Joining]) -> Iterator[Tuple[Any, StepResult]]:
        """One turn of the decode loop that ``stream_generate`` and the server run: one prefill chunk of the first of
        ``joining`` (it leaves the queue with its first token or its failure), then one :meth:`step`. Yields
        ``(key, result)`` as each is ready; a failure is its result's ``error``, never raised (a failed step's is
        every sequence's, the batch cleared)."""
        if joining:
            first = joining[0]
            try:
                result = first.advance()
            except Exception as e:  # this sequence alone fails
                self.remove([first.key])
                result = StepResult([], None, error=e)
            if result is None:
                mx.clear_cache()
            else:
                joining.popleft()
                yield first.key, result
        if self.sequences:
            keys = [s.key for s in self.sequences]
            try:
                results = self.step()
            except Exception as e:  # step() cleared the batch
                results = [StepResult([], None, error=e) for _ in keys]
            self.turns += 1
            if self.turns % 256 == 0:
                mx.clear_cache()
            yield from zip(keys, results)

    def step(self) -> List[StepResult]:
        """One :class:`StepResult` per active sequence, in order; finished ones leave. A failing stop
        condition ends its sequence only (``error``); a failure of the shared work :meth:`clear` s and raises."""
        if not self.sequences:
            return []
        try:
            results = self._step()
        except Exception:
            self.clear()
            raise
        return self._commit(results)

    def _plan(self) -> Plan:
        if self._queued is not None:
            plan = self._queued[0]
            self._queued = None if len(self._queued) == 1 else self._queued  # (plan,): planned while a plain step ran
            return plan
        if self.chooser is None:
            return PLAIN
        return self.chooser.plan(len(self.sequences), any(s.rng is not None for s in self.sequences),
                                 None if self.waiting else [(s.key, s.stop.budget) for s in self.sequences])

    def _step(self) -> List[StepResult]:
        """Draft -> verify -> accept -> roll back: each sequence verifies its copy where prompt lookup finds one (no
        longer than the planned chain unless all copy), the others the planned DFlash chain, in one forward (a plain
        step where nothing is drafted)."""
        tic = time.perf_counter()
        copies = [s.lookup.propose(s.stop.budget - 1) if s.lookup and self._queued is None else []
                  for s in self.sequences]
        plan = PLAIN if all(copies) else self._plan()
        if not all(copies):  # a copy does not widen the verify of the sequences without one
            copies = [c[: plan.width - 1] for c in copies]
        probe = self.chooser is not None and self.chooser.probing and not any(copies)  # read before the next plan
        if plan.width == 1 and not any(copies):
            return self._plain(plan, tic, probe)
        tokens = self._tokens()
        drafts, proposals = self._propose(tokens, plan.block) if plan.width > 1 else (None, None)
        if drafts is not None:
            mx.async_eval(drafts)  # the draft runs while the verify's graph is built
        if plan.tree_budget is not None:
            decided, drafted = self._verify_tree(proposals[0], plan.tree_budget)
            kinds = [("tree", plan.tree_budget, drafted)]
        else:
            self._split_context()  # where nothing was drafted, the context rows wait for the drafter's next pass
            chain = plan.width - 1
            kinds = [("lookup", len(c) + 1, len(c)) if c else ("chain", plan.width, chain) for c in copies]
            drafts = copied(copies, None if drafts is None else drafts[:, :chain])
            decided = self._verify_chain(tokens, drafts, proposals, [drafted for _, _, drafted in kinds])
        seconds = time.perf_counter() - tic
        results = []
        for s, (a, out), (mode, width, drafted) in zip(self.sequences, decided, kinds):
            s.token = mx.array(out[a : a + 1], dtype=mx.int32)
            results.append(StepResult(out[: a + 1], a, None, None, None, mode, width, drafted, seconds, probe))
            if mode == "lookup":
                s.lookup.observe(a)
        if self.chooser is not None and not any(copies):
            self.chooser.observe(plan, seconds, [r.accepted for r in results])
        return results

    def _verify_tree(self, proposal: Proposal, budget: int) -> Tuple[List[tuple], int]:
        """The tree of ``proposal``'s top tokens verified (spec section 7): ``([(accepted, tokens)], drafted)``."""
        s = self.sequences[0]
        tree = build_tree(int(s.token.item()), proposal.logprobs, budget)
        key = s.draw()
        out, context = verify_tree(self.target, self.cache, self.capture, lambda x: s.rule.choose(x, key), tree)
        self._verified = (context, [len(out)])
        return [(len(out) - 1, out)], len(tree) - 1

    def _verify_chain(self, tokens: mx.array, drafts: mx.array, proposals: Optional[List[Proposal]],
                      limits: Sequence[int]) -> List[tuple]:
        """``tokens`` [N] and ``drafts`` [N, w-1] verified in one forward, decided by each sequence's rule on its
        verify rows (logits [N, w, V]) with one sync, ``(accepted a, the target's tokens [w])`` per sequence on the
        host, a at most ``limits[i]`` (drafts past it pad a shorter row: accepted or not, they are left to the next
        step); each sequence's rejected rows dropped (RollbackError where a cache cannot), then in a batch the
        padding every sequence has."""
        h, features = self.target(mx.concatenate([tokens[:, None], drafts], axis=1), self.cache, self.capture)
        logits = self.target.lm_head(h)
        decided = [s.rule.accept(proposals[i].head(drafts.shape[1]) if proposals else Proposal(drafts[i]), logits[i],
                                 s.draw()) for i, s in enumerate(self.sequences)]
        mx.eval([x for pick in decided for x in pick if x is not None], features, drafts)
        decided = [(min(s.rule.accepted(a, d, out := y.tolist()), limit), out)
                   for s, d, (a, y), limit in zip(self.sequences, drafts.tolist(), decided, limits)]
        self._verified = (features, [a + 1 for a, _ in decided]) if features is not None else None
        self.target.rollback(self.cache, [drafts.shape[1] - a for a, _ in decided])
        compact(self.cache)
        if self.batch_drafter is not None:
            compact(self.batch_drafter.cache)
        return decided

    def _tokens(self) -> mx.array:
        """[N] int32: every sequence's last committed token."""
        return mx.concatenate([s.token for s in self.sequences])

    def _propose(self, tokens: mx.array, block: int) -> Tuple[mx.array, Optional[List[Proposal]]]:
        """Drafts [N, block-1] of every sequence (lazy) from ``tokens`` [N], and per-sequence
        proposals (None from a batched pass)."""
        if self.batch_drafter is not None:
            if self._verified is not None and not any(s.new_context for s in self.sequences):
                context, rows = self._verified
                context = context[:, : max(rows)]
            else:
                self._split_context()
                contexts = [context_rows(s.new_context) if s.new_context else None for s in self.sequences]
                rows = [0 if c is None else c.shape[1] for c in contexts]
                context = pad_contexts(contexts, rows)
            for s in self.sequences:
                s.new_context = []
            self._verified = None
            return self.batch_drafter.draft(tokens, context, rows, block), None
        self._split_context()
        proposals = []
        for s in self.sequences:
            context = context_rows(s.new_context) if s.new_context else None
            s.new_context = []
            proposals.append(s.rule.propose(self.drafter, s.token, context, s.draft_cache, block, s.draw()))
        return mx.stack([p.tokens for p in proposals]), proposals

    def _split_context(self) -> None:
        """Split the last verify's context rows among the sequences (each one's ``new_context``)."""
        if self._verified is not None:
            features, rows = self._verified
            for i, (s, n) in enumerate(zip(self.sequences, rows)):
                s.new_context.append(features[i : i + 1, :n])
            self._verified = None

    def _plain(self, plan: Plan, tic: float, probe: bool = False) -> List[StepResult]:
        """One token per sequence; the next plain step is dispatched before this one is read where that pays (a GPU)
        and the caches can take it back (:meth:`_unqueue`); ``probe``: auto runs it to measure it."""
        self._split_context()
        if self._queued is not None:
            _, y, features, _ = self._queued
        else:
            y, features = self._forward()
            if self.ahead:  # its own eval, as mlx-lm's: reading it then waits for it alone, not the next step too
                mx.async_eval([a for a in (y, features) if a is not None])
        self._queued = None
        compact(self.cache)  # a batch's sliding-window layers drop rows out of every window (before the next forward,
        # so that taking it back finds the rows its windows held)
        if self.ahead and all(s.stop.budget > 1 and not (s.lookup and s.lookup.propose(1))
                              for s in self.sequences):  # a match may copy next step
            nxt = self._plan()
            keys = [s.rng for s in self.sequences]  # the keys before the next step's draws (:meth:`_unqueue`)
            self._queued = (nxt, *self._forward(y), keys) if nxt.width == 1 else (nxt,)
            mx.async_eval([a for a in self._queued[1:3] if a is not None])
        mx.eval(y, features if features is not None else [])
        chosen, seconds = y.tolist(), time.perf_counter() - tic
        results = []
        for i, s in enumerate(self.sequences):
            s.token = y if len(chosen) == 1 else y[i : i + 1]
            if features is not None:
                s.new_context.append(features[i : i + 1])
            results.append(StepResult([chosen[i]], None, None, None, None, "plain", 1, 0, seconds, probe))
        if self.chooser is not None:
            self.chooser.observe(plan, seconds, [0] * len(results))
        return results

    def _unqueue(self) -> None:
        """Take back a plain step dispatched early (before a sequence joins or leaves): its row leaves every
        sequence's cache and each sequence's PRNG key is as before its draw."""
        if self._queued is not None and len(self._queued) > 1:
            self.target.rollback(self.cache, [1] * len(self.sequences))
            for s, key in zip(self.sequences, self._queued[3]):
                s.rng = key
        self._queued = None

    def _forward(self, tokens: Optional[mx.array] = None) -> Tuple[mx.array, Any]:
        """The plain forward of every sequence's last token (or ``tokens`` [N]), lazy: ``(next tokens [N]
        int32, features [N, 1, F] or None)``."""
        tokens = self._tokens() if tokens is None else tokens
        h, features = self.target(tokens[:, None], self.cache, self.capture)
        logits = self.target.lm_head(h[:, -1])
        chosen = [s.rule.choose(logits[i : i + 1], s.draw()) for i, s in enumerate(self.sequences)]
        return (chosen[0] if len(chosen) == 1 else mx.concatenate(chosen)), features

    def _commit(self, results: List[StepResult]) -> List[StepResult]:
        """Cut each sequence's tokens at its stops and record the step in its stats (the one place a sequence's
        steps are counted); finished and failed (``error``) sequences leave."""
        done, now, attention = [], time.perf_counter(), attention_of(self.drafter)
        for s, r in zip(self.sequences, results):
            try:
                r.tokens, r.finish_reason = s.stop.cut(r.tokens)
            except Exception as e:  # this sequence's fault only: it leaves, the others go on
                r.tokens, r.error = [], e
            r.stats = s.stats
            s.stats.record_plan(r.source, r.width, r.seconds, r.accepted or 0, r.drafted, r.probe)
            s.stats.committed(len(r.tokens), s.first, now, attention)
            if s.lookup is not None:
                s.lookup.extend(r.tokens)
            if r.finish_reason is not None or r.error is not None:
                done.append(s.key)
                if r.finish_reason is not None and self.drafter is None and s.new_context:
                    r.features = context_rows(s.new_context)
        self.remove(done)
        return results


def copied(copies: Sequence[List[int]], chains: Optional[mx.array]) -> mx.array:
    """[N, D] int32 drafts: row i sequence i's copy (padded with 0) where it has one, else its row of ``chains``
    ([N, D], lazy, no copy longer; None where every sequence copies: D the longest copy)."""
    if not any(copies):
        return chains
    width = max(map(len, copies)) if chains is None else chains.shape[1]
    rows = mx.array([list(c) + [0] * (width - len(c)) for c in copies], dtype=mx.int32)
    return rows if chains is None else mx.where(mx.array([bool(c) for c in copies])[:, None], rows, chains)
