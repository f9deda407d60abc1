"""Agent traces: replay requests whose prompts share growing prefixes (issue 22).

A trace is a JSONL file, one request per line: ``{"prompt": "..."}`` (raw text, no
chat template) or ``{"messages": [...]}``. Each is generated greedily in turn, in one
of these modes:

- ``cold``: every request prefilled whole (a new process with no prompt cache);
- ``disk``: every request in a new :class:`~dflash_mlx.prompt_cache.pair.PairCache` over a
  new :class:`~dflash_mlx.prompt_cache.store.PrefixStore` with no memory level, on one folder:
  what a new process finds on disk from the requests before it (the model stays loaded,
  so process start and model load, the same for every mode, are not in the times);
- ``live``: one PairCache and store for the whole trace, as ``dflash serve`` keeps them;
- ``mlx-lm``: mlx-lm's own decoding and prompt cache (``make_prompt_cache``, trimmed to
  the common prefix of the next prompt, as ``mlx_lm.server`` reuses it), no drafter.

Per request: prompt tokens, tokens reused and prefilled, time to first token (wall,
from the call to the first token, restore included), total time, tau, and whether the
text equals the cold run's.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..atomic import atomic_file
from ..errors import InputError
from ..targets.fused import unfused

MODES = ("cold", "disk", "live", "mlx-lm")
BUCKETS = (1024, 2048, 4096, 8192, 16384)  # prompt-length buckets for tau against context


@dataclass
class RequestRecord:
    """One replayed request. Times in seconds."""

    trace: str
    index: int
    mode: str
    prompt_tokens: int
    reused: int
    prefilled: int
    ttft_s: float
    total_s: float
    generated: int
    tau: Optional[float]  # None: no verify step ran
    text: str
    same_as_cold: Optional[bool] = None


def read_agent_trace(path: str | Path) -> List[Any]:
    """The requests of a trace file: prompt strings or message lists.

    Raises:
        InputError: unreadable file, or a line that is not a request (names file and line).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"--agent-trace {path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise InputError(f"--agent-trace {path}:{n}: not JSON") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            out.append(row["messages"])
        else:
            raise InputError(f"--agent-trace {path}:{n}: needs a \"prompt\" string or a \"messages\" list")
    if not out:
        raise InputError(f"--agent-trace {path}: no requests")
    return out


def encode_requests(tokenizer: Any, requests: Sequence[Any]) -> List[List[int]]:
    """Token ids of each request: raw prompts as text, message lists through the chat template."""
    from ..prompt import encode_messages

    out = []
    for r in requests:
        if isinstance(r, str):
            out.append(list(tokenizer.encode(r)))
        else:
            out.append(list(encode_messages(tokenizer, r, {}, True, lambda ms: "\n".join(m["content"] for m in ms))))
    return out


def _dflash_request(pc: Any, ids: List[int], max_tokens: int, **kwargs) -> tuple:
    tic = time.perf_counter()
    ttft, text, stats = None, [], None
    for r in pc.stream(ids, max_tokens=max_tokens, **kwargs):
        if ttft is None:
            ttft = time.perf_counter() - tic
        text.append(r.text)
        stats = r.stats
    return ttft, time.perf_counter() - tic, "".join(text), stats


def replay_dflash(pair: Any, trace: str, prompts: List[List[int]], mode: str, folder: Optional[Path],
                  max_tokens: int, **kwargs) -> List[RequestRecord]:
    """Replay ``prompts`` in mode ``cold``, ``disk`` or ``live`` (see the module's docstring).

    Args:
        folder: the prompt cache's folder (``disk``, ``live``); must start empty for a fair run.
        kwargs: passed to :meth:`PairCache.stream` (block_size, prefill_step_size, ...).
    """
    from ..prompt_cache.pair import PairCache
    from ..prompt_cache.store import PrefixStore

    def new_cache(memory: int) -> PairCache:
        store = None if mode == "cold" else PrefixStore(folder, memory_entries=memory, warn=lambda m: None)
        return PairCache(pair.target, pair.tokenizer, pair.drafter, store=store)

    live = new_cache(4) if mode == "live" else None
    out = []
    for i, ids in enumerate(prompts):
        pc = live if live is not None else new_cache(0)
        ttft, total, text, stats = _dflash_request(pc, ids, max_tokens, **kwargs)
        out.append(RequestRecord(trace, i, mode, len(ids), pc.last_reused, len(ids) - pc.last_reused, ttft, total,
                                 stats.generation_tokens, stats.tau, text))
    return out


def replay_mlx_lm(pair: Any, trace: str, prompts: List[List[int]], max_tokens: int,
                  prefill_step_size: int = 2048) -> List[RequestRecord]:
    """Replay with mlx-lm's ``stream_generate`` and one prompt cache trimmed to each next
    prompt's common prefix with what it holds (at least the last prompt token is fed)."""
    with unfused(pair.model):  # mlx-lm's model as mlx-lm loads it
        return _replay_mlx_lm(pair, trace, prompts, max_tokens, prefill_step_size)


def _replay_mlx_lm(pair, trace, prompts, max_tokens, prefill_step_size):
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from ..prompt_cache.pair import common_prefix

    cache, held, out = make_prompt_cache(pair.model), [], []
    for i, ids in enumerate(prompts):
        tic = time.perf_counter()
        keep = common_prefix(held, ids, len(ids) - 1)
        if keep < len(held) and not (can_trim_prompt_cache(cache) and trim_prompt_cache(cache, len(held) - keep)):
            cache, keep = make_prompt_cache(pair.model), 0
        ttft, text, fed = None, [], []
        for r in stream_generate(pair.model, pair.tokenizer, mx.array(ids[keep:]), max_tokens=max_tokens,
                                 prompt_cache=cache, prefill_step_size=prefill_step_size):
            if ttft is None:
                ttft = time.perf_counter() - tic
            text.append(r.text)
            fed.append(r.token)
        held = (list(ids) + fed)[: cache[0].offset]  # what the cache holds (mlx-lm feeds ahead)
        gen = len(fed) - (r.finish_reason == "stop")
        out.append(RequestRecord(trace, i, "mlx-lm", len(ids), keep, len(ids) - keep, ttft,
                                 time.perf_counter() - tic, gen, 1.0, "".join(text)))
    return out


def run_trace(pair: Any, trace: str, prompts: List[List[int]], modes: Sequence[str], max_tokens: int,
              progress: Callable[[str], None] = lambda _: None, **kwargs) -> List[RequestRecord]:
    """Every mode of ``modes`` over one trace (each ``disk``/``live`` run in a new empty
    folder); records carry ``same_as_cold`` when ``cold`` ran first."""
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
    """One row per (trace, mode): tokens reused and prefilled, median and total time to
    first token, total time, its ratios to the cold run, tau by prompt-length bucket."""
    rows = []
    keys = list(dict.fromkeys((r.trace, r.mode) for r in records))
    for trace, mode in keys:
        rs = [r for r in records if (r.trace, r.mode) == (trace, mode)]
        cold = [r for r in records if (r.trace, r.mode) == (trace, "cold")]
        row = {
            "trace": trace, "mode": mode, "requests": len(rs),
            "prompt_tokens": sum(r.prompt_tokens for r in rs), "reused": sum(r.reused for r in rs),
            "prefilled": sum(r.prefilled for r in rs),
            "ttft_median_ms": 1e3 * statistics.median(r.ttft_s for r in rs),
            "ttft_total_s": sum(r.ttft_s for r in rs), "total_s": sum(r.total_s for r in rs),
            "same_as_cold": all(r.same_as_cold for r in rs) if rs[0].same_as_cold is not None else None,
            "tau_by_prompt_tokens": _tau_buckets(rs),
        }
        if cold:
            row["ttft_vs_cold"] = row["ttft_total_s"] / sum(r.ttft_s for r in cold)
            row["total_vs_cold"] = row["total_s"] / sum(r.total_s for r in cold)
        rows.append(row)
    return rows


def _tau_buckets(rs: Sequence[RequestRecord]) -> Dict[str, float]:
    out = {}
    lo = 0
    for hi in BUCKETS + (None,):
        sel = [r.tau for r in rs
               if r.tau is not None and r.prompt_tokens >= lo and (hi is None or r.prompt_tokens < hi)]
        if sel:
            out[f"{lo}-{hi or ''}"] = round(statistics.mean(sel), 3)
        lo = hi or lo
    return out


def write_results(path: Path, records: Sequence[RequestRecord], rows: List[dict], command: List[str]) -> Path:
    """``results.json``: the command, the summary rows and every request's record.

    Raises:
        WriteError: the folder or the file cannot be written (any errno).
    """
    with atomic_file(path, parents=True) as tmp:
        tmp.write_text(json.dumps({"command": command, "summary": rows,
                                   "requests": [asdict(r) for r in records]}, indent=1) + "\n")
    return path
