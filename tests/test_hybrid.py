"""Hybrid targets (Gated-DeltaNet + attention): what a GatedDeltaCache can roll back,
what it refuses, and the one-line errors for caches and drafters that do not fit.

The lossless, rollback, multi-turn and chat tests run for the hybrid families too
(``FAMILIES`` in conftest.py); these pin the cache's own contract.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import MismatchError, RollbackError, bind_drafter, generate_step
from dflash_mlx.prompt_cache.gated_delta import GatedDeltaCache
from dflash_mlx.prompt_cache.rollback import can_trim
from dflash_mlx.drafter.network import DFlashDrafter
from conftest import ScriptedDrafter, mlx_lm_greedy, tiny_drafter_args, tiny_target

HYBRIDS = ["qwen3_5", "qwen3_next"]
PROMPT = [(5 * i + 2) % 250 for i in range(12)]
BLOCK = [7, 91, 13, 200, 4, 4, 66, 120]


def _verified(family, slack=8):
    """A target whose cache has seen PROMPT, then one 8-token verify forward."""
    _, target = tiny_target(family)
    cache = target.make_cache(slack)
    target(mx.array([PROMPT]), cache)
    mx.eval([c.state for c in cache])
    before = [list(c.cache) for c in cache if isinstance(c, GatedDeltaCache)]
    target(mx.array([BLOCK]), cache)
    mx.eval([c.state for c in cache])
    return target, cache, before


def _states(cache):
    return [list(c.cache) for c in cache if isinstance(c, GatedDeltaCache)]


def _same(a, b):
    return all(mx.array_equal(x, y).item() for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.parametrize("family", HYBRIDS)
def test_rollback_of_the_whole_forward_restores_the_state_before_it(family):
    target, cache, before = _verified(family)
    target.rollback(cache, len(BLOCK))
    assert [c.offset for c in cache] == [len(PROMPT)] * len(cache)
    assert all(x is y for u, v in zip(_states(cache), before) for x, y in zip(u, v))


@pytest.mark.parametrize("family", HYBRIDS)
def test_two_rollbacks_equal_one(family):
    # The loop rolls back rejected drafts, then cuts the block at a stop token.
    target, once, _ = _verified(family)
    target.rollback(once, 5)
    target2, twice, _ = _verified(family)
    target2.rollback(twice, 3)
    target2.rollback(twice, 2)
    mx.eval([c.state for c in once + twice])
    assert [c.offset for c in once] == [c.offset for c in twice]
    assert _same(_states(once), _states(twice))


@pytest.mark.parametrize("family", HYBRIDS)
def test_rollback_before_the_last_forward_is_refused(family):
    target, cache, _ = _verified(family)
    states, offsets = _states(cache), [c.offset for c in cache]
    assert not can_trim(cache[0], len(BLOCK) + 1) and can_trim(cache[0], len(BLOCK))
    with pytest.raises(RollbackError, match="layer 0: GatedDeltaCache cannot remove its last 9 rows"):
        target.rollback(cache, len(BLOCK) + 1)
    assert [c.offset for c in cache] == offsets  # nothing changed, on any layer
    assert all(x is y for u, v in zip(_states(cache), states) for x, y in zip(u, v))


@pytest.mark.parametrize("family", HYBRIDS)
def test_forward_longer_than_the_slack_cannot_be_rolled_back(family):
    # A prefill chunk keeps no replay inputs (memory): its rows cannot be removed.
    _, target = tiny_target(family)
    cache = target.make_cache(4)
    target(mx.array([PROMPT]), cache)
    assert cache[0].can_trim(0) and not cache[0].can_trim(1)
    with pytest.raises(RollbackError, match="GatedDeltaCache"):
        target.rollback(cache, 1)


@pytest.mark.parametrize("family", HYBRIDS)
def test_forward_run_by_the_mlx_lm_module_cannot_be_rolled_back(family):
    # Only the adapter's forward records; after the model's own forward the cache
    # must not replay an older record.
    model, target = tiny_target(family)
    cache = target.make_cache(8)
    target(mx.array([PROMPT[:4]]), cache)
    assert cache[0].can_trim(2)
    model(mx.array([PROMPT[4:7]]), cache=cache)
    assert cache[0].offset == 7 and not cache[0].can_trim(1)


def test_cache_of_another_model_is_refused():
    _, target = tiny_target("qwen3_5", seed=0)
    _, other = tiny_target("qwen3_5", seed=1)
    cache = other.make_cache(4)
    drafter = ScriptedDrafter([0] * 64, correct=1, block_size=4, vocab=256)
    steps = generate_step(mx.array(PROMPT), target, drafter, max_tokens=5, block_size=4, prompt_cache=cache)
    with pytest.raises(MismatchError, match="layer 0: this Gated-DeltaNet cache was built by another model"):
        next(steps)
    assert cache[0].offset == 0  # refused before anything ran


@pytest.mark.parametrize("family,built_by,match", [
    ("qwen3_5", "qwen3", "target layer 0 is a Gated-DeltaNet layer but its cache is a KVCache"),
    ("qwen3_5", "qwen3_next", "target layer 0: this Gated-DeltaNet cache was built by another model"),
    ("qwen3", "qwen3_5", "target layer 0 is an attention layer but its cache is a Gated-DeltaNet cache"),
    ("qwen3_5", "gemma4_text", "the prompt cache has 2 layer caches but this target needs 4"),
])
def test_cache_built_for_another_family_is_refused(family, built_by, match):
    _, target = tiny_target(family)
    _, other = tiny_target(built_by)
    with pytest.raises(MismatchError, match=match):
        target.check_cache(other.make_cache(4), 4)


def test_mlx_lm_arrays_cache_is_refused():
    model, target = tiny_target("qwen3_5")
    cache = model.make_cache()
    assert type(cache[0]) is ArraysCache
    with pytest.raises(RollbackError, match=r"layer 0: mlx-lm's ArraysCache .* cannot be rolled back"):
        target.check_cache(cache, 4)


def test_too_small_slack_is_refused():
    _, target = tiny_target("qwen3_5")
    with pytest.raises(RollbackError, match="can roll back 4 tokens but a verify feeds 16"):
        target.check_cache(target.make_cache(4), 16)


@pytest.mark.parametrize("family", HYBRIDS)
def test_drafter_layer_ids_beyond_the_target(family):
    _, target = tiny_target(family)
    drafter = DFlashDrafter(tiny_drafter_args(target, layer_ids=[1, target.num_layers]))
    with pytest.raises(MismatchError, match=r"dflash_config.target_layer_ids \[1, 4\] name layers beyond"):
        bind_drafter(drafter, target)
    # A drafter that skips the pair check is stopped at the first forward.
    scripted = ScriptedDrafter([0] * 64, correct=1, block_size=4, vocab=256, layer_ids=(1, 9))
    with pytest.raises(MismatchError, match=r"target_layer_ids \[1, 9\] name layers beyond the target's 4"):
        next(generate_step(mx.array(PROMPT), target, scripted, max_tokens=5, block_size=4))


@pytest.mark.parametrize("family", HYBRIDS)
def test_lossless_check_fails_when_only_the_recurrent_state_is_not_rolled_back(family, monkeypatch):
    # Attention layers still trim; Gated-DeltaNet layers only move their offset back.
    model, target = tiny_target(family)
    ref = mlx_lm_greedy(model, PROMPT, 60)
    drafter = ScriptedDrafter(PROMPT + ref + [0] * 8, correct=2, block_size=4, vocab=256, check_anchor=False)

    def run():
        steps = generate_step(mx.array(PROMPT), target, drafter, max_tokens=60, block_size=4)
        return [t for s in steps for t in s.tokens]

    assert run() == ref
    monkeypatch.setattr(GatedDeltaCache, "trim", lambda self, n: (setattr(self, "offset", self.offset - n), n)[1])
    assert run() != ref


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_stop_token_during_plain_steps_leaves_the_cache_exact(family):
    # Plain steps read one token while the next forward runs; a recurrent layer cannot drop a row of
    # an older forward, so a stop token there must not need it.
    model, target = tiny_target(family)
    ref = mlx_lm_greedy(model, PROMPT, 40)
    at = next(i for i in range(10, 40) if ref[i] not in ref[:i])
    cache = target.make_cache(4)
    steps = generate_step(mx.array(PROMPT), target, None, max_tokens=40, stop_token_ids=[ref[at]],
                          prompt_cache=cache)
    assert [t for s in steps for t in s.tokens] == ref[:at]
    assert cache[0].offset == len(PROMPT) + at - 1  # the prompt and every emitted token but the last
