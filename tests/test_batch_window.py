"""Continuous batching of targets with sliding-window layers (Llama with ``sliding_window``,
Gemma 3, Gemma 4, gpt-oss; window 8 in the fixtures): every sequence emits exactly its
solo tokens while prompts and generations run far past the window, with ragged
acceptance, a real drafter, joins, stops and cancellations; the window layers' batched
rows are the solo rows, and rows out of every window are dropped."""

import random

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.decode import batch as batch_module
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.prompt_cache.batch import COMPACT_AT
from dflash_mlx.prompt_cache.batch import BatchWindowKVCache
from dflash_mlx.prompt_cache.window import WindowKVCache
from conftest import assert_varied, tiny_drafter
from test_batch_decode import JoinOrderDrafter, assert_batch_differs_from_solo, drive, prompts, solo, target_of

WINDOWED = ("llama-sliding", "gemma3_text", "gemma4_text", "gpt_oss")


def window_of(target) -> int:
    """The target's one sliding window W (tokens)."""
    windows = {c.window for c in target.make_cache(1) if isinstance(c, WindowKVCache)}
    assert len(windows) == 1, windows
    return windows.pop()


def long_prompt(length: int, seed: int = 0):
    """A prompt long enough that the solo window cache has dropped rows before it joins
    (WindowKVCache drops in steps of 256)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 255) for _ in range(length)]


@pytest.mark.parametrize("family", WINDOWED)
def test_ragged_acceptance_past_the_window_equals_solo(family):
    """Four sequences (one with a 300-token prompt) join at different steps; drafts
    fully accepted, partly, never and at random, so every verify is ragged; each
    sequence runs many windows past W."""
    target, B, n = target_of(family), 6, 60
    W = window_of(target)
    ps = prompts(3, seed=11) + [long_prompt(300)]
    refs = [solo(target, p, n + B) for p in ps]
    assert_varied(refs[0][:n])
    assert all(len(p) + n > 4 * W for p in ps) and n > 4 * W  # the window drops keys
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 2, 0, None)))}
    plan = [dict(key=i, prompt=p, n=n, join=(0, 2, 5, 7)[i]) for i, p in enumerate(ps)]
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B), B), plan, chunk=64)
    for i in range(4):
        assert out[i] == refs[i][:n], f"sequence {i} differs from its solo run"


@pytest.mark.parametrize("family", WINDOWED)
def test_random_drafter_joins_stops_and_cancellations_past_the_window(family):
    """A real (random) DFlash drafter; 10 requests through a batch of at most 4, joining
    at random steps, some with stop strings, two cancelled mid-decode."""
    target, rng = target_of(family), random.Random(8)
    W = window_of(target)
    plan = [dict(key=i, prompt=p, n=rng.randint(3 * W, 60), join=rng.randint(0, 20),
                 stop=("ab",) if i % 4 == 0 else ()) for i, p in enumerate(prompts(10, seed=9))]
    plan[1]["cancel"], plan[6]["cancel"] = plan[1]["join"] + 7, plan[6]["join"] + 10
    refs = {p["key"]: solo(target, p["prompt"], p["n"], p["stop"]) for p in plan}
    assert_varied([t for r in refs.values() for t in r], at_least=40)
    assert sum(len(p["prompt"]) + len(refs[p["key"]]) > 3 * W for p in plan) >= 8
    out = drive(BatchDecoder(target, tiny_drafter(target, block_size=8), 8), plan, max_batch=4)
    for p in plan:
        got, ref = out[p["key"]], refs[p["key"]]
        if "cancel" in p:
            assert got == ref[: len(got)] and len(got) < len(ref), p["key"]
        else:
            assert got == ref, f"{p['key']} differs from its solo run"


@pytest.mark.parametrize("family", ["llama-sliding", "gpt_oss"])
def test_window_rows_equal_a_solo_cache_and_stay_bounded(family):
    """After ragged steps past the window, each sequence's visible rows of every window
    layer (keys and values, positions) are the solo cache's rows at those positions and
    cover its window; the window layers hold a bounded number of columns while the full
    layers hold the whole context."""
    target, B = target_of(family), 5
    W = window_of(target)
    ps = prompts(3, seed=7)
    refs = [solo(target, p, 150) for p in ps]
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 1, None)))}
    decoder = BatchDecoder(target, JoinOrderDrafter(scripts, B, seed=2), B)
    emitted = {i: [] for i in range(3)}
    for i, p in enumerate(ps):
        j = decoder.start(i, p, None, StopCondition(140), step_size=64)
        emitted[i] += j.advance().tokens
        decoder.drafter.assign(decoder.sequences[-1].draft_cache, i)
    for _ in range(25):
        keys = [s.key for s in decoder.sequences]
        for k, r in zip(keys, decoder.step()):
            emitted[k] += r.tokens
    assert len(decoder) == 3
    windows = [b for b in decoder.cache if isinstance(b, BatchWindowKVCache)]
    full = [b for b in decoder.cache if not isinstance(b, BatchWindowKVCache)]
    assert windows and full
    assert max(b.keys.shape[2] for b in windows) <= W - 1 + COMPACT_AT + B + 256  # one buffer step
    assert windows[0].size() < W - 1 + COMPACT_AT + B < 100 < full[0].size()
    for i, p in enumerate(ps):
        tokens = p + emitted[i][:-1]  # the last committed token is not in the cache yet
        assert len(tokens) > 5 * W
        fresh = target.make_cache()
        target(mx.array(tokens, dtype=mx.int32)[None], fresh)
        for layer, (got, want) in enumerate(zip([b.extract(i) for b in decoder.cache], fresh)):
            if not isinstance(want, WindowKVCache):
                continue
            assert isinstance(got, WindowKVCache) and got.offset == want.offset == len(tokens)
            assert W - 1 <= got.held and got.start >= want.start
            lo = got.start - want.start
            for a, b in zip(got.rows(), want.rows()):
                np.testing.assert_allclose(np.array(a), np.array(b[..., lo:, :]), rtol=1e-4, atol=1e-4,
                                           err_msg=f"sequence {i} layer {layer}")


@pytest.mark.parametrize("family", ["llama-sliding", "gemma3_text"])
def test_plain_batch_past_the_window_equals_solo(family):
    """Plain decoding (no drafter, one token per step) of five joining sequences."""
    target, n = target_of(family), 40
    W = window_of(target)
    plan = [dict(key=i, prompt=p, n=n, join=2 * i) for i, p in enumerate(prompts(5, seed=13))]
    refs = {p["key"]: solo(target, p["prompt"], n) for p in plan}
    assert_varied(refs[0])
    assert n > 4 * W
    out = drive(BatchDecoder(target, None, 1), plan)
    for p in plan:
        assert out[p["key"]] == refs[p["key"]], p["key"]


@pytest.mark.parametrize("family", ["gemma4_text", "gpt_oss"])
def test_compacting_every_step_past_the_window_keeps_every_sequence_exact(family, monkeypatch):
    """Dropping hidden columns (padding and rows out of every window) as soon as there is
    one, every step, changes nothing a sequence emits."""
    from dflash_mlx.prompt_cache import batch as batch_cache

    monkeypatch.setattr(batch_module, "compact", lambda batch: batch_cache.compact(batch, at_least=1))
    target, B, n = target_of(family), 6, 50
    ps = prompts(4, seed=14)
    refs = [solo(target, p, n + B) for p in ps]
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 3, 0, None)))}
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B, seed=3), B),
                [dict(key=i, prompt=p, n=n, join=2 * i) for i, p in enumerate(ps)])
    for i in range(4):
        assert out[i] == refs[i][:n], f"sequence {i} differs from its solo run"


@pytest.mark.parametrize("family", ["llama-sliding", "gemma4_text"])
def test_full_attention_in_window_layers_is_caught(family, monkeypatch):
    """The lossless check has power: window layers that see every row of the batch
    (no window in their mask, nothing hidden) must change the output."""
    from mlx_lm.models.cache import BatchKVCache

    monkeypatch.setattr(BatchWindowKVCache, "make_mask",
                        lambda self, N, window_size=None, **kw: BatchKVCache.make_mask(self, N))
    monkeypatch.setattr(BatchWindowKVCache, "hide_old_rows", lambda self: None)
    assert_batch_differs_from_solo(family, every=True)
