"""``dflash generate``: one prompt in, text on stdout, stats on stderr."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from .common import (
    check_sampling, check_system_prompt, encode_prompt, guard, load_pair, parse_stops, parse_template_config,
    read_prompt, resolve_models, resolve_prefill_step, warn,
    block_size_option, draft_model_option, min_p_option, model_option, prefill_step_option, seed_option,
    stop_option, system_prompt_option, temp_option, top_k_option, top_p_option, draft_window_option,
    tree_budget_option,
    parse_draft_window,
)
from .common import recalibrate_option, sharding_option, verify_option
from .prompt_cache import make_store, no_prompt_cache_option, prompt_cache_dir_option, prompt_cache_gb_option


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
    block_size: str = block_size_option(),
    recalibrate: bool = recalibrate_option(),
    tree_budget: Optional[str] = tree_budget_option(),
    draft_window: Optional[str] = draft_window_option(),
    system_prompt: Optional[str] = system_prompt_option(),
    stop: List[str] = stop_option(),
    chat_template_config: Optional[str] = typer.Option(
        None, "--chat-template-config",
        help="JSON for apply_chat_template, e.g. '{\"enable_thinking\": true}'. "
        "With a drafter, thinking is off unless set here: released drafters were trained without it.",
    ),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Use the raw prompt."),
    prefill_step_size: Optional[int] = prefill_step_option(),
    prompt_cache_dir: Optional[str] = prompt_cache_dir_option(),
    no_prompt_cache: bool = no_prompt_cache_option(),
    prompt_cache_gb: float = prompt_cache_gb_option(),
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print stats on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text and stats) instead of the text."),
    compare: bool = typer.Option(
        False, "--compare", help="Then decode the prompt plainly (same target and sampling) and print the speedup "
        "and whether the text is the same. Needs --draft-model."),
    sharding: str = sharding_option(),
) -> None:
    """Generate from one prompt. Text streams to stdout, stats go to stderr.

    A prompt longer than the target's context is refused; the reply stops at the
    context's end. The caches of the prompt are kept on disk (--prompt-cache-dir), so a
    later prompt sharing its beginning prefills only the rest. Exit codes: 0 done, 1 bad input, 130 Ctrl-C, 141 output pipe closed.

    \b
    Examples:
      dflash generate --prompt "Explain KV caches in two sentences."
      echo "Once upon a time" | dflash generate --model ./stories260K
      dflash generate --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16 -p - < q.txt
      dflash generate -p "List three colours, one per line." --stop "\\n\\n"
      dflash generate --draft-window 64,1024 -p - < long_document.txt
      dflash generate --model M --draft-model D --tree-budget 32 -p "Once upon a time"
      dflash generate --model M --draft-model D --compare -p "Once upon a time"
      mlx.launch --backend ring -n 2 dflash generate --model M --draft-model D -p "Once upon a time"
    """
    args = dict(locals())
    guard(lambda: _run(**args))


# Over 60 lines: load, sample, stream and render one generation; split after the hardening work lands
def _run(model, draft_model, verify, prompt, max_tokens, temp, top_p, top_k, min_p, seed, block_size, recalibrate,
         tree_budget,
         draft_window,
         system_prompt, stop, chat_template_config, ignore_chat_template, prefill_step_size,
         prompt_cache_dir, no_prompt_cache, prompt_cache_gb, verbose, as_json, compare, sharding) -> None:
    import mlx.core as mx

    from dflash_mlx.errors import InputError
    from dflash_mlx.pair.sharded import join_ranks, share_text

    # Flags first, then the imports of mlx-lm and transformers (2-3 s): a bad flag is
    # reported at once.
    check_sampling(temp, top_p, top_k, min_p, max_tokens)
    stops = parse_stops(stop)
    window = parse_draft_window(draft_window)
    distributed = join_ranks(sharding)
    text = share_text(lambda: read_prompt(prompt))
    template = parse_template_config(chat_template_config)
    defaults = model is None and draft_model is None
    model, draft_model = resolve_models(model, draft_model, verify)
    prefill_step_size = resolve_prefill_step(prefill_step_size)
    from dflash_mlx.decode.policy import parse_block_size, parse_tree_budget

    block_size, tree_budget = parse_block_size(block_size), parse_tree_budget(tree_budget)
    if block_size not in (None, "auto") and draft_model is None:
        raise InputError("--block-size needs --draft-model (plain decoding has no blocks)")
    if tree_budget is not None and draft_model is None:
        raise InputError("--tree-budget needs --draft-model (plain decoding has no drafts)")
    if compare and draft_model is None:
        raise InputError("--compare needs --draft-model (it compares DFlash with plain decoding)")
    store = make_store(prompt_cache_dir, no_prompt_cache, prompt_cache_gb, warn) if distributed is None else None

    from dflash_mlx import stream_generate
    from dflash_mlx.prompt_cache.pair import PairCache
    from dflash_mlx.chat.session import context_length
    from dflash_mlx.sampling import make_sampler

    if draft_model is not None:
        template.setdefault("enable_thinking", False)

    pair = load_pair(model, draft_model, defaults, window, recalibrate, distributed and sharding)
    if seed is not None:  # after loading: building the model draws from the key, sharded or not
        mx.random.seed(seed)
    check_system_prompt(system_prompt, pair.tokenizer, ignore_chat_template)
    ids = encode_prompt(pair.tokenizer, text, system_prompt, template, ignore_chat_template)
    limit = context_length(pair.target)
    if limit is not None:
        if len(ids) >= limit:
            raise InputError(f"the prompt is {len(ids)} tokens and the target's context "
                             f"(max_position_embeddings) is {limit}: shorten the prompt")
        if len(ids) + max_tokens > limit:
            max_tokens = limit - len(ids)
            warn(f"at most {max_tokens} tokens will be generated: the prompt is {len(ids)} tokens "
                 f"and the target's context is {limit}")
    sampler = make_sampler(temp, top_p, min_p, top_k, pair.target.vocab_size)

    out, stats, finish = [], None, None
    cached = None if store is None else PairCache(pair.target, pair.tokenizer, pair.drafter, store=store,
                                                  generate=stream_generate)
    stream = cached.stream if cached is not None else (
        lambda ids, **kw: stream_generate(pair.target, pair.tokenizer, ids, pair.drafter, **kw))
    try:
        for response in stream(ids, sampler=sampler, max_tokens=max_tokens, block_size=block_size,
                               tree_budget=tree_budget, stop_strings=stops, prefill_step_size=prefill_step_size):
            out.append(response.text)
            stats, finish = response.stats, response.finish_reason
            if not as_json:
                sys.stdout.write(response.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if out and not as_json:
            print(flush=True)  # the shell prompt starts on a fresh line
        raise
    stats.distributed = distributed
    off = (stats.verify or {}).get("reason")
    if off:
        warn(f"--tree-budget is off, chains verify instead: {off}")
    if not as_json:
        print(flush=True)
    against = None
    if compare:
        from dflash_mlx.compare import compare_with_plain

        against = compare_with_plain(pair.target, pair.tokenizer, ids, "".join(out), stats, seed=seed, sampler=sampler,
                                     max_tokens=max_tokens, stop_strings=stops, prefill_step_size=prefill_step_size)
    if as_json:
        extra = {"compare": against} if compare else {}
        print(json.dumps({"text": "".join(out), "finish_reason": finish, **stats.to_dict(), "ttft_s": stats.prompt_s,
                          **extra}))
    _print_stats(stats, cached, against, temp == 0, verbose)


def _print_stats(stats, cached, against, greedy: bool, verbose: bool) -> None:
    """The stats lines on stderr (``--verbose``), then the prompt cache's source and
    the ``--compare`` line."""
    from dflash_mlx.compare import compare_line

    if not verbose:
        return
    for line in stats.format_lines():
        print(line, file=sys.stderr)
    if cached is not None and cached.last_source:
        print(f"Prompt cache: reused from {cached.last_source}", file=sys.stderr)
    if against is not None:
        print(compare_line(against, greedy), file=sys.stderr)
