"""``dflash generate --compare``: the same prompt, target and sampling decoded again without a drafter."""

from typing import Any, List, Optional

import mlx.core as mx

from .decode.generate import generate, generate_step
from .decode.width import AUTO, chain_widths
from .stats import GenerationStats

WARM_UP_PROMPT = 32  # the prompt's last tokens a warm-up decodes from (decode kernels do not depend on its length)
WARM_UP_STEPS = 3  # steps of each warm-up run


def warm_up(target: Any, drafter: Optional[Any], prompt: List[int], block_size, sampler) -> None:
    """Build the kernels both halves of ``--compare`` decode with before either is timed (MLX compiles a
    kernel on its first use; on a CPU that takes seconds and fell on the first half alone): a few plain
    steps, and a few at each chain width ``block_size`` may verify (every one of ``--block-size auto``'s),
    from the prompt's last :data:`WARM_UP_PROMPT` tokens. Nothing is kept, written or counted."""
    widths = [1]
    if drafter is not None:
        widths += chain_widths(drafter.block_size) if block_size in (None, AUTO) else [int(block_size)]
    tail = mx.array(prompt[-WARM_UP_PROMPT:], dtype=mx.int32)
    for w in widths:
        for _ in generate_step(tail, target, drafter if w > 1 else None, sampler=sampler,
                               max_tokens=WARM_UP_STEPS * w, block_size=w if w > 1 else None):
            pass


def compare_with_plain(target: Any, tokenizer: Any, prompt: List[int], text: str, stats: GenerationStats, *,
                       seed: Optional[int] = None, **kwargs) -> dict:
    """Decode ``prompt`` (all its token ids, no prompt cache) plainly (no drafter, no prompt lookup), from
    ``seed`` if given, with the DFlash run's other ``kwargs`` (sampler, max_tokens, stop_strings, ...).

    Returns:
        ``{"plain_generation_tokens", "plain_generation_tps" (tokens/s; None without a decoding time),
        "speedup" (DFlash's tokens/s over plain's; None when either is missing), "same_output",
        "plain_text" (only when the texts differ)}``.
    """
    if seed is not None:
        mx.random.seed(seed)
    plain_text, plain = generate(target, tokenizer, prompt, None, **{**kwargs, "prompt_lookup": False})
    plain_tps = plain.generation_tps if plain.generation_s else None
    ours = stats.generation_tps if stats.generation_s else None
    out = {"plain_generation_tokens": plain.generation_tokens,
           "plain_generation_tps": None if plain_tps is None else round(plain_tps, 3),
           "speedup": round(ours / plain_tps, 4) if ours and plain_tps else None, "same_output": plain_text == text}
    if plain_text != text:
        out["plain_text"] = plain_text
    return out


def compare_line(compare: dict, greedy: bool) -> str:
    """``Compare: plain decoding 412.3 tokens-per-sec; DFlash 2.31x, same output (both timed after a warm-up
    ...)``; a differing greedy text is flagged as a bug."""
    tps = compare["plain_generation_tps"]
    plain = "plain decoding " + (f"{tps:.1f} tokens-per-sec" if tps is not None else "(no decoding time)")
    speed = f"DFlash {compare['speedup']:.2f}x" if compare["speedup"] is not None else "no speedup measured"
    if compare["same_output"]:
        same = "same output"
    elif greedy:
        same = "the output DIFFERS from plain greedy decoding: a bug, please report it"
    else:
        same = "different output (sampled: expected)"
    return f"Compare: {plain}; {speed}, {same} (both timed after a warm-up that built their kernels)"
