"""``dflash generate``: one prompt in, text on stdout, stats on stderr."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from .common import (
    check_sampling, encode_prompt, guard, load_pair, parse_template_config, read_prompt, resolve_models,
    block_size_option, draft_model_option, min_p_option, model_option, seed_option, system_prompt_option, temp_option,
    top_k_option, top_p_option,
)
from .common import verify_option


def generate(
    model: Optional[str] = model_option(),
    draft_model: Optional[str] = draft_model_option(),
    verify: bool = verify_option(),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", "-p", help="Prompt text; '-' reads stdin. Piped stdin is read when omitted."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", help="Most tokens to generate."),
    temp: float = temp_option(),
    top_p: float = top_p_option(),
    top_k: int = top_k_option(),
    min_p: float = min_p_option(),
    seed: Optional[int] = seed_option(),
    block_size: Optional[int] = block_size_option(),
    system_prompt: Optional[str] = system_prompt_option(),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config",
        help="JSON for apply_chat_template, e.g. '{\"enable_thinking\": true}'. "
        "With a drafter, thinking is off unless set here: released drafters were trained without it.",
    ),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Use the raw prompt."),
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print stats on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text and stats) instead of the text."),
) -> None:
    """Generate from one prompt. Text streams to stdout, stats go to stderr.

    \b
    Examples:
      dflash generate --prompt "Explain KV caches in two sentences."
      echo "Once upon a time" | dflash generate --model ./stories260K
      dflash generate --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16 -p - < q.txt
    """
    args = dict(locals())
    guard(lambda: _run(**args))


def _run(model, draft_model, verify, prompt, max_tokens, temp, top_p, top_k, min_p, seed, block_size,
         system_prompt, chat_template_config, ignore_chat_template, verbose, as_json) -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from dflash_mlx import InputError, stream_generate

    check_sampling(temp, top_p, top_k, min_p, max_tokens)
    text = read_prompt(prompt)
    template = parse_template_config(chat_template_config)
    defaults = model is None and draft_model is None
    model, draft_model = resolve_models(model, draft_model, verify)
    if block_size is not None and draft_model is None:
        raise InputError("--block-size needs --draft-model (plain decoding has no blocks)")
    if draft_model is not None:
        template.setdefault("enable_thinking", False)
    if seed is not None:
        mx.random.seed(seed)

    pair = load_pair(model, draft_model, defaults)
    ids = encode_prompt(pair.tokenizer, text, system_prompt, template, ignore_chat_template)
    sampler = make_sampler(temp, top_p, min_p, 1, top_k=top_k)

    out, stats = [], None
    for response in stream_generate(pair.target, pair.tokenizer, ids, pair.drafter,
                                    sampler=sampler, max_tokens=max_tokens, block_size=block_size):
        out.append(response.text)
        stats = response.stats
        if not as_json:
            sys.stdout.write(response.text)
            sys.stdout.flush()
    if as_json:
        print(json.dumps({"text": "".join(out), **stats.to_dict()}))
    else:
        print()
    if verbose:
        for line in stats.format_lines():
            print(line, file=sys.stderr)
