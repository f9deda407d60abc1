"""Fully accepted, partly accepted and fully rejected blocks: tokens, tau, cache offsets."""

import mlx.core as mx
import pytest

from dflash_mlx import GenerationStats, generate_step
from conftest import ScriptedDrafter, mlx_lm_greedy, tiny_target

PROMPT = [3, 14, 15, 92, 65]
B = 8
N = 60


@pytest.fixture(scope="module")
def setup():
    model, target = tiny_target("qwen3", seed=3)
    sequence = PROMPT + mlx_lm_greedy(model, PROMPT, N + B + 1)
    return model, target, sequence


@pytest.mark.parametrize("correct", [B - 1, 3, 0], ids=["full", "partial", "none"])
def test_acceptance_paths(setup, correct):
    _, target, sequence = setup
    drafter = ScriptedDrafter(sequence, correct=correct, block_size=B, vocab=256)
    cache = target.make_cache()
    stats = GenerationStats(block_size=B)
    out = []
    steps = generate_step(
        mx.array(PROMPT, dtype=mx.int32), target, drafter,
        max_tokens=N, block_size=B, prompt_cache=cache, stats=stats,
    )
    for i, step in enumerate(steps):
        out += step.tokens
        if i == 0:
            assert step.accepted is None and len(step.tokens) == 1
        else:
            assert step.accepted == correct
            if step.finish_reason is None:
                assert len(step.tokens) == correct + 1
        # The cache holds every committed token except the last one.
        assert all(c.offset == len(PROMPT) + len(out) - 1 for c in cache)
    assert out == sequence[len(PROMPT):len(PROMPT) + N]
    assert stats.histogram == {correct + 1: stats.steps}
    assert stats.accepted == correct * stats.steps and stats.drafted == (B - 1) * stats.steps
    assert stats.tau == pytest.approx(correct + 1)
    # Every token after the first came from a verify step.
    assert stats.steps == -(-(N - 1) // (correct + 1))


def test_stop_token_cuts_block_and_settles_cache(setup):
    _, target, sequence = setup
    stop = sequence[len(PROMPT) + 10]
    first = sequence.index(stop, len(PROMPT))
    drafter = ScriptedDrafter(sequence, correct=B - 1, block_size=B, vocab=256)
    cache = target.make_cache()
    out, reasons = [], []
    for step in generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter, max_tokens=N,
                              block_size=B, stop_token_ids=[stop], prompt_cache=cache):
        out += step.tokens
        reasons.append(step.finish_reason)
    assert out == sequence[len(PROMPT):first]
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
    assert cache[0].offset == len(PROMPT) + len(out) - 1


@pytest.mark.parametrize("max_tokens", [1, 2, 9, 17])
def test_max_tokens_cuts_block(setup, max_tokens):
    _, target, sequence = setup
    drafter = ScriptedDrafter(sequence, correct=B - 1, block_size=B, vocab=256)
    steps = list(generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter,
                               max_tokens=max_tokens, block_size=B))
    out = [t for s in steps for t in s.tokens]
    assert out == sequence[len(PROMPT):len(PROMPT) + max_tokens]
    assert steps[-1].finish_reason == "length"
