"""The SmolLM2-135M-Instruct drafter shipped in examples/smollm2-135m/drafter: its format and record always;
lossless greedy decoding and its tau on held-out GSM8K questions where the converted target is at hand
(DFLASH_SMOLLM2=DIR, a folder from `dflash convert --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32`;
the tests never download it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ROOT, SHARED, assert_varied

DRAFTER = ROOT / "examples" / "smollm2-135m" / "drafter"
TARGET = Path(os.environ.get("DFLASH_SMOLLM2", "/nonexistent"))
needs_target = pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason=(
    "needs the converted SmolLM2-135M-Instruct (DFLASH_SMOLLM2=DIR; README, 'A real chat model')"))


def test_the_drafter_is_small_and_says_how_it_was_made():
    from dflash_mlx.drafter.checkpoint import load_drafter

    drafter = load_drafter(str(DRAFTER))
    a = drafter.args
    assert (a.vocab_size, a.hidden_size, a.num_target_layers, a.block_size) == (49152, 576, 30, 16)
    assert list(a.target_layer_ids) == [1, 8, 14, 20, 27]
    assert sum(p.stat().st_size for p in DRAFTER.iterdir()) <= 16 * 2**20
    made_by = json.loads((DRAFTER / "made_by.json").read_text())
    assert {"command", "commit", "data", "time_s", "machine"} <= set(made_by)


@needs_target
def test_lossless_on_held_out_gsm8k():
    """Greedy output with the drafter equals the target's own greedy decoding on held-out GSM8K questions
    (rows from 1,000 on, never trained on), at block size 16, with drafts accepted."""
    import mlx.core as mx

    from dflash_mlx import GenerationStats, generate_step, load
    from dflash_mlx.bench.datasets import load_file
    from dflash_mlx.prompt import encode_messages

    pair = load(str(TARGET), str(DRAFTER))
    questions = [s.turns[0] for s in load_file(SHARED / "datasets" / "gsm8k_test.jsonl")[1][1000:1001]]
    taus = []
    for question in questions:
        ids = mx.array(encode_messages(pair.tokenizer, [{"role": "user", "content": question}]), dtype=mx.int32)
        plain = [int(t) for r in generate_step(ids, pair.target, None, max_tokens=64) for t in r.tokens]
        stats = GenerationStats(block_size=16)
        ours = [int(t) for r in generate_step(ids, pair.target, pair.drafter, max_tokens=64, block_size=16,
                                              stats=stats) for t in r.tokens]
        assert_varied(plain, 20)
        assert ours[:len(plain)] == plain
        taus.append(stats.tau)
    assert sum(taus) / len(taus) > 1.1  # drafts are accepted (the shipped drafter is undertrained: made_by.json)


def test_no_held_out_prompt_is_a_training_prompt():
    """The held-out sequences drafters are scored on (examples/smollm2-135m/heldout) share no prompt with the
    training data kept beside them (examples/smollm2-135m/data), token for token."""
    from dflash_mlx.train.data import load_sequences

    def prompts(folder):
        return {s.tokens[:s.response_start].tobytes() for s in load_sequences(str(folder))}

    held = {d.name: prompts(d) for d in sorted((DRAFTER.parent / "heldout").iterdir()) if d.is_dir()}
    assert sorted(held) == ["gsm8k", "humaneval", "mt-bench"] and all(len(p) == 64 for p in held.values())
    for folder in sorted((DRAFTER.parent / "data").iterdir()):
        if folder.is_dir():
            train = prompts(folder)
            assert train and not any(train & p for p in held.values()), folder.name
