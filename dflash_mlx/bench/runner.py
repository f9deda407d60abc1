"""Run a baseline and DFlash alternately over a prompt set, in one process, timed by the consumer:
prompt time from the call to the first committed list, decode time from there to the last one (a
stop token's step is timed, its token not counted); peak memory in GB (1e9 bytes)."""

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import mlx.core as mx

from ..decode.generate import check_block_size, generate_step
from ..errors import InputError
from ..ranges import check_number
from ..sampling import Sampling
from ..stats import GenerationStats, rounded
from .datasets import Sample, encode_sample_turn
from .engines import DFlashEngine, Engine
from .simulate import SimulatedDrafter

ProgressFn = Callable[[str, int, int], None]  # (dataset, items done, items in all)
TRACE_STRIDE = 61  # blocks between the starts of two prompts' replay of a trace


def parse_baseline(spec: str) -> tuple[str, Optional[str]]:
    """``--baseline`` ``ar``, ``mlx-lm`` or ``draft-model:PATH`` as ``(kind, path or None)``; else InputError."""
    if spec in ("ar", "mlx-lm"):
        return spec, None
    if spec.startswith("draft-model:") and spec.split(":", 1)[1]:
        return "draft-model", spec.split(":", 1)[1]
    raise InputError(f"--baseline {spec}: expected ar, mlx-lm or draft-model:PATH")


@dataclass
class RunRecord:
    """One timed generation (seconds, GB). ``block_size``: the engine's label; ``first_tokens``: the
    first committed list's size; ``matches_baseline``: at temperature 0, tokens equal the baseline's."""

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
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.first_tokens

    @property
    def forwards(self) -> int:
        """Target forwards after the first token: verify steps and plain steps."""
        return self.stats.steps + self.stats.plain_steps

    @property
    def decode_tps(self) -> Optional[float]:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens > 0 else None

    @property
    def prompt_tps(self) -> Optional[float]:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else None

    def to_dict(self) -> dict:
        """The JSON record: seconds to the microsecond, no token ids."""
        stats = self.stats.to_dict(trace=False)
        return {
            "sample": self.sample, "turn": self.turn, "repeat": self.repeat, "engine": self.engine,
            "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
            "generation_tokens": len(self.tokens), "decode_tokens": self.decode_tokens,
            "prompt_s": rounded(self.prompt_s), "decode_s": rounded(self.decode_s),
            "prompt_tps": rounded(self.prompt_tps, 3), "decode_tps": rounded(self.decode_tps, 3),
            "phase_s": {k: rounded(v) for k, v in self.stats.phase_s.items()},
            **{k: stats[k] for k in ("steps", "plain_steps", "tau", "acceptance_rate", "acceptance_rule",
                                     "acceptance_histogram")},
            "peak_memory_gb": rounded(self.peak_memory_gb), "matches_baseline": self.matches_baseline}


def timed_run(engine: Engine, ids: List[int], max_tokens: int, sampler, stop_ids: Sequence[int]) -> RunRecord:
    """Run ``engine`` once on ``ids``; sample, turn and repeat left blank."""
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
        sample="", turn=0, repeat=0, engine=engine.name, block_size=engine.block_size, prompt_tokens=len(ids),
        tokens=tokens, first_tokens=first_tokens, prompt_s=(first - tic) if first is not None else 0.0,
        decode_s=(last - first) if first is not None else 0.0, stats=stats, peak_memory_gb=mx.get_peak_memory() / 1e9)


@dataclass
class BenchConfig:
    """What to run: ``block_sizes`` (B, None: the trained size, or ``"auto"``), ``tree_budgets`` (N
    nodes or ``"auto"``), ``repeats`` per prompt (each reseeded with ``seed``), ``simulate_acceptance``
    (A or a trace of A values, temp 0 only), ``warmup_tokens`` per engine (0: none), ``draft_window``,
    ``prompt_lookup`` (the DFlash rows copy drafts from the context too; never the plain baseline)."""

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
    prompt_lookup: bool = False

    def check(self) -> None:
        """Raises InputError naming the flag that is out of range."""
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
            only_fixed = not self.tree_budgets and fixed and len(fixed) == len(self.block_sizes)
            check_acceptance(self.simulate_acceptance, max(fixed) if only_fixed else None)

    def sampler(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.min_p, self.top_k)


def check_acceptance(accept: Union[int, Sequence[int]], block_size: Optional[int]) -> None:
    """Raises InputError unless A is in ``0..B-1`` (B the largest block, None: unknown) or the trace
    is a non-empty list of counts >= 0."""
    if not isinstance(accept, int):
        if not accept or min(accept) < 0:
            raise InputError("--simulate-acceptance: the trace must be a non-empty list of counts >= 0")
        return
    most = None if block_size is None else block_size - 1
    rule = "at least 0" if most is None else f"in 0..{most} (a block of {block_size} holds {most} drafts)"
    check_number("--simulate-acceptance", accept, at_least=0, at_most=most, rule=rule)


@dataclass
class DatasetResult:
    """All runs of one dataset, for :func:`.report.summarize`."""

    name: str
    num_samples: int
    baseline: str
    runs: List[RunRecord] = field(default_factory=list)


def greedy_continuation(target, ids: List[int], max_tokens: int, stop_ids: Sequence[int]) -> List[int]:
    """``ids`` followed by the target's plain greedy continuation (``max_tokens`` at most)."""
    out = list(ids)
    for step in generate_step(mx.array(ids, dtype=mx.int32), target, None, max_tokens=max_tokens,
                              stop_token_ids=stop_ids):
        out.extend(step.tokens)
    return out


class Runner:
    """Alternates the ``baseline`` engine and DFlash at each variant of ``config`` over samples;
    ``tokenizer`` is needed for text samples, ``stop_ids`` default to its EOS ids.

    Raises:
        InputError: a block size the drafter cannot draft, or a bad config.
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
        self._continuation: tuple = ((), [])
        self._prompts = 0  # prompts seen: where a replayed trace starts
        self._simulated: Dict[tuple, SimulatedDrafter] = {}

    def _dflash(self, variant: tuple, ids: List[int]) -> DFlashEngine:
        accept = self.config.simulate_acceptance
        if accept is None:
            return DFlashEngine(self.target, self.drafter, *variant, prompt_lookup=self.config.prompt_lookup)
        if self._continuation[0] != tuple(ids):  # one untimed plain greedy run per prompt
            horizon = self.config.max_tokens + max(self.block_sizes) + 64
            self._continuation = (tuple(ids), greedy_continuation(self.target, ids, horizon, self.stop_ids))
            self._prompts += 1
        if not isinstance(accept, int):  # each prompt replays the trace from its own place
            at = (self._prompts - 1) * TRACE_STRIDE % len(accept)
            accept = list(accept[at:]) + list(accept[:at])
        drafter = self._simulated.get(variant)  # one per variant: auto learns across prompts, as in use
        if drafter is None:
            drafter = self._simulated[variant] = SimulatedDrafter(self.drafter, (), 0, self.target.vocab_size)
        drafter.reset(self._continuation[1], accept)
        return DFlashEngine(self.target, drafter, *variant, prompt_lookup=self.config.prompt_lookup)

    def _run(self, engine: Engine, ids: List[int], max_tokens: int) -> RunRecord:
        mx.random.seed(self.config.seed)
        return timed_run(engine, ids, max_tokens, self.config.sampler(), self.stop_ids)

    def _prompt(self, sample: Sample, messages: List[dict], turn: int) -> List[int]:
        if sample.prompt_ids is not None:
            return list(sample.prompt_ids)
        if sample.turns:
            messages.append({"role": "user", "content": sample.turns[turn]})
        if self.tokenizer is None:
            raise InputError("text prompts need a tokenizer; give samples with prompt_ids instead")
        return encode_sample_turn(self.tokenizer, messages, self.config.enable_thinking)

    def run_dataset(self, name: str, samples: Sequence[Sample], progress: Optional[ProgressFn] = None) -> DatasetResult:
        """Every turn of every sample, every repeat: baseline and each variant back to back, the
        order reversed on every other run. ``progress(name, done, total)`` follows each item
        (one turn, all engines, one repeat). A later turn sees the baseline's earlier answers."""
        result = DatasetResult(name, len(samples), self.baseline.name)
        turns = [1 if s.prompt_ids is not None else max(len(s.turns), 1) for s in samples]
        done, total = 0, sum(turns) * self.config.repeats
        for index, sample in enumerate(samples):
            messages = list(sample.messages)
            for turn in range(turns[index]):
                ids = self._prompt(sample, messages, turn)
                if self.config.warmup_tokens > 0 and not self._warm:  # one short untimed run of every engine, once
                    for engine in [self.baseline] + [self._dflash(v, ids) for v in self.variants]:
                        self._run(engine, ids, self.config.warmup_tokens)
                self._warm = True
                for repeat in range(self.config.repeats):
                    runs = self._pair(ids, reverse=(index + repeat) % 2 == 1)
                    for r in runs:
                        r.sample, r.turn, r.repeat = sample.id, turn, repeat
                    result.runs.extend(runs)
                    done += 1
                    if progress is not None:
                        progress(name, done, total)
                if turn + 1 < len(sample.turns):
                    messages.append({"role": "assistant", "content": self.tokenizer.decode(runs[0].tokens)})
        return result

    def _pair(self, ids: List[int], reverse: bool) -> List[RunRecord]:
        """The baseline's run, then each variant's (run in reverse order if ``reverse``)."""
        engines = [self.baseline] + [self._dflash(v, ids) for v in self.variants]
        order = range(len(engines) - 1, -1, -1) if reverse else range(len(engines))
        records = {i: self._run(engines[i], ids, self.config.max_tokens) for i in order}
        for r in list(records.values()):
            if self.config.temp == 0 and r is not records[0]:
                r.matches_baseline = r.tokens == records[0].tokens
        return [records[i] for i in range(len(engines))]
