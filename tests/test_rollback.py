"""Rollback is exact or refused: cache arrays after a rollback equal those of a run
that never saw the rejected tokens, also past a sliding window's edge, and for the
recurrent state (conv state and Gated-DeltaNet state) of hybrid targets."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from dflash_mlx import RollbackError, generate_step, make_adapter
from dflash_mlx.prompt_cache.gated_delta import GatedDeltaCache
from dflash_mlx.prompt_cache.window import WindowKVCache
from conftest import ScriptedDrafter, assert_varied, mlx_lm_greedy, tiny_drafter, tiny_target


def _rows(c):
    """The arrays a cache holds for its tokens: [1, H, n, D] keys and values, or a
    Gated-DeltaNet layer's conv state [1, K-1, C] and recurrent state [1, Hv, Dv, Dk]."""
    if isinstance(c, GatedDeltaCache):
        return tuple(c.cache)
    if isinstance(c, WindowKVCache):
        return c.rows()
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def close(u, v, rel=1e-5) -> bool:
    """Equal to float32 rounding of the largest magnitude in ``v``."""
    return (mx.abs(u - v).max() <= rel * mx.maximum(mx.abs(v).max(), 1.0)).item()


def assert_same_cache(a, b):
    """Same cache types, positions and arrays. Values are compared to float32
    rounding: a row computed in a B-row forward and in an (a+1)-row forward goes
    through different matmul kernels (spec section 5), which differ in the last bits."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert type(x) is type(y) and x.offset == y.offset, f"layer {i}"
        assert getattr(x, "start", 0) == getattr(y, "start", 0), f"layer {i}"
        for u, v in zip(_rows(x), _rows(y)):
            assert u.shape == v.shape and u.dtype == v.dtype, f"layer {i}"
            assert close(u, v), f"layer {i} arrays differ"


@pytest.mark.parametrize("prompt_len", [5, 40, 300])  # 300: past the window and past a drop
@pytest.mark.parametrize("accepted", [0, 2, 7])
def test_rollback_equals_a_run_without_the_rejected_tokens(family, prompt_len, accepted):
    _, target = tiny_target(family)
    B = 8
    ids = [(7 * i + 3) % 250 for i in range(prompt_len)]
    block = [(11 * i + 5) % 250 for i in range(B)]  # [t, d_1..d_7]

    verified = target.make_cache(B)
    target(mx.array([ids]), verified)
    target(mx.array([block]), verified)
    target.rollback(verified, B - 1 - accepted)

    clean = target.make_cache(B)
    target(mx.array([ids]), clean)
    target(mx.array([block[: accepted + 1]]), clean)
    mx.eval([c.state for c in verified], [c.state for c in clean])
    assert_same_cache(verified, clean)


def test_sliding_probe_from_issue_is_lossless():
    # Issue 8's probe: layer_types alternating sliding/full, window 8, a 5-token
    # prompt, B = 4. It diverged at the 2nd token with caches at offset 161, not 44.
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    from mlx.utils import tree_map

    mx.random.seed(0)
    model = llama.Model(args)
    model.update(tree_map(lambda p: 1.5 * p, model.parameters()))
    target = make_adapter(model)
    prompt = [1, 17, 33, 2, 9]
    ref = mlx_lm_greedy(model, prompt, 40)
    assert_varied(ref, 15)
    for drafter in (tiny_drafter(target), ScriptedDrafter(prompt + ref + [0] * 8, 2, 4, 256)):
        cache = target.make_cache(4)
        out = [t for s in generate_step(mx.array(prompt), target, drafter, max_tokens=40, block_size=4,
                                        prompt_cache=cache) for t in s.tokens]
        assert out == ref
        assert [c.offset for c in cache] == [44] * 4


def test_window_cache_is_used_for_sliding_layers():
    _, target = tiny_target("llama-sliding")
    kinds = [type(c) for c in target.make_cache(16)]
    assert kinds == [WindowKVCache, KVCache, WindowKVCache, KVCache]


def test_mlx_lm_rotating_cache_is_refused_before_generation():
    model, target = tiny_target("llama-sliding")
    cache = model.make_cache()  # mlx-lm's own: RotatingKVCache for sliding layers
    assert isinstance(cache[0], RotatingKVCache)
    drafter = tiny_drafter(target)
    steps = generate_step(mx.array([1, 2, 3]), target, drafter, max_tokens=5, block_size=4, prompt_cache=cache)
    with pytest.raises(RollbackError, match=r"layer 0: RotatingKVCache \(sliding window 8\)"):
        next(steps)
    assert cache[0].offset == 0  # refused before anything ran


def test_window_cache_refuses_a_rollback_it_cannot_do_exactly():
    _, target = tiny_target("llama-sliding")
    cache = target.make_cache(4)
    target(mx.array([list(range(1, 300))]), cache)  # held rows dropped past the window
    c = cache[0]
    assert c.start > 0
    offsets = [x.offset for x in cache]
    with pytest.raises(RollbackError, match="layer 0: WindowKVCache cannot remove its last 100 rows"):
        target.rollback(cache, 100)
    assert [x.offset for x in cache] == offsets  # nothing was trimmed
    assert c.trim(100) == 0 and c.offset == offsets[0]
    target.rollback(cache, 4)  # within the slack: exact
    assert [x.offset for x in cache] == [o - 4 for o in offsets]


def test_too_small_slack_is_refused():
    _, target = tiny_target("llama-sliding")
    cache = target.make_cache(4)
    with pytest.raises(RollbackError, match=r"keeps 4 rows for rollback but a verify feeds 16"):
        target.check_cache(cache, 16)


class RecordingDrafter(ScriptedDrafter):
    """Records the context rows each draft call receives."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.contexts = []

    def draft(self, token, context, cache, block_size):
        self.contexts.append(context)
        return super().draft(token, context, cache, block_size)


def test_drafter_receives_the_accepted_rows_features(family):
    # After a verify accepting a drafts, the next draft gets the features of the a + 1
    # committed rows (anchor and accepted drafts), in order, and nothing else.
    model, target = tiny_target(family)
    prompt = [3, 14, 15, 92, 65]
    ref = mlx_lm_greedy(model, prompt, 60)
    drafter = RecordingDrafter(prompt + ref + [0] * 8, correct=3, block_size=8, vocab=256, layer_ids=(1, 3))
    out = [t for s in generate_step(mx.array(prompt), target, drafter, max_tokens=40, block_size=8)
           for t in s.tokens]
    assert out == ref[:40]
    sizes = [c.shape[1] for c in drafter.contexts]
    assert sizes[0] == len(prompt) and all(s == 4 for s in sizes[1:])
    seen = mx.concatenate(drafter.contexts, axis=1)
    _, whole = target(mx.array([prompt + out]), target.make_cache(8), [1, 3])
    # step-by-step against one whole forward: Gated-DeltaNet layers sum in another order, 1e-5 of
    # the largest value apart on one thread; a wrong or misplaced row is off by O(1)
    assert close(seen, whole[:, : seen.shape[1]], rel=1e-4)
