"""Agent traces: JSONL of ``{"prompt": "..."}`` (raw text) or ``{"messages": [...]}`` requests whose
prompts share growing prefixes, replayed greedily in one of ``MODES``: ``cold`` (prefilled whole),
``disk`` (a new prompt cache per request over one store folder: what a new process finds), ``live``
(one prompt cache, as ``dflash serve``) or ``mlx-lm`` (its prompt cache trimmed to each next prompt's
common prefix, no drafter). Times in seconds from the call, any restore included."""

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..atomic import write_json
from ..errors import InputError
from ..prompt import encode_messages
from ..targets.fused import unfused
from .datasets import read_rows

MODES = ("cold", "disk", "live", "mlx-lm")
BUCKETS = (1024, 2048, 4096, 8192, 16384)  # prompt-length buckets for tau against context


@dataclass
class RequestRecord:
    """One replayed request; ``tau`` None when no verify step ran."""

    trace: str
    index: int
    mode: str
    prompt_tokens: int
    reused: int
    prefilled: int
    ttft_s: float
    total_s: float
    generated: int
    tau: Optional[float]
    text: str
    same_as_cold: Optional[bool] = None


def read_agent_trace(path: str | Path) -> List[Any]:
    """The requests of a trace file (prompt strings or message lists); InputError names a bad row."""
    out = []
    for n, row in enumerate(read_rows(path, "--agent-trace"), 1):
        prompt, messages = (row.get("prompt"), row.get("messages")) if isinstance(row, dict) else (None, None)
        if not isinstance(prompt, str) and not isinstance(messages, list):
            raise InputError(f"--agent-trace {path}: row {n}: needs a \"prompt\" string or a \"messages\" list")
        out.append(prompt if isinstance(prompt, str) else messages)
    if not out:
        raise InputError(f"--agent-trace {path}: no requests")
    return out


def encode_requests(tokenizer: Any, requests: Sequence[Any]) -> List[List[int]]:
    """Token ids of each request: raw prompts as text, message lists through the chat template."""
    return [list(tokenizer.encode(r)) if isinstance(r, str) else encode_messages(tokenizer, r) for r in requests]


def _timed(stream, text: Callable[[Any], str], tic: float) -> tuple:
    """(time to first item, total time, text, last item) of ``stream``, from ``tic``."""
    ttft, parts, last = None, [], None
    for last in stream:
        ttft = time.perf_counter() - tic if ttft is None else ttft
        parts.append(text(last))
    return ttft, time.perf_counter() - tic, "".join(parts), last


def replay_dflash(pair: Any, trace: str, prompts: List[List[int]], mode: str, folder: Optional[Path],
                  max_tokens: int, **kwargs) -> List[RequestRecord]:
    """Replay in mode ``cold``, ``disk`` or ``live`` over the store ``folder`` (empty at the start);
    ``kwargs`` go to the prompt cache's ``stream``."""
    from ..decode.generate import stream_generate
    from ..prompt_cache.pair import PairCache
    from ..prompt_cache.store import PrefixStore

    def new_cache(memory: int) -> PairCache:
        store = None if mode == "cold" else PrefixStore(folder, memory_entries=memory, warn=lambda m: None)
        return PairCache(pair.target, pair.tokenizer, pair.drafter, store=store, generate=stream_generate)

    live = new_cache(4) if mode == "live" else None
    out = []
    for i, ids in enumerate(prompts):
        pc = live or new_cache(0)
        stream = pc.stream(ids, max_tokens=max_tokens, **kwargs)
        ttft, total, text, last = _timed(stream, lambda r: r.text, time.perf_counter())
        out.append(RequestRecord(trace, i, mode, len(ids), pc.last_reused, len(ids) - pc.last_reused, ttft, total,
                                 last.stats.generation_tokens, last.stats.tau, text))
    return out


def replay_mlx_lm(pair: Any, trace: str, prompts: List[List[int]], max_tokens: int,
                  prefill_step_size: int = 2048) -> List[RequestRecord]:
    """Replay with mlx-lm's ``stream_generate`` and one prompt cache (the last prompt token is always fed)."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from ..prompt_cache.pair import common_prefix

    out: List[RequestRecord] = []
    with unfused(pair.model):  # mlx-lm's model as mlx-lm loads it
        cache, held = make_prompt_cache(pair.model), []
        for i, ids in enumerate(prompts):
            tic = time.perf_counter()
            keep = common_prefix(held, ids, len(ids) - 1)
            if keep < len(held) and not (can_trim_prompt_cache(cache) and trim_prompt_cache(cache, len(held) - keep)):
                cache, keep = make_prompt_cache(pair.model), 0
            fed: List[int] = []
            stream = stream_generate(pair.model, pair.tokenizer, mx.array(ids[keep:]), max_tokens=max_tokens,
                                     prompt_cache=cache, prefill_step_size=prefill_step_size)
            ttft, total, text, last = _timed(stream, lambda r: fed.append(r.token) or r.text, tic)
            held = (list(ids) + fed)[: cache[0].offset]  # what the cache holds (mlx-lm feeds ahead)
            gen = len(fed) - (last.finish_reason == "stop")
            out.append(RequestRecord(trace, i, "mlx-lm", len(ids), keep, len(ids) - keep, ttft, total, gen, 1.0, text))
    return out


def run_trace(pair: Any, trace: str, prompts: List[List[int]], modes: Sequence[str], max_tokens: int,
              progress: Callable[[str], None] = lambda _: None, **kwargs) -> List[RequestRecord]:
    """Every mode of ``modes`` over one trace, each in a new empty folder; ``same_as_cold`` set when cold ran."""
    records: List[RequestRecord] = []
    for mode in modes:
        progress(f"{trace}: {mode}")
        if mode == "mlx-lm":
            records += replay_mlx_lm(pair, trace, prompts, max_tokens, kwargs.get("prefill_step_size") or 2048)
            continue
        with tempfile.TemporaryDirectory(prefix="dflash-agent-") as folder:
            records += replay_dflash(pair, trace, prompts, mode, Path(folder), max_tokens, **kwargs)
    cold = {r.index: r.text for r in records if r.mode == "cold"}
    for r in records:
        if cold and r.mode != "mlx-lm":
            r.same_as_cold = r.text == cold[r.index]
    return records


def summarize(records: Sequence[RequestRecord]) -> List[Dict[str, Any]]:
    """One row per (trace, mode): tokens, time to first token, total time, ratios to cold, tau by prompt length."""
    rows = []
    for trace, mode in dict.fromkeys((r.trace, r.mode) for r in records):
        rs = [r for r in records if (r.trace, r.mode) == (trace, mode)]
        cold = [r for r in records if (r.trace, r.mode) == (trace, "cold")]
        row = {
            "trace": trace, "mode": mode, "requests": len(rs), "prompt_tokens": sum(r.prompt_tokens for r in rs),
            "reused": sum(r.reused for r in rs), "prefilled": sum(r.prefilled for r in rs),
            "ttft_median_ms": 1e3 * statistics.median(r.ttft_s for r in rs),
            "ttft_total_s": sum(r.ttft_s for r in rs), "total_s": sum(r.total_s for r in rs),
            "same_as_cold": all(r.same_as_cold for r in rs) if rs[0].same_as_cold is not None else None,
            "tau_by_prompt_tokens": {}}
        for lo, hi in zip((0,) + BUCKETS, BUCKETS + (None,)):
            taus = [r.tau for r in rs
                    if r.tau is not None and lo <= r.prompt_tokens and (hi is None or r.prompt_tokens < hi)]
            if taus:
                row["tau_by_prompt_tokens"][f"{lo}-{hi or ''}"] = round(statistics.mean(taus), 3)
        if cold:
            row["ttft_vs_cold"] = row["ttft_total_s"] / sum(r.ttft_s for r in cold)
            row["total_vs_cold"] = row["total_s"] / sum(r.total_s for r in cold)
        rows.append(row)
    return rows


def write_results(path: Path, records: Sequence[RequestRecord], rows: List[dict], command: List[str]) -> Path:
    """Write the command, the summary rows and every request's record; raises WriteError (any errno)."""
    write_json(path, {"command": command, "summary": rows, "requests": [asdict(r) for r in records]}, indent=1,
               parents=True)
    return path
