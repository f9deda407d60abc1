"""Greedy output with a drafter equals mlx-lm's plain greedy output, token for token."""

import mlx.core as mx
import pytest

from dflash_mlx import generate_step
from conftest import ScriptedDrafter, mlx_lm_greedy, tiny_drafter, tiny_target

PROMPT = [1, 17, 33, 2, 9, 100, 42]
N = 200


def _run(target, drafter, n=N, **kw):
    prompt = mx.array(PROMPT, dtype=mx.int32)
    return [t for s in generate_step(prompt, target, drafter, max_tokens=n, **kw) for t in s.tokens]


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_random_drafter_is_lossless(family, block_size):
    model, target = tiny_target(family)
    drafter = tiny_drafter(target)
    assert _run(target, drafter, block_size=block_size) == mlx_lm_greedy(model, PROMPT, N)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_mostly_right_drafter_is_lossless(family, block_size):
    # Accepts several drafts per block, so verify passes commit many tokens at once.
    model, target = tiny_target(family)
    sequence = PROMPT + mlx_lm_greedy(model, PROMPT, N + 16)
    drafter = ScriptedDrafter(sequence, correct=max(1, block_size // 2), block_size=block_size, vocab=256)
    assert _run(target, drafter, block_size=block_size) == sequence[len(PROMPT):len(PROMPT) + N]


def test_plain_engine_matches_mlx_lm(family):
    model, target = tiny_target(family)
    assert _run(target, None) == mlx_lm_greedy(model, PROMPT, N)


def test_untied_and_tied_heads_both_lossless():
    # llama fixture is untied, qwen3 tied: check each really is what it claims.
    llama_model, _ = tiny_target("llama")
    qwen_model, _ = tiny_target("qwen3")
    assert hasattr(llama_model, "lm_head") and not hasattr(qwen_model, "lm_head")


@pytest.mark.parametrize("block_size", [4, 16])
def test_quantized_target_is_lossless(family, block_size):
    # 4-bit target: the drafter borrows a QuantizedEmbedding (and QuantizedLinear head when untied).
    import mlx.nn as nn

    model, target = tiny_target(family)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert type(model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    ref = mlx_lm_greedy(model, PROMPT, N)
    assert _run(target, tiny_drafter(target), block_size=block_size) == ref
    sequence = PROMPT + ref + [0] * 16
    assert _run(target, ScriptedDrafter(sequence, correct=block_size // 2, block_size=block_size, vocab=256),
                block_size=block_size) == ref
