"""PairCache: prompts reuse the common prefix of both caches exactly, a closed
generation leaves them consistent, and a cache that cannot trim falls back to fresh ones."""

import mlx.core as mx
import pytest

from dflash_mlx import generate_step
from conftest import pair_cache as PairCache
from dflash_mlx.targets.hybrid import HybridAdapter
from conftest import ByteTokenizer, tiny_drafter, tiny_target


def fresh(target, drafter, ids, n, B=4):
    steps = generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=n, block_size=B)
    return [t for s in steps for t in s.tokens]


def run(pc, ids, n, B=4):
    return [t for r in pc.stream(ids, max_tokens=n, block_size=B) for t in r.tokens]


def check_consistent(pc):
    assert pc.is_consistent(), (pc.offsets(), len(pc.tokens))


@pytest.fixture
def pair(family):
    _, target = tiny_target(family)
    return target, tiny_drafter(target)


def test_prompts_reuse_the_common_prefix_exactly(pair):
    target, drafter = pair
    pc = PairCache(target, ByteTokenizer(), drafter)
    first = list(range(10, 40))
    reply = run(pc, first, 20)
    assert pc.last_reused == 0 and reply == fresh(target, drafter, first, 20)
    assert pc.tokens == (first + reply)[:-1]
    check_consistent(pc)
    # A prompt that continues the conversation reuses everything but the last token.
    cont = first + reply + [50, 51, 52]
    assert run(pc, cont, 25) == fresh(target, drafter, cont, 25)
    assert pc.last_reused == len(first) + len(reply) - 1
    check_consistent(pc)
    # A prompt that shares only a prefix reuses just that prefix; a Gated-DeltaNet
    # state cannot go back past its last forward, so a hybrid target starts afresh.
    other = first[:12] + [99, 98, 97]
    assert run(pc, other, 15) == fresh(target, drafter, other, 15)
    assert pc.last_reused == (0 if isinstance(target, HybridAdapter) else 12)
    check_consistent(pc)


def test_closing_mid_generation_keeps_both_caches_consistent(pair):
    target, drafter = pair
    pc = PairCache(target, ByteTokenizer(), drafter)
    ids = list(range(60, 90))
    got = []
    steps = pc.stream(ids, max_tokens=60, block_size=4)
    for r in steps:
        got += r.tokens
        if len(got) > 8:
            break
    steps.close()
    check_consistent(pc)
    assert pc.tokens == (ids + got)[:-1]
    again = ids + got + [7]
    assert run(pc, again, 20) == fresh(target, drafter, again, 20)
    assert pc.last_reused == len(ids) + len(got) - 1
    check_consistent(pc)


def test_a_cache_that_cannot_trim_starts_afresh():
    """Sliding-window layers (window 8) that moved past the common prefix cannot go
    back to it: both caches are made anew and the whole prompt is prefilled."""
    _, target = tiny_target("llama-sliding")
    drafter = tiny_drafter(target)
    pc = PairCache(target, ByteTokenizer(), drafter)
    long = [(7 * i) % 250 + 3 for i in range(300)]
    run(pc, long, 10)
    short = long[:5] + [1, 2, 3]
    assert run(pc, short, 12) == fresh(target, drafter, short, 12)
    assert pc.last_reused == 0
    check_consistent(pc)


@pytest.mark.parametrize("fmt", ["dspark", "dflash-block7"])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_dspark_drafters_reuse_the_common_prefix_exactly(family, fmt):
    """The two tests above with DSpark drafters (anchor-first, with and without the Markov head)."""
    from conftest import format_drafter

    _, target = tiny_target(family)
    pair = (target, format_drafter(target, fmt))
    test_prompts_reuse_the_common_prefix_exactly(pair)
    test_closing_mid_generation_keeps_both_caches_consistent(pair)
