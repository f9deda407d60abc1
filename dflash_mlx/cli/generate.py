"""``dflash generate``: one prompt in, text on stdout, stats on stderr."""

import json
import sys
from functools import partial
from types import SimpleNamespace
from typing import Annotated, Optional

from typer import Option

from dflash_mlx.errors import InputError

from .fit import folded
from .common import (
    BlockSize, PromptLookup, DraftModel, DraftWindow, IgnoreTemplate, MaxTokens, MinP, Model, NoPromptCache, PrefillStep,
    PromptCacheDir, PromptCacheGb, Seed, Sharding, Stop, SystemPrompt, Temp, TemplateConfig, TopK, TopP,
    TreeBudget, Verify, check_pair_flags, check_sampling, check_template_flags, guard, load_pair,
    parse_draft_window, parse_stops, read_prompt, warn)

def generate(
    model: Model = None, draft_model: DraftModel = None, verify: Verify = False,
    prompt: Annotated[Optional[str], Option("--prompt", "-p", help="Prompt text; '-' or omitted: piped stdin.")] = None,
    max_tokens: MaxTokens = 256, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0, min_p: MinP = 0.0,
    seed: Seed = None, block_size: BlockSize = "auto", tree_budget: TreeBudget = None,
    prompt_lookup: PromptLookup = "auto", draft_window: DraftWindow = None, system_prompt: SystemPrompt = None,
    stop: Stop = [], chat_template_config: TemplateConfig = None, ignore_chat_template: IgnoreTemplate = False,
    prefill_step_size: PrefillStep = None, prompt_cache_dir: PromptCacheDir = None,
    no_prompt_cache: NoPromptCache = False, prompt_cache_gb: PromptCacheGb = 8.0,
    verbose: Annotated[bool, Option("--verbose/--quiet", help="Print stats on stderr.")] = True,
    as_json: Annotated[bool, Option("--json", help="Print one JSON object: text and stats.")] = False,
    compare: Annotated[bool, Option("--compare", help="Also decode plainly; print the speedup.")] = False,
    sharding: Sharding = None,
) -> None:
    """Generate from one prompt. Text streams to stdout, stats go to stderr.

    Exit codes: 0 done, 1 bad input, 130 Ctrl-C, 141 output pipe closed.

    \b
    Examples:
      dflash generate --prompt "Explain KV caches in two sentences."
      dflash generate --model Qwen/Qwen3-8B --draft-model z-lab/Qwen3-8B-DFlash-b16 --compare -p - < q.txt
      mlx.launch --backend ring -n 2 -- dflash generate --model M --draft-model D -p "Once upon a time"
    """
    o = SimpleNamespace(**locals())
    guard(lambda: _run(o))


def _run(o) -> None:
    check_sampling(o.temp, o.top_p, o.top_k, o.min_p, o.max_tokens)  # flags first, then the 2-3 s of imports
    stops, window = parse_stops(o.stop), parse_draft_window(o.draft_window)
    from dflash_mlx.pair.sharded import join_ranks, share_text

    distributed = join_ranks(o.sharding)
    text = share_text(lambda: read_prompt(o.prompt))
    check_pair_flags(o)
    if distributed is not None:
        o.store = None  # one prompt cache per rank would differ; none under mlx.launch
    import mlx.core as mx

    from dflash_mlx.prompt import context_length, encode_messages, plain_text
    from dflash_mlx.sampling import Sampling

    pair = load_pair(o.model, o.draft_model, o.defaults, window, distributed and distributed["sharding"])
    if o.seed is not None:  # after loading: building the model draws from the key, sharded or not
        mx.random.seed(o.seed)
    check_template_flags(pair.tokenizer, o.system_prompt, o.chat_template_config, o.ignore_chat_template)
    turns = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
    ids = encode_messages(pair.tokenizer, turns + [{"role": "user", "content": text}], o.template,
                          use_template=not o.ignore_chat_template, plain=plain_text)
    max_tokens = fit_context(len(ids), o.max_tokens, context_length(pair.target))
    sampler = Sampling(o.temp, o.top_p, o.min_p, o.top_k, pair.target.vocab_size)
    run = dict(sampler=sampler, max_tokens=max_tokens, stop_strings=stops, prefill_step_size=o.prefill_step_size,
               prompt_lookup=o.prompt_lookup == "auto")
    if o.compare:  # both halves timed on built kernels
        from dflash_mlx.compare import warm_up

        warm_up(pair.target, pair.drafter, ids, o.block_size, sampler)
        if o.seed is not None:
            mx.random.seed(o.seed)
    out, token_ids, stats, finish, cached = _stream(pair, ids, o, run)
    stats.distributed = distributed
    if (stats.verify or {}).get("reason"):
        warn(f"--tree-budget is off, chains verify instead: {stats.verify['reason']}")
    against = None
    if o.compare:
        from dflash_mlx.compare import compare_with_plain

        against = compare_with_plain(pair.target, pair.tokenizer, ids, out, stats, seed=o.seed, **run)
    if o.as_json:
        extra = {"compare": against} if o.compare else {}
        print(json.dumps({"text": out, "token_ids": token_ids, "finish_reason": finish, **stats.to_dict(),
                          "ttft_s": stats.prompt_s, **extra}))
    if o.verbose:
        from dflash_mlx.compare import compare_line

        reused = [f"Prompt cache: reused from {cached.last_source}"] if cached and cached.last_source else []
        compared = [compare_line(against, o.temp == 0)] if against is not None else []
        print(folded(stats.format_lines() + reused + compared), file=sys.stderr)


def fit_context(prompt_tokens: int, max_tokens: int, limit: Optional[int]) -> int:
    """``max_tokens`` cut (with a warning) to the context left; InputError when the prompt fills it."""
    if limit is None or prompt_tokens + max_tokens <= limit:
        return max_tokens
    if prompt_tokens >= limit:
        raise InputError(f"the prompt is {prompt_tokens} tokens and the target's context "
                         f"(max_position_embeddings) is {limit}: shorten the prompt")
    warn(f"at most {limit - prompt_tokens} tokens will be generated: the prompt is {prompt_tokens} tokens "
         f"and the target's context is {limit}")
    return limit - prompt_tokens


def _stream(pair, ids, o, run: dict):
    """Stream the reply to stdout (unless --json); returns ``(text, token ids, stats, finish_reason, prompt cache)``
    (the ids: every generated token but a stop token)."""
    from dflash_mlx.decode.generate import stream_generate
    from dflash_mlx.prompt_cache.pair import PairCache

    cached = o.store and PairCache(pair.target, pair.tokenizer, pair.drafter, store=o.store, generate=stream_generate)
    stream = cached.stream if cached else partial(stream_generate, pair.target, pair.tokenizer, drafter=pair.drafter)
    out, token_ids, stats, finish = [], [], None, None
    try:
        for response in stream(ids, block_size=o.block_size, tree_budget=o.tree_budget, **run):
            out.append(response.text)
            token_ids.extend(response.tokens)
            stats, finish = response.stats, response.finish_reason
            if not o.as_json:
                sys.stdout.write(response.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if out and not o.as_json:
            print(flush=True)  # the shell prompt starts on a fresh line
        raise
    if not o.as_json:
        print(flush=True)
    return "".join(out), token_ids, stats, finish, cached
