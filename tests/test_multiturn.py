"""A second generation continuing from both caches equals a fresh run on everything."""

import mlx.core as mx
import pytest

from dflash_mlx import generate_step
from conftest import tiny_drafter, tiny_target

PROMPT = [1, 17, 33, 2, 9]
TURN2 = [7, 7, 42, 3]


def _gen(target, drafter, prompt, n, **kw):
    return [t for s in generate_step(mx.array(prompt, dtype=mx.int32), target, drafter, max_tokens=n,
                                     block_size=4, **kw) for t in s.tokens]


@pytest.mark.parametrize("n1", [1, 13, 40])
def test_second_turn_reuses_caches_exactly(family, n1):
    _, target = tiny_target(family)
    drafter = tiny_drafter(target)
    cache, dcache = target.make_cache(4), drafter.make_cache()
    out1 = _gen(target, drafter, PROMPT, n1, prompt_cache=cache, draft_cache=dcache)
    # At rest both caches hold every committed token but the last.
    assert cache[0].offset == dcache[0].offset == len(PROMPT) + n1 - 1
    out2 = _gen(target, drafter, [out1[-1]] + TURN2, 30, prompt_cache=cache, draft_cache=dcache)

    whole = PROMPT + out1 + TURN2
    fresh_cache, fresh_dcache = target.make_cache(4), drafter.make_cache()
    assert out2 == _gen(target, drafter, whole, 30, prompt_cache=fresh_cache, draft_cache=fresh_dcache)
    # The drafter saw the same context rows at the same positions.
    assert dcache[0].offset == fresh_dcache[0].offset
    for a, b in zip(dcache, fresh_dcache):
        assert mx.allclose(a.state[0], b.state[0], atol=1e-4).item()
        assert mx.allclose(a.state[1], b.state[1], atol=1e-4).item()
