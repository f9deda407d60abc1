#!/usr/bin/env python3
"""A draft tree against a chain of the same verify width: a chain of W verifies its last token and W-1 drafts, a tree
of W-1 nodes (DDTree, spec section 7) the same number of tokens, placed where the drafter's log-probabilities say.
Each setting decodes the same prompts in one process (the settings' order turned by one per prompt, the text checked
equal), greedy, prompt lookup off; tokens a step, ms a step and tokens a second over all prompts.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/tree_width.py --model OUT/smol --draft-model examples/smollm2-135m/drafter \\
        --prompts OUT/prompts/gsm8k_heldout.jsonl -n 9 -m 128 --settings plain chain:2 chain:4 tree:3@4 chain:8 tree:7@8

A setting is ``plain``, ``chain:W`` (block size W) or ``tree:N@B`` (a tree of N nodes drafted from a block of B).
"""

import argparse
import json
from typing import Optional

from dflash_mlx.decode.generate import generate
from dflash_mlx.pair.loading import load
from dflash_mlx.train.data import encode_prompts, read_prompt_file


def parse(setting: str) -> Optional[dict]:
    """``plain``, ``chain:W`` or ``tree:N@B`` as :func:`generate`'s keywords (None for plain decoding)."""
    if setting == "plain":
        return None
    kind, _, size = setting.partition(":")
    if kind == "chain":
        return {"block_size": int(size)}
    nodes, _, block = size.partition("@")
    return {"tree_budget": int(nodes), "block_size": int(block)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", required=True, help="JSONL of {\"prompt\"} or {\"messages\"} rows (chat template)")
    p.add_argument("-n", type=int, default=9)
    p.add_argument("-m", "--max-tokens", type=int, default=128)
    p.add_argument("--settings", nargs="+", default=["plain", "chain:4", "tree:3@4"])
    p.add_argument("--out", help="write the figures here as JSON")
    a = p.parse_args()
    pair = load(a.model, a.draft_model)
    ids = encode_prompts(pair.tokenizer, read_prompt_file(a.prompts)[: a.n])
    generate(pair.target, pair.tokenizer, ids[0], pair.drafter, max_tokens=8, block_size=4)  # compile and allocate
    totals = {s: [0, 0, 0.0] for s in a.settings}  # tokens, steps, seconds
    for i, prompt in enumerate(ids):
        order, text = a.settings[i % len(a.settings):] + a.settings[: i % len(a.settings)], None
        for setting in order:
            kw = parse(setting)
            out, stats = generate(pair.target, pair.tokenizer, prompt, None if kw is None else pair.drafter,
                                  max_tokens=a.max_tokens, **(kw or {}))
            if text is not None and out != text:
                raise SystemExit(f"prompt {i}: {setting} wrote other text than {order[0]}")
            text = out
            t = totals[setting]
            t[0], t[1], t[2] = t[0] + stats.generation_tokens, t[1] + stats.steps + stats.plain_steps, \
                t[2] + stats.generation_s
    rows = {s: {"tokens_per_step": round(n / k, 3), "ms_per_step": round(1000 * sec / k, 1),
                "tokens_per_s": round(n / sec, 2)} for s, (n, k, sec) in totals.items()}
    for s, r in rows.items():
        print(f"{s:>10}  {r['tokens_per_step']:.3f} tokens a step  {r['ms_per_step']:6.1f} ms a step  "
              f"{r['tokens_per_s']:6.2f} tokens/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"settings": rows, "prompts": a.prompts, "n": len(ids), "max_tokens": a.max_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
