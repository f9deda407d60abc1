"""Prompt sets for ``dflash bench``: built-in names, local files, user JSONL.

A dataset comes from one of three places:

- a local file (``.jsonl``, ``.jsonl.gz`` or ``.json``) whose format is detected
  from the fields of its rows: GSM8K (``question``, ``answer``), MATH-500
  (``problem``, ``solution``), HumanEval (``task_id``, ``prompt``, ``entry_point``),
  MBPP (``prompt``, ``code``, ``test_list``), MT-Bench (``turns``), Alpaca
  (``instruction``, ``input``, ``output``), or a user's own rows of ``prompt``
  (a string) or ``messages`` (a chat, a list of ``{"role", "content"}``);
- a built-in name (``gsm8k``, ``math500``, ``humaneval``, ``mbpp``, ``mt-bench``,
  ``alpaca``): the Hugging Face dataset the DFlash benchmark uses, loaded with the
  ``datasets`` package when online.

Prompts are worded as in the authors' benchmark (``dflash/benchmark.py``): math
asks for step-by-step reasoning and a boxed answer, HumanEval wraps the stub in a
code fence.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import InputError
from ..prompt import encode_messages

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


@dataclass
class Sample:
    """One benchmark item.

    Attributes:
        id: a stable name for the item (row index or the dataset's own id).
        turns: user turns asked one after the other (MT-Bench has two); each turn
            sees the previous turns and DFlash's answers to them.
        messages: a whole chat (user JSONL ``messages``), sent as is before ``turns``.
        prompt_ids: already tokenized prompt (random-weight targets without a
            tokenizer); used as is, no chat template.
    """

    id: str
    turns: List[str] = field(default_factory=list)
    messages: List[dict] = field(default_factory=list)
    prompt_ids: Optional[List[int]] = None


@dataclass(frozen=True)
class Format:
    """A known row format: the fields that identify it and how to word a prompt."""

    name: str
    fields: tuple
    turns: Callable[[dict], List[str]]


def _math(key: str) -> Callable[[dict], List[str]]:
    return lambda row: [str(row[key]) + MATH_SUFFIX]


def _alpaca(row: dict) -> List[str]:
    extra = str(row.get("input") or "").strip()
    return [str(row["instruction"]) + (f"\n\n{extra}" if extra else "")]


def _turns(row: dict) -> List[str]:
    turns = row.get("turns", row.get("prompt"))
    return [str(t) for t in turns] if isinstance(turns, list) else [str(turns)]


# Order matters: the first format whose fields a row has wins (MBPP and HumanEval
# rows also have a 'prompt', so they come before the plain user format).
FORMATS: List[Format] = [
    Format("gsm8k", ("question", "answer"), _math("question")),
    Format("math500", ("problem", "solution"), _math("problem")),
    Format("humaneval", ("task_id", "prompt", "entry_point"),
           lambda row: [HUMANEVAL_PREFIX + row["prompt"] + "\n```"]),
    Format("mbpp", ("prompt", "code", "test_list"), lambda row: [str(row["prompt"])]),
    Format("mt-bench", ("turns",), _turns),
    Format("alpaca", ("instruction", "output"), _alpaca),
    Format("messages", ("messages",), lambda row: []),
    Format("prompt", ("prompt",), _turns),
]

# name -> (Hugging Face load_dataset args, split, the row format, the file of the
# same set in ../shared/datasets, named in offline errors)
HF_DATASETS: Dict[str, tuple] = {
    "gsm8k": (("openai/gsm8k", "main"), "test", "gsm8k", "gsm8k_test.jsonl"),
    "math500": (("HuggingFaceH4/MATH-500",), "test", "math500", "math500_test.jsonl"),
    "humaneval": (("openai/openai_humaneval",), "test", "humaneval", "humaneval.jsonl.gz"),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", "mbpp", "mbpp_sanitized_test.jsonl"),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", "mt-bench", "mt_bench_questions.jsonl"),
    "alpaca": (("tatsu-lab/alpaca",), "train", "alpaca", None),
}


def detect_format(row: dict, source: str = "row") -> Format:
    """The first known format whose identifying fields ``row`` has.

    Raises:
        InputError: no format matches; the message lists the accepted fields.
    """
    if isinstance(row, dict):
        for fmt in FORMATS:
            if all(k in row for k in fmt.fields):
                return fmt
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise InputError(
        f"{source}: unknown row format (fields {keys}); expected 'prompt' (a string), "
        "'messages' (a chat), or the fields of gsm8k, math500, humaneval, mbpp, mt-bench or alpaca"
    )


def to_sample(row: dict, index: int, fmt: Format, source: str = "row") -> Sample:
    """Turn one row into a :class:`Sample` (checks ``messages`` rows).

    Raises:
        InputError: a ``messages`` row that is not a list of role/content dicts, or
            an empty prompt.
    """
    sid = str(row.get("task_id", row.get("question_id", row.get("id", index))))
    if fmt.name == "messages":
        messages = row["messages"]
        if not (isinstance(messages, list) and messages and
                all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
            raise InputError(f"{source}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # benchmark the assistant's reply, not a given one
        if not messages:
            raise InputError(f"{source}: 'messages' holds no user turn")
        return Sample(sid, messages=[dict(m) for m in messages])
    turns = fmt.turns(row)
    if not turns or not all(t.strip() for t in turns):
        raise InputError(f"{source}: empty prompt")
    return Sample(sid, turns=turns)


def read_rows(path: Path) -> List[dict]:
    """Rows of a ``.jsonl``, ``.jsonl.gz`` or ``.json`` (a list) file.

    Raises:
        InputError: missing file or invalid JSON (names the file and line).
    """
    if not path.is_file():
        raise InputError(f"{path}: dataset file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if path.name.endswith(".json"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(rows, list):
            raise InputError(f"{path}: a .json dataset must be a list of rows")
        return rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: invalid JSON line ({e})") from None
    return rows


def load_file(path: str | Path, num_samples: Optional[int] = None) -> tuple[str, List[Sample]]:
    """Load a local prompt file, its format detected from the first row's fields.

    Args:
        path: ``.jsonl``, ``.jsonl.gz`` or ``.json`` file.
        num_samples: keep the first N rows (all by default).

    Returns:
        ``(format name, samples)``.

    Raises:
        InputError: missing or empty file, unknown format, bad rows.
    """
    path = Path(path).expanduser()
    rows = read_rows(path)
    if not rows:
        raise InputError(f"{path}: the dataset file has no rows")
    fmt = detect_format(rows[0], f"{path}:1")
    rows = rows if num_samples is None else rows[:num_samples]
    return fmt.name, [to_sample(r, i, fmt, f"{path}: row {i + 1}") for i, r in enumerate(rows)]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on") or \
        os.environ.get("HF_DATASETS_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _how_to_pass_a_file(name: str) -> str:
    local = HF_DATASETS[name][3]
    example = local or "prompts.jsonl"
    return (f"Pass a local file instead: --dataset PATH (e.g. --dataset {example}); a JSONL in the "
            f"{name} format, or rows of 'prompt' or 'messages', is detected by its fields.")


def load_hub(name: str, num_samples: Optional[int] = None) -> List[Sample]:
    """Load a built-in dataset from the Hugging Face hub (needs ``datasets``, online).

    Raises:
        InputError: offline, ``datasets`` missing or the download failed; the
            message says how to pass a local file.
    """
    args, split, fmt_name, _ = HF_DATASETS[name]
    repo = args[0]
    if _offline():
        raise InputError(
            f"--dataset {name}: {repo} on the Hugging Face hub cannot be downloaded: offline "
            f"(HF_HUB_OFFLINE is set). {_how_to_pass_a_file(name)}"
        )
    if importlib.util.find_spec("datasets") is None:
        raise InputError(
            f"--dataset {name}: {repo} loads from the Hugging Face hub with the 'datasets' "
            f"package, which is not installed (pip install datasets). {_how_to_pass_a_file(name)}"
        )
    from datasets import load_dataset as hf_load_dataset

    try:
        rows = hf_load_dataset(*args, split=split)
    except Exception as e:
        raise InputError(
            f"--dataset {name}: {repo} could not be loaded from the Hugging Face hub "
            f"({type(e).__name__}). {_how_to_pass_a_file(name)}"
        ) from None
    fmt = next(f for f in FORMATS if f.name == fmt_name)
    n = len(rows) if num_samples is None else min(num_samples, len(rows))
    return [to_sample(dict(rows[i]), i, fmt, f"{repo}: row {i + 1}") for i in range(n)]


def load_dataset(spec: str, num_samples: Optional[int] = None) -> tuple[str, List[Sample]]:
    """Resolve ``--dataset``: an existing file path, else a built-in name.

    Args:
        spec: a path, or one of ``gsm8k, math500, humaneval, mbpp, mt-bench, alpaca``.
        num_samples: keep the first N samples (all by default).

    Returns:
        ``(display name, samples)``: the built-in name, or for a file the detected
        benchmark format (``gsm8k``, ...) or else the file's stem.

    Raises:
        InputError: unknown name or missing file, unreadable file, offline.
    """
    if num_samples is not None and num_samples < 1:
        raise InputError(f"--num-samples must be at least 1, got {num_samples}")
    path = Path(spec).expanduser()
    if path.is_file():
        fmt, samples = load_file(path, num_samples)
        return (fmt if fmt in HF_DATASETS else dataset_name(path)), samples
    if spec in HF_DATASETS:
        return spec, load_hub(spec, num_samples)
    raise InputError(
        f"--dataset {spec}: neither a file nor a known name "
        f"({', '.join(HF_DATASETS)}); pass a .jsonl file of 'prompt' or 'messages' rows"
    )


def dataset_name(path: Path) -> str:
    """A short name for a file: its name without ``.jsonl``/``.json``/``.gz``."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def encode_sample_turn(tokenizer, messages: Sequence[dict], enable_thinking: bool = False,
                       template: Optional[dict] = None) -> List[int]:
    """Token ids for a chat, with the target's chat template when it has one.

    Args:
        tokenizer: mlx-lm ``TokenizerWrapper``.
        messages: the chat so far, ending with a user turn.
        enable_thinking: passed to the template (Qwen3 thinking mode; off by default,
            as the released drafters were trained without it).
        template: extra ``apply_chat_template`` keyword arguments.

    Without a chat template (base models such as stories260K) the user turns are
    joined with newlines and encoded with the tokenizer's special tokens (BOS).
    """
    return encode_messages(tokenizer, messages, {"enable_thinking": enable_thinking, **(template or {})})
