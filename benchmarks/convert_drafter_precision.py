#!/usr/bin/env python3
"""What ``dflash convert --draft-q-bits`` costs a drafter: logits, agreement, tau.

Converts one pair with the drafter kept float, at 8 bits and at 4 bits (the
target is copied unchanged), then on every prompt of a set:
- the largest logit difference between the converted and the unconverted drafter
  on the prompt's fixed input (dflash_mlx.pair.validation.drafter_logits: float32),
  relative to the largest |logit|;
- how often their argmax drafts agree (positions 1..B-1);
- tau of greedy DFlash decoding with the converted pair (up to EOS or
  --max-tokens), and whether its output equals the target's own greedy output.
No timings: this measures precision, not speed.

Run from the repository root, e.g. on the stories260K pair of
``scripts/train_stories260k.sh OUT``:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/convert_drafter_precision.py OUT/target OUT/drafter
"""

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from dflash_mlx import load, load_drafter
from dflash_mlx.pair.convert import convert
from dflash_mlx.pair.loading import dtype_name, float_dtype
from dflash_mlx.pair.validation import dflash_tokens, drafter_logits, greedy_tokens, logit_difference

ROOT = Path(__file__).resolve().parents[1]


def until_stop(tokens, stop_ids):
    """The tokens before the first stop token."""
    cut = next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return tokens[:cut]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="target folder or repo id")
    p.add_argument("drafter", help="drafter folder or repo id")
    p.add_argument("--prompts", type=Path, default=ROOT / "scripts" / "data" / "story_openings.jsonl")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--group-size", type=int, default=64, help="--draft-q-group-size")
    p.add_argument("--dtype", help="--dtype for convert (float32 keeps the target's head out of the comparison)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    print("command:", shlex.join(["python", *sys.argv]))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in [None, *args.bits]:
            out = Path(tmp) / f"pair-{bits or 'float'}"
            convert(args.target, args.drafter, out, draft_q_bits=bits, draft_q_group_size=args.group_size,
                    dtype=args.dtype, validate_output=False)
            pair = load(str(out))
            prompts = [pair.tokenizer.encode(json.loads(line)["prompt"])
                       for line in args.prompts.read_text().splitlines()]
            converted, original = load_drafter(str(out / "drafter")), load_drafter(args.drafter)
            written = dtype_name(float_dtype(converted))  # before drafter_logits casts it to float32
            rel, agree, same, total, stats = 0.0, 0, 0, 0, None
            for ids in prompts:
                a = drafter_logits(converted, pair.target, ids)
                b = drafter_logits(original, pair.target, ids)
                rel = max(rel, logit_difference(a, b)[1])
                agree += int((mx.argmax(a, -1) == mx.argmax(b, -1)).sum().item())
                total += a.shape[0]
                eos = list(pair.tokenizer.eos_token_ids)
                tokens, s = dflash_tokens(pair.target, pair.drafter, ids, args.max_tokens, eos)
                same += tokens == until_stop(greedy_tokens(pair.model, ids, args.max_tokens), eos)
                if stats is None:
                    stats = s
                else:
                    stats.add(s)
            rows.append({
                "drafter": f"{bits}-bit, group {args.group_size}" if bits else f"float ({written})",
                "drafter_bytes": (out / "drafter" / "model.safetensors").stat().st_size,
                "max_rel_logit_diff": rel,
                "argmax_agreement": agree / total,
                "tau": stats.tau,
                "outputs_equal": f"{same}/{len(prompts)}",
            })
            print(rows[-1], flush=True)

    print("\n| drafter | file (KB) | max logit diff (rel.) | draft argmax agreement | tau | outputs equal to target greedy |")
    print("|---|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(f"| {r['drafter']} | {r['drafter_bytes'] / 1e3:.1f} | {r['max_rel_logit_diff']:.2%} | "
              f"{r['argmax_agreement']:.1%} | {r['tau']:.2f} | {r['outputs_equal']} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({"command": shlex.join(sys.argv), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
