"""Prompt sets for ``dflash bench``: local files, their format detected from the first row's fields
(``FORMATS``), and the DFlash benchmark's Hugging Face sets, worded as in the authors' benchmark."""

import gzip
import importlib.util
import json
import os
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import InputError
from ..prompt import encode_messages

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


@dataclass
class Sample:
    """User ``turns`` asked in order after the chat ``messages``, or ``prompt_ids`` used as is."""

    id: str
    turns: List[str] = field(default_factory=list)
    messages: List[dict] = field(default_factory=list)
    prompt_ids: Optional[List[int]] = None


@dataclass(frozen=True)
class Format:
    """A row format: the fields that identify it, and its prompt turns."""

    name: str
    fields: tuple
    turns: Callable[[dict], List[str]]


def _turns(row: dict) -> List[str]:
    turns = row.get("turns", row.get("prompt"))
    return [str(t) for t in turns] if isinstance(turns, list) else [str(turns)]


def _alpaca(row: dict) -> List[str]:
    extra = str(row.get("input") or "").strip()
    return [str(row["instruction"]) + (f"\n\n{extra}" if extra else "")]


# The first format whose fields a row has wins: MBPP and HumanEval rows also have a 'prompt'.
FORMATS: List[Format] = [
    Format("gsm8k", ("question", "answer"), lambda row: [str(row["question"]) + MATH_SUFFIX]),
    Format("math500", ("problem", "solution"), lambda row: [str(row["problem"]) + MATH_SUFFIX]),
    Format("humaneval", ("task_id", "prompt", "entry_point"), lambda row: [HUMANEVAL_PREFIX + row["prompt"] + "\n```"]),
    Format("mbpp", ("prompt", "code", "test_list"), lambda row: [str(row["prompt"])]),
    Format("mt-bench", ("turns",), _turns), Format("alpaca", ("instruction", "output"), _alpaca),
    Format("messages", ("messages",), lambda row: []), Format("prompt", ("prompt",), _turns)]

SHIPPED, SHIPPED_ROWS = Path(__file__).parent / "sets", 80  # each set's first rows, read without the hub
# name -> (Hugging Face load_dataset args, split, row format, the same set's file in ../shared/datasets)
HF_DATASETS: Dict[str, tuple] = {
    "gsm8k": (("openai/gsm8k", "main"), "test", "gsm8k", "gsm8k_test.jsonl"),
    "math500": (("HuggingFaceH4/MATH-500",), "test", "math500", "math500_test.jsonl"),
    "humaneval": (("openai/openai_humaneval",), "test", "humaneval", "humaneval.jsonl.gz"),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", "mbpp", "mbpp_sanitized_test.jsonl"),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", "mt-bench", "mt_bench_questions.jsonl"),
    "alpaca": (("tatsu-lab/alpaca",), "train", "alpaca", None)}


def detect_format(row: dict, source: str = "row") -> Format:
    """The first of ``FORMATS`` whose fields ``row`` has; raises InputError listing them when none."""
    for fmt in FORMATS if isinstance(row, dict) else ():
        if all(k in row for k in fmt.fields):
            return fmt
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise InputError(f"{source}: unknown row format (fields {keys}); expected 'prompt' (a string), "
                     "'messages' (a chat), or the fields of gsm8k, math500, humaneval, mbpp, mt-bench or alpaca")


def to_sample(row: dict, index: int, fmt: Format, source: str = "row") -> Sample:
    """One row as a :class:`Sample`, a chat's final assistant turn dropped; InputError for an empty
    prompt or ``messages`` that are not role/content dicts with a user turn."""
    sid = str(row.get("task_id", row.get("question_id", row.get("id", index))))
    if fmt.name != "messages":
        turns = fmt.turns(row)
        if not turns or not all(t.strip() for t in turns):
            raise InputError(f"{source}: empty prompt")
        return Sample(sid, turns=turns)
    messages = row["messages"]
    if not (isinstance(messages, list) and messages and
            all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise InputError(f"{source}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise InputError(f"{source}: 'messages' holds no user turn")
    return Sample(sid, messages=[dict(m) for m in messages])


def read_rows(path: str | Path, flag: str = "--dataset") -> List[Any]:
    """The rows of a JSON document (a list: its items) or of JSON lines, gunzipped if ``.gz``;
    InputError ``{flag} {path}: ...`` when unreadable or a line is not JSON."""
    path = Path(path).expanduser()
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    with suppress(json.JSONDecodeError):
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rows += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as e:
            raise InputError(f"{flag} {path}:{n}: not JSON ({e.msg})") from None
    return rows


def load_file(path: str | Path, num_samples: Optional[int] = None) -> tuple[str, List[Sample]]:
    """``(format name, samples)`` of a file's first ``num_samples`` rows; InputError for bad ones."""
    path = Path(path).expanduser()
    rows = read_rows(path)
    if not rows:
        raise InputError(f"{path}: the dataset file has no rows")
    fmt = detect_format(rows[0], f"{path}:1")
    return fmt.name, [to_sample(r, i, fmt, f"{path}: row {i + 1}") for i, r in enumerate(rows[:num_samples])]


def load_hub(name: str, num_samples: Optional[int] = None) -> List[Sample]:
    """A built-in set from the Hugging Face hub through ``datasets``; InputError (saying how to pass a
    file) when offline, without ``datasets`` or when the download fails."""
    args, split, fmt_name, local = HF_DATASETS[name]
    instead = (f"Pass a local file instead: --dataset PATH (e.g. --dataset {local or 'prompts.jsonl'}); a JSONL in "
               f"the {name} format, or rows of 'prompt' or 'messages', is detected by its fields.")
    flags = (os.environ.get(v, "0").lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if any(f in ("1", "true", "yes", "on") for f in flags):
        raise InputError(f"--dataset {name}: {args[0]} on the Hugging Face hub cannot be downloaded: offline "
                         f"(HF_HUB_OFFLINE is set). {instead}")
    if importlib.util.find_spec("datasets") is None:
        raise InputError(f"--dataset {name}: {args[0]} loads from the Hugging Face hub with the 'datasets' "
                         f"package, which is not installed (pip install datasets, or the [bench] extra). {instead}")
    from datasets import load_dataset as hf_load_dataset

    try:
        rows = hf_load_dataset(*args, split=split)
    except Exception as e:
        raise InputError(f"--dataset {name}: {args[0]} could not be loaded from the Hugging Face hub "
                         f"({type(e).__name__}). {instead}") from None
    fmt = next(f for f in FORMATS if f.name == fmt_name)
    n = len(rows) if num_samples is None else min(num_samples, len(rows))
    return [to_sample(dict(rows[i]), i, fmt, f"{args[0]}: row {i + 1}") for i in range(n)]


def load_dataset(spec: str, num_samples: Optional[int] = None) -> tuple[str, List[Sample]]:
    """``--dataset``: ``(name, first num_samples samples)`` of a file (named by its benchmark format or
    its stem), else of a name in ``HF_DATASETS`` (up to :data:`SHIPPED_ROWS` from the rows shipped in
    ``sets/``, more from the hub); InputError for anything else or ``num_samples`` < 1."""
    if num_samples is not None and num_samples < 1:
        raise InputError(f"--num-samples must be at least 1, got {num_samples}")
    path = Path(spec).expanduser()
    if path.is_file():
        fmt, samples = load_file(path, num_samples)
        stem = path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
        return (fmt if fmt in HF_DATASETS else stem), samples
    shipped = SHIPPED / f"{spec}.jsonl.gz"
    if spec in HF_DATASETS and num_samples is not None and num_samples <= SHIPPED_ROWS and shipped.is_file():
        return spec, load_file(shipped, num_samples)[1]
    if spec in HF_DATASETS:
        return spec, load_hub(spec, num_samples)
    raise InputError(f"--dataset {spec}: neither a file nor a known name ({', '.join(HF_DATASETS)}); "
                     "pass a .jsonl file of 'prompt' or 'messages' rows")


def encode_sample_turn(tokenizer, messages: Sequence[dict], enable_thinking: bool = False) -> List[int]:
    """Token ids of a chat ending with a user turn, through the chat template (``enable_thinking``
    passed) when there is one; else the contents joined by newlines, with BOS."""
    return encode_messages(tokenizer, messages, {"enable_thinking": enable_thinking})
