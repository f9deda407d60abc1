"""Training data (spec section 6): prompts (JSONL rows, cut plain text, or openings the target samples)
whose responses the target regenerates, stored as token ids in resumable ``.npz`` shards."""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm import batch_generate
from mlx_lm.sample_utils import make_sampler

from ..atomic import atomic_file, write_json
from ..errors import InputError
from ..prompt import encode_messages

MANIFEST = "manifest.json"


@dataclass
class TrainSequence:
    """Prompt + regenerated response: ``tokens`` [L] int32, ``response_start`` the first response index."""

    tokens: np.ndarray
    response_start: int


def frequent_tokens(sequences: Sequence[TrainSequence], size: int, vocab_size: int) -> mx.array:
    """The ``size`` tokens most frequent in the sequences' responses, ascending ids [K] int32 (ties: lower ids)."""
    counts = np.bincount(np.concatenate([s.tokens[s.response_start:] for s in sequences]), minlength=vocab_size)
    return mx.array(np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32))


def read_json(path: Path, remedy: str):
    """A JSON file this package wrote; InputError naming it and the ``remedy`` when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e}); {remedy}") from None


def read_utf8(path: Path) -> str:
    """A text file's contents; InputError naming the file, line and offset of bytes that are not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_prompt_file(path: str | Path) -> List[dict]:
    """``{"prompt"}`` or ``{"messages"}`` (the turns up to the last user turn) rows of a JSONL file. Raises InputError:
    missing or empty file, not UTF-8, a line not JSON, a row with neither key, or a message without ``role`` and
    ``content`` strings (names the file and line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompt file not found")
    rows = []
    for n, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            turns = row["messages"]
            for i, m in enumerate(turns):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise InputError(f"{path}:{n}: messages[{i}] must be an object with a 'role' string")
                if not isinstance(m.get("content"), str):
                    raise InputError(f"{path}:{n}: messages[{i}] has no 'content' string")
            last_user = max((i for i, m in enumerate(turns) if m.get("role") == "user"), default=-1)
            if last_user < 0:
                raise InputError(f"{path}:{n}: 'messages' has no user turn")
            rows.append({"messages": turns[: last_user + 1]})
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            rows.append({"prompt": row["prompt"]})
        else:
            raise InputError(f"{path}:{n}: expected a non-empty 'prompt' string or a 'messages' list")
    if not rows:
        raise InputError(f"{path}: the prompt file is empty")
    return rows


def prompts_from_text(path: str | Path, rng: np.random.Generator, per_document: int = 8,
                      min_words: int = 2, max_words: int = 24) -> List[dict]:
    """Random word-boundary prefixes of each document (split at blank lines or ``<|endoftext|>``) as prompt
    rows; InputError for a missing file, bytes that are not UTF-8, or no text."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: text file not found")
    docs = [d.strip() for d in re.split(r"<\|endoftext\|>|\n\s*\n", read_utf8(path)) if d.strip()]
    if not docs:
        raise InputError(f"{path}: the text file is empty")
    prompts = []
    for doc in docs:
        words = doc.split()
        for _ in range(per_document):
            n = int(rng.integers(min(min_words, len(words)), min(max_words, len(words)) + 1))
            prompts.append({"prompt": " ".join(words[:n])})
    return prompts


def encode_prompts(tokenizer, rows: Iterable[dict], template: Optional[dict] = None) -> List[List[int]]:
    """Token ids of each prompt row: the chat template (with ``template`` kwargs) if any, else text with BOS."""
    return [encode_messages(tokenizer, row.get("messages") or [{"role": "user", "content": row["prompt"]}], template)
            for row in rows]


def response_end_token(tokenizer, templated: bool) -> Optional[int]:
    """The EOS id a finished response ends with in the data: for ``templated`` prompts the first EOS id the
    chat template puts after an assistant message; else ``eos_token_id``, else the smallest EOS id, or None."""
    eos = set(tokenizer.eos_token_ids)
    if templated and tokenizer.has_chat_template:
        marker = "dflash-end-of-content"
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False)
        except Exception:  # a template that cannot render this pair: fall back to the EOS id
            text = ""
        if marker in text:
            after = tokenizer.encode(text.split(marker)[-1], add_special_tokens=False)
            ends = [t for t in after if t in eos]  # past a leading space piece, if any
            if ends:
                return int(ends[0])
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return int(eos_id) if eos_id is not None else min(eos) if eos else None


SELF_PROMPT_STYLES = ("prefix", "sentence", "chat")
_USER_MARKER = "dflash-user-turn"


def self_prompts(model, tokenizer, count: int, length: int, seed: int, temp: float = 1.0,
                 style: str = "prefix", max_words: int = 12, template: Optional[dict] = None) -> List[List[int]]:
    """Up to ``count`` prompts the target samples itself (``length`` tokens at ``temp``): ``prefix`` keeps BOS and the
    tokens sampled after it; ``sentence`` the first 3 to ``max_words`` words of a random later sentence; ``chat``
    samples a user's message where the chat template starts the user turn (it ends at the end-of-turn token) and returns
    it as a chat prompt (the template with ``template`` kwargs, ready for the assistant's reply). Raises InputError: a
    tokenizer without BOS (``prefix``/``sentence``) or without a chat template (``chat``), or another style."""
    if style not in SELF_PROMPT_STYLES:
        raise InputError(f"--self-prompt-style must be one of {', '.join(SELF_PROMPT_STYLES)}, got {style!r}")
    if style == "chat":
        if not tokenizer.has_chat_template:
            raise InputError("--self-prompt-style chat needs a tokenizer with a chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_MARKER}], tokenize=False,
                                             add_generation_prompt=False, **(template or {}))
        start = list(tokenizer.encode(text.split(_USER_MARKER)[0], add_special_tokens=False))
    else:
        if tokenizer.bos_token_id is None:
            raise InputError("--self-prompts needs a tokenizer with a BOS token")
        start = [tokenizer.bos_token_id]
    mx.random.seed(seed)
    result = batch_generate(model, tokenizer, [start] * count, max_tokens=length,
                            sampler=make_sampler(temp), return_token_ids=True)
    if style == "prefix":
        return [start + ids for ids in result.token_ids if ids]
    if style == "chat":
        users = [tokenizer.decode(ids).strip() for ids in result.token_ids]
        return [encode_messages(tokenizer, [{"role": "user", "content": u}], template)
                for u in users if len(u.split()) >= 3]
    rng = np.random.default_rng(seed)
    openings = []
    for ids in result.token_ids:
        sentences = [x.strip() for x in re.split(r"(?<=[.!?])\s+", tokenizer.decode(ids)) if len(x.split()) >= 3]
        if len(sentences) > 1:
            words = sentences[int(rng.integers(1, len(sentences)))].split()
            openings.append(tokenizer.encode(" ".join(words[: int(rng.integers(3, max_words + 1))])))
    return openings


def token_digest(sequences: Iterable[Sequence[int]], prefix: bytes = b"") -> str:
    """sha256 hex digest of ``prefix`` then each token sequence (int32 bytes, ``|`` after each)."""
    h = hashlib.sha256(prefix)
    for p in sequences:
        h.update(np.asarray(p, dtype=np.int32).tobytes() + b"|")
    return h.hexdigest()


def generate_batched(target, prompts: List[List[int]], budgets: List[int], stop_ids: Sequence[int],
                    batch_size: int, sampler=None, capture: Optional[List[int]] = None,
                    finished: Callable[[], None] = lambda: None) -> List[tuple]:
    """``(response tokens, features)`` per prompt: up to ``batch_size`` decode together in plain steps, one
    joining as another finishes (``finished()`` called then); ``sampler`` None is greedy; features
    [1, P + n - 1, K*H] of the ``capture`` layers over the prompt and the response but its last token (what
    the target computes anyway), or None."""
    from ..decode.batch import BatchDecoder
    from ..decode.stopping import StopCondition

    decoder = BatchDecoder(target, None, 1, capture=capture)
    out: List[list] = [[[], None] for _ in prompts]
    waiting = list(range(len(prompts)))

    def keep(key, result) -> None:
        if result.error is not None:
            raise result.error
        out[key][0] += result.tokens
        if result.finish_reason is not None:
            out[key][1] = result.features
            finished()

    while waiting or decoder.sequences:
        while waiting and len(decoder) < batch_size:
            i = waiting.pop(0)
            joining = decoder.start(i, prompts[i], sampler, StopCondition(budgets[i], stop_ids))
            while (result := joining.advance()) is None:
                pass
            keep(i, result)
        if decoder.sequences:
            active = [s.key for s in decoder.sequences]
            for key, result in zip(active, decoder.step()):
                keep(key, result)
    return [tuple(x) for x in out]


def regenerate(target, tokenizer, prompts: List[List[int]], out_dir: str | Path, *, max_tokens: int = 256,
               max_length: int = 3072, temp: float = 0.0, shard_size: int = 256, batch_size: int = 32, seed: int = 0,
               target_id: str = "", end_tokens: Optional[Sequence[Optional[int]]] = None,
               progress: Optional[Callable[[int, int], None]] = None,
               keep_features: Optional[Callable[[np.ndarray, object], None]] = None,
               capture: Optional[List[int]] = None) -> Path:
    """Responses the target (an adapter) generates for ``prompts`` (at ``temp``; at most ``max_tokens``, and
    ``max_length`` with the prompt) into ``out_dir``, ``shard_size`` prompts per shard; finished shards
    are kept on resume. ``end_tokens``: per prompt, the id appended to a finished response (default
    :func:`response_end_token`); ``progress(done, total)`` as each response and each shard is done; with ``capture`` (target layer
    ids), ``keep_features(sequence tokens, features)`` for every sequence of a shard before it is written.

    Raises:
        InputError: no prompts, a prompt of ``max_length`` tokens or more, or an ``out_dir`` made from
            other prompts or settings (nothing is overwritten).
    """
    if not prompts:
        raise InputError("no prompts to regenerate")
    too_long = [i for i, p in enumerate(prompts) if len(p) >= max_length]
    if too_long:
        raise InputError(f"{len(too_long)} prompt(s) have --max-length {max_length} tokens or more (first: prompt "
                         f"{too_long[0]}, {len(prompts[too_long[0]])} tokens); raise --max-length or shorten them")
    out = Path(out_dir)
    _claim(out, prompts, {"max_tokens": max_tokens, "max_length": max_length, "temp": temp, "seed": seed,
                          "shard_size": shard_size, "target": target_id})
    if end_tokens is None:
        end_tokens = [response_end_token(tokenizer, tokenizer.has_chat_template)] * len(prompts)
    sampler = make_sampler(temp) if temp > 0 else None
    for i, start in enumerate(range(0, len(prompts), shard_size)):
        path = out / f"shard_{i:05d}.npz"
        if not path.exists() or read_shard(path) is None:  # missing, or unreadable: made again
            mx.random.seed(seed + i)
            chunk = prompts[start:start + shard_size]
            budgets = [min(max_tokens, max_length - len(p)) for p in chunk]
            order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]))  # shortest first: similar lengths
            done = iter(range(start + 1, start + len(chunk) + 1))
            made = generate_batched(target, [chunk[j] for j in order], [budgets[j] for j in order],
                                   tokenizer.eos_token_ids, batch_size, sampler, capture,
                                   lambda: progress and progress(next(done), len(prompts)))
            generated = [result for _, result in sorted(zip(order, made), key=lambda x: x[0])]  # prompt order
            ends = end_tokens[start:start + shard_size]
            responses = [ids + ([end] if len(ids) < b and end is not None else [])  # stopped: ended its turn
                         for (ids, _), b, end in zip(generated, budgets, ends)]
            if keep_features is not None and capture:
                for p, r, (_, feats) in zip(chunk, responses, generated):
                    keep_features(np.asarray(p + r, dtype=np.int32), feats)
            _write_shard(path, chunk, responses)
        if progress:
            progress(min(start + shard_size, len(prompts)), len(prompts))
    return out


def _claim(out: Path, prompts: List[List[int]], settings: dict) -> None:
    """Create ``out`` with a manifest of these prompts and settings, or check the one it has (InputError)."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"version": 1, "num_prompts": len(prompts), "settings": settings,
                "fingerprint": token_digest(prompts, json.dumps(settings, sort_keys=True).encode())}
    manifest_file = out / MANIFEST
    if manifest_file.is_file():
        old = read_json(manifest_file, "delete the folder, or pass a new --out")
        if not isinstance(old, dict) or old.get("fingerprint") != manifest["fingerprint"]:
            was = old.get("settings", {}) if isinstance(old, dict) else {}
            differ = [f"{k} {was.get(k)!r} (now {v!r})" for k, v in settings.items() if was.get(k) != v]
            raise InputError(f"{out}: holds data from other {', '.join(differ) or 'prompts'}; pass a new --out")
    else:
        write_json(manifest_file, manifest, indent=2)


def _write_shard(path: Path, prompts: List[List[int]], responses: List[List[int]]) -> None:
    """One shard: int32 ``tokens`` (the sequences end to end), ``lengths`` and ``response_starts``, deflated
    (``np.savez_compressed``) so that data folders stay small enough to keep in a repository."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    with atomic_file(path) as tmp:
        np.savez_compressed(tmp, tokens=np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
                            lengths=np.array([len(s) for s in seqs], dtype=np.int32),
                            response_starts=np.array([len(p) for p in prompts], dtype=np.int32))


def load_sequences(data_dir: str | Path) -> List[TrainSequence]:
    """All sequences of a regenerated data folder, in order; InputError for a folder without a manifest
    or shards, or a truncated or corrupt shard (names it)."""
    data = Path(data_dir)
    if not (data / MANIFEST).is_file():
        raise InputError(f"{data}: not a training data folder (no {MANIFEST}); run `dflash data` first")
    shards = sorted(data.glob("shard_*[0-9].npz"))
    if not shards:
        raise InputError(f"{data}: no data shards yet; run `dflash data` first")
    seqs = []
    for shard in shards:
        if (z := read_shard(shard)) is None:
            raise InputError(f"{shard}: truncated or corrupt data shard; run the same `dflash data` command "
                             "again to make it anew")
        tokens, lengths, starts = z
        seqs += [TrainSequence(tokens[end - n:end], int(start))
                 for end, n, start in zip(np.cumsum(lengths), lengths, starts)]
    return seqs


def read_shard(path: Path) -> Optional[tuple]:
    """``(tokens, lengths, response_starts)`` of a shard, or None when it cannot be read whole."""
    try:
        with np.load(path) as z:
            tokens, lengths, starts = z["tokens"], z["lengths"], z["response_starts"]
    except Exception:  # zipfile, numpy and OS errors of every kind: the file is not a whole shard
        return None
    return (tokens, lengths, starts) if lengths.shape == starts.shape and int(lengths.sum()) == tokens.size else None


def pick_mask_token(tokenizer, vocab_size: int, sequences: List[TrainSequence]) -> int:
    """The MASK id: the last row past the tokenizer's pieces, else the highest non-special id the data
    never uses, else the least frequent non-special id."""
    size = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else vocab_size
    if size < vocab_size:
        return vocab_size - 1
    counts = np.bincount(np.concatenate([s.tokens for s in sequences]), minlength=vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(tokenizer.eos_token_ids)
    order = [i for i in np.argsort(counts, kind="stable")[::-1] if i not in special]
    unused = [i for i in range(vocab_size - 1, -1, -1) if counts[i] == 0 and i not in special]
    return int(unused[0]) if unused else int(order[-1])
