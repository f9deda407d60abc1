"""Run a baseline and DFlash alternately over a prompt set, in one process.

Every engine is consumed the same way: the prompt ids go in, lists of committed
token ids come out (one list per target forward), and the consumer stamps each
list with ``time.perf_counter``. No engine detokenizes while it is timed (mlx-lm's
``stream_generate`` and ours wrap exactly these generators and add the detokenizer),
so the figures compare decoding and nothing else.

Per run:

- prompt time: from the call to the first committed token (prefill + first sample;
  for mlx-lm speculative decoding, whose first tokens come out of its first
  draft/verify cycle, that cycle too);
- decode time: from the first committed list to the last one; decode tokens are
  the tokens after the first list. A stop token ends the run; its step is timed,
  the token is not counted (as mlx-lm's ``stream_generate`` does);
- peak memory: ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``, in GB
  (1e9 bytes), weights included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import mlx.core as mx

from ..errors import InputError
from ..ranges import check_number
from ..decode.generate import check_block_size, generate_step
from ..sampling import Sampling
from .simulate import SimulatedDrafter
from ..stats import GenerationStats, histogram_dict
from .datasets import Sample, encode_sample_turn
from .engines import DFlashEngine, Engine

ProgressFn = Callable[[str, int, int], None]  # (dataset, items done, items in all)


def parse_baseline(spec: str) -> tuple[str, Optional[str]]:
    """Split ``--baseline``: ``ar``, ``mlx-lm`` or ``draft-model:PATH``.

    Raises:
        InputError: any other value.
    """
    if spec in ("ar", "mlx-lm"):
        return spec, None
    if spec.startswith("draft-model:") and spec.split(":", 1)[1]:
        return "draft-model", spec.split(":", 1)[1]
    raise InputError(f"--baseline {spec}: expected ar, mlx-lm or draft-model:PATH")


# --------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    """The figures of one timed generation.

    Attributes:
        sample, turn, repeat: which item (turn of a multi-turn sample) and which repeat.
        engine: engine name; ``block_size``: its B (1 for plain decoding), or the
            label of an adaptive or tree variant (``"auto"``, ``"tree 32"``).
        prompt_tokens: tokens prefilled.
        tokens: committed token ids (not written to JSON).
        first_tokens: tokens in the first committed list (not decode tokens).
        prompt_s: seconds from the call to the first committed list.
        decode_s: seconds from the first committed list to the last one.
        stats: the engine's :class:`~dflash_mlx.stats.GenerationStats` (verify steps,
            acceptance, phase seconds; the phases are zero for mlx-lm engines).
        peak_memory_gb: peak MLX memory during the run, GB.
        matches_baseline: at temperature 0, whether the tokens equal the baseline's
            (None for the baseline itself or when sampling).
    """

    sample: str
    turn: int
    repeat: int
    engine: str
    block_size: int | str
    prompt_tokens: int
    tokens: List[int] = field(repr=False, default_factory=list)
    first_tokens: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    stats: GenerationStats = field(default_factory=lambda: GenerationStats(block_size=1))
    peak_memory_gb: float = 0.0
    matches_baseline: Optional[bool] = None

    @property
    def generation_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.first_tokens

    @property
    def steps(self) -> int:
        """Verify steps."""
        return self.stats.steps

    @property
    def forwards(self) -> int:
        """Target forwards after the first token: verify steps and plain steps."""
        return self.stats.steps + self.stats.plain_steps

    @property
    def decode_tps(self) -> Optional[float]:
        """Decode tokens per second (None when nothing was decoded after the first list)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens > 0 else None

    @property
    def prompt_tps(self) -> Optional[float]:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else None

    def to_dict(self) -> dict:
        """JSON figures (seconds to the microsecond, tokens/s, GB); token ids are left out."""
        def r(x, n=6):
            return None if x is None else round(x, n)

        s = self.stats
        return {
            "sample": self.sample, "turn": self.turn, "repeat": self.repeat, "engine": self.engine,
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens, "decode_tokens": self.decode_tokens,
            "prompt_s": r(self.prompt_s), "decode_s": r(self.decode_s), "prompt_tps": r(self.prompt_tps, 3),
            "decode_tps": r(self.decode_tps, 3), "steps": s.steps, "plain_steps": s.plain_steps,
            "tau": r(s.tau, 4), "acceptance_rate": r(s.acceptance_rate, 4),
            "acceptance_rule": s.acceptance_rule,
            "acceptance_histogram": histogram_dict(s.histogram),
            "phase_s": {k: r(v) for k, v in s.phase_s.items()},
            "peak_memory_gb": r(self.peak_memory_gb), "matches_baseline": self.matches_baseline,
        }


def timed_run(engine: Engine, ids: List[int], max_tokens: int, sampler, stop_ids: Sequence[int]) -> RunRecord:
    """Run ``engine`` once on ``ids`` and time it in the consumer (see module doc).

    Returns:
        A :class:`RunRecord` with sample/turn/repeat left blank.
    """
    stats = GenerationStats(block_size=getattr(engine, "draft_block", engine.block_size), prompt_tokens=len(ids))
    tokens: List[int] = []
    first = last = None
    first_tokens = 0
    mx.clear_cache()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for chunk in engine.stream(ids, max_tokens, sampler, stop_ids, stats):
        last = time.perf_counter()
        if first is None:
            first, first_tokens = last, len(chunk)
        tokens.extend(chunk)
    return RunRecord(
        sample="", turn=0, repeat=0, engine=engine.name, block_size=engine.block_size,
        prompt_tokens=len(ids), tokens=tokens, first_tokens=first_tokens,
        prompt_s=(first - tic) if first is not None else 0.0,
        decode_s=(last - first) if first is not None else 0.0,
        stats=stats, peak_memory_gb=mx.get_peak_memory() / 1e9,
    )


# --------------------------------------------------------------------------- a dataset


@dataclass
class BenchConfig:
    """What to run.

    Attributes:
        max_tokens: most tokens per generation.
        block_sizes: DFlash block sizes to sweep (None = the drafter's trained size;
            ``"auto"``: widths chosen by measured cost).
        tree_budgets: DDTree budgets to run too (N nodes, or ``"auto"``), each drafted
            at the trained block size.
        temp, top_p, top_k, min_p: sampling (mlx-lm's sampler; temp 0 is greedy).
        seed: PRNG seed; each run reseeds with ``seed`` so runs are reproducible.
        repeats: runs of each engine per prompt.
        simulate_acceptance: A; when set, DFlash's proposals are the target's greedy
            continuation for the first A slots and wrong after (needs temp 0); or a
            trace of A values, one per block drafted (:func:`dflash_mlx.bench.simulate.read_trace`).
        enable_thinking: passed to the chat template.
        warmup_tokens: tokens of the warm-up run of each engine (0: no warm-up).
        draft_window: ``(sink, window)`` context rows the drafter keeps
            (``--draft-window``), or None: all.
    """

    max_tokens: int = 256
    block_sizes: Sequence[Optional[int | str]] = (None,)
    tree_budgets: Sequence[int | str] = ()
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repeats: int = 1
    simulate_acceptance: Optional[Union[int, Sequence[int]]] = None
    enable_thinking: bool = False
    warmup_tokens: int = 32
    draft_window: Optional[tuple] = None

    def check(self) -> None:
        """Raises InputError naming the flag that is out of range (before anything loads)."""
        check_number("--max-tokens", self.max_tokens, at_least=1)
        check_number("--repeats", self.repeats, at_least=1)
        check_number("--warmup-tokens", self.warmup_tokens, at_least=0)
        check_number("--seed", self.seed, at_least=0, at_most=2**64 - 1)
        for b in self.block_sizes:
            if isinstance(b, int):
                check_number("--block-size", b, at_least=2, rule="at least 2 (or 'auto')")
        for n in self.tree_budgets:
            if n != "auto":
                check_number("--tree-budget", n, at_least=1, rule="a node count >= 1 or 'auto'")
        if self.simulate_acceptance is not None:
            if self.temp != 0:
                raise InputError("--simulate-acceptance needs --temp 0 (it replays the greedy continuation)")
            fixed = [b for b in self.block_sizes if isinstance(b, int)]
            if not self.tree_budgets and fixed and len(fixed) == len(self.block_sizes):
                check_acceptance(self.simulate_acceptance, max(fixed))
            else:
                check_acceptance(self.simulate_acceptance, None)

    def sampler(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.min_p, self.top_k)


def check_acceptance(accept: Union[int, Sequence[int]], block_size: Optional[int]) -> None:
    """``--simulate-acceptance``: A in ``0..B-1``, the drafts of the largest block B
    drafted (no upper bound while B is not known); a trace's counts >= 0 (recorded at
    the trained block size, they are cut to B-1 at smaller ones).

    Raises:
        InputError: naming the flag and B; an empty trace.
    """
    if isinstance(accept, int):
        most = None if block_size is None else block_size - 1
        rule = "at least 0" if most is None else f"in 0..{most} (a block of {block_size} holds {most} drafts)"
        check_number("--simulate-acceptance", accept, at_least=0, at_most=most, rule=rule)
    elif not accept:
        raise InputError("--simulate-acceptance: the trace is empty")
    else:
        check_number("--simulate-acceptance", min(accept), at_least=0, rule="a trace of counts >= 0")


@dataclass
class DatasetResult:
    """All runs of one dataset; :func:`dflash_mlx.bench.report.summarize` digests them."""

    name: str
    num_samples: int
    baseline: str
    runs: List[RunRecord] = field(default_factory=list)


def greedy_continuation(target, ids: List[int], max_tokens: int, stop_ids: Sequence[int]) -> List[int]:
    """Prompt plus the target's plain greedy continuation (``max_tokens`` tokens at most)."""
    out = list(ids)
    for step in generate_step(mx.array(ids, dtype=mx.int32), target, None, max_tokens=max_tokens,
                              stop_token_ids=stop_ids):
        out.extend(step.tokens)
    return out


TRACE_STRIDE = 61  # blocks between the starts of two prompts' replay of a trace


class Runner:
    """Alternates a baseline and DFlash at each block size over samples.

    Args:
        target: the target adapter (used for DFlash and the ``ar`` baseline).
        drafter: the bound drafter.
        baseline: the baseline :class:`Engine`.
        config: :class:`BenchConfig`.
        tokenizer: mlx-lm ``TokenizerWrapper`` for text samples (chat template,
            stop tokens, decoding of multi-turn answers); None when every sample
            carries ``prompt_ids``.
        stop_ids: stop token ids (default: the tokenizer's EOS ids, else none).
    """

    def __init__(self, target, drafter, baseline: Engine, config: BenchConfig, tokenizer=None,
                 stop_ids: Optional[Sequence[int]] = None):
        config.check()
        self.target, self.drafter, self.baseline, self.config = target, drafter, baseline, config
        self.tokenizer = tokenizer
        if stop_ids is None:
            stop_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.stop_ids = tuple(stop_ids)
        self.variants = [(b if b == "auto" else check_block_size(b, drafter), None) for b in config.block_sizes]
        self.variants += [("auto" if n == "auto" else None, n) for n in config.tree_budgets]
        self.block_sizes = [check_block_size(b, drafter) for b, _ in self.variants]
        if config.simulate_acceptance is not None:
            check_acceptance(config.simulate_acceptance, max(self.block_sizes))
        self._warm = False
        self._continuations: Dict[tuple, List[int]] = {}
        self._prompts = 0  # prompts seen, for where a replayed trace starts
        self._simulated: Dict[tuple, SimulatedDrafter] = {}

    def _encode(self, messages: List[dict]) -> List[int]:
        if self.tokenizer is None:
            raise InputError("text prompts need a tokenizer; give samples with prompt_ids instead")
        return encode_sample_turn(self.tokenizer, messages, self.config.enable_thinking)

    def _dflash(self, variant: tuple, ids: List[int]) -> DFlashEngine:
        drafter = self.drafter
        A = self.config.simulate_acceptance
        if A is not None:
            key = tuple(ids)
            if key not in self._continuations:  # one plain greedy run per prompt, untimed
                horizon = self.config.max_tokens + max(self.block_sizes) + 64
                self._continuations = {key: greedy_continuation(self.target, ids, horizon, self.stop_ids)}
                self._prompts += 1
            if not isinstance(A, int):  # a trace: each prompt replays it from its own place, every engine alike
                at = (self._prompts - 1) * TRACE_STRIDE % len(A)
                A = list(A[at:]) + list(A[:at])
            drafter = self._simulated.get(variant)  # one per variant: auto learns across prompts, as in use
            if drafter is None:
                drafter = self._simulated[variant] = SimulatedDrafter(self.drafter, (), 0, self.target.vocab_size)
            drafter.reset(self._continuations[key], A)
        return DFlashEngine(self.target, drafter, *variant)

    def _run(self, engine: Engine, ids: List[int], max_tokens: int) -> RunRecord:
        mx.random.seed(self.config.seed)
        return timed_run(engine, ids, max_tokens, self.config.sampler(), self.stop_ids)

    def warmup(self, ids: List[int]) -> None:
        """One short run of every engine, so allocation and first-call costs are not timed."""
        n = self.config.warmup_tokens
        if n <= 0 or self._warm:
            return
        self._run(self.baseline, ids, n)
        for variant in self.variants:
            self._run(self._dflash(variant, ids), ids, n)
        self._warm = True

    def turns(self, sample: Sample) -> int:
        return 1 if sample.prompt_ids is not None else max(len(sample.turns), 1)

    def run_dataset(self, name: str, samples: Sequence[Sample], progress: Optional[ProgressFn] = None) -> DatasetResult:
        """Run every sample (every turn, every repeat): baseline and DFlash at each
        block size back to back, the order reversed on every other run to cancel drift.

        Args:
            name: dataset name for the report.
            samples: from :func:`dflash_mlx.bench.datasets.load_dataset`, or with ``prompt_ids``.
            progress: called as ``progress(name, done, total)`` after each item
                (an item is one turn of one sample, all engines, one repeat).

        Returns:
            :class:`DatasetResult` with one :class:`RunRecord` per run.
        """
        result = DatasetResult(name, len(samples), self.baseline.name)
        total = sum(self.turns(s) for s in samples) * self.config.repeats
        done = 0
        for index, sample in enumerate(samples):
            messages = list(sample.messages)
            for turn in range(self.turns(sample)):
                if sample.prompt_ids is not None:
                    ids = list(sample.prompt_ids)
                else:
                    if sample.turns:
                        messages.append({"role": "user", "content": sample.turns[turn]})
                    ids = self._encode(messages)
                self.warmup(ids)
                answer = None
                for repeat in range(self.config.repeats):
                    runs = self._pair(ids, reverse=(index + repeat) % 2 == 1)
                    for r in runs:
                        r.sample, r.turn, r.repeat = sample.id, turn, repeat
                    result.runs.extend(runs)
                    answer = runs[0].tokens
                    done += 1
                    if progress is not None:
                        progress(name, done, total)
                if sample.turns and turn + 1 < len(sample.turns):
                    messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})
        return result

    def _pair(self, ids: List[int], reverse: bool) -> List[RunRecord]:
        """Baseline then DFlash at each B (reversed order if ``reverse``); baseline first in the list."""
        engines: List[Any] = [self.baseline] + [self._dflash(v, ids) for v in self.variants]
        order = list(range(len(engines)))
        if reverse:
            order.reverse()
        records: Dict[int, RunRecord] = {}
        for i in order:
            records[i] = self._run(engines[i], ids, self.config.max_tokens)
        base = records[0]
        out = [base]
        for i in range(1, len(engines)):
            r = records[i]
            if self.config.temp == 0:
                r.matches_baseline = r.tokens == base.tokens
            out.append(r)
        return out
