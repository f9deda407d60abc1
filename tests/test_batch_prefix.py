"""The prompt cache in a batch (issues 21/22): batched requests resume from the longest
stored prefix of their prompt (memory, and disk through a new store: a later process),
prefill only the rest and store their prompt; their greedy output equals a cold solo
run; restored caches hold the saved arrays; ``usage`` and the metrics report the reuse;
hybrid and sliding-window targets store and resume states at boundaries."""

import asyncio
import logging
import random
import shutil
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import generate_step
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.prompt_cache import layers, resume
from dflash_mlx.prompt_cache.batch_prefix import BatchPrefix
from dflash_mlx.prompt_cache.store import PrefixStore
from dflash_mlx.serve.engine import Engine
from dflash_mlx.serve.engine import GenerationJob
from dflash_mlx.serve.metrics import ServerMetrics
import conftest
from conftest import ByteTokenizer, assert_varied, tiny_drafter, tiny_target

B, STEP = 4, 8  # block size; prefill chunk
PROMPT = [(5 * i) % 200 + 3 for i in range(40)]
SHARES_30 = PROMPT[:30] + [(7 * i) % 190 + 11 for i in range(10)]  # 30 of its 40 tokens shared
EXTENDS = PROMPT + [9, 8, 7]  # the whole of PROMPT, then more
_PAIRS = {}


def pair_of(family):
    if family not in _PAIRS:
        _, target = tiny_target(family)
        _PAIRS[family] = (target, tiny_drafter(target, block_size=B))
    return _PAIRS[family]


def cold(target, drafter, ids, n):
    """The request run alone, nothing reused."""
    steps = generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=n, block_size=B,
                          prefill_step_size=STEP)
    return [t for s in steps for t in s.tokens]


def others(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randint(5, 25))] for _ in range(count)]


def run_batch(decoder, prompts, n):
    """All ``prompts`` admitted at once, prefilled one chunk per step while the batch
    decodes. Returns ``(tokens, joinings)`` per prompt, in order."""
    stop = lambda: StopCondition(n, (), (), ByteTokenizer().decode)  # noqa: E731
    joinings = [decoder.start(i, p, None, stop(), step_size=STEP) for i, p in enumerate(prompts)]
    out, waiting = [[] for _ in prompts], list(joinings)
    while waiting or len(decoder):
        if waiting:
            r = waiting[0].advance()
            if r is not None:
                out[waiting.pop(0).key] += r.tokens
        keys = [s.key for s in decoder.sequences]
        for key, r in zip(keys, decoder.step()):
            out[key] += r.tokens
    return out, joinings


def reference_caches(target, drafter, ids):
    """Both solo caches after a cold prefill of ``ids`` (chunks of STEP)."""
    cache, draft_cache = target.make_cache(B), drafter.make_cache()
    for lo in range(0, len(ids), STEP):
        _, f = target(mx.array(ids[lo:lo + STEP], dtype=mx.int32)[None], cache, drafter.target_layer_ids)
        drafter.ingest(f, draft_cache)
    return cache, draft_cache


def assert_close_layers(stored, side, caches, rows):
    """The entry's arrays of ``side`` hold ``rows`` rows, close to the caches' (another
    chunking gives other last bits)."""
    for i, c in enumerate(caches):
        ref, _ = layers.take(c)
        for name, a in ref.items():
            got = stored[f"{side}.{i}.{name}"]
            assert got.shape[-2] == rows, (side, i, name, got.shape)
            assert np.allclose(np.array(got), np.array(a[..., :rows, :]), atol=1e-4), (side, i, name)


def test_batched_requests_resume_from_memory_and_disk_exactly(tmp_path):
    target, drafter = pair_of("llama")
    n = 24
    refs = {}
    ref = lambda ids: refs.setdefault(tuple(ids), cold(target, drafter, ids, n))  # noqa: E731
    # First batch: nothing stored yet; every prompt is stored once prefilled.
    first = [PROMPT] + others(2, seed=3)
    out, joinings = run_batch(BatchDecoder(target, drafter, B, store=PrefixStore(tmp_path / "first")), first, n)
    assert_varied(out[0], at_least=10)
    assert out == [ref(p) for p in first]
    assert [j.reused for j in joinings] == [0, 0, 0]
    # Memory level: the same store; then disk level: a new store on a copy of the folder
    # as the first batch left it (a later process).
    shutil.copytree(tmp_path / "first", tmp_path / "later")
    later = others(1, seed=4)
    for store, level in ((None, "memory"), (PrefixStore(tmp_path / "later", memory_entries=0), "disk")):
        decoder = BatchDecoder(target, drafter, B, store=store or joinings[0].decoder.prefix.store)
        prompts = [SHARES_30, later[0], EXTENDS]
        out, joinings_2 = run_batch(decoder, prompts, n)
        assert out == [ref(p) for p in prompts], level
        assert [j.reused for j in joinings_2] == [30, 0, 40], level
        assert [j.source for j in joinings_2] == [level, None, level]
        assert [j.stats.prompt_prefilled for j in joinings_2] == [10, len(later[0]), 3]


def test_a_resumed_request_stores_its_whole_prompt_in_both_caches(tmp_path):
    """The entry a resumed request stores holds every row of its prompt in the target and
    the drafter caches, equal to a cold prefill's (so the restore filled both)."""
    target, drafter = pair_of("llama")
    store = PrefixStore(tmp_path)
    run_batch(BatchDecoder(target, drafter, B, store=store), [PROMPT], 5)
    _, (joining,) = run_batch(BatchDecoder(target, drafter, B, store=store), [SHARES_30], 5)
    assert joining.reused == 30
    kid = BatchPrefix(store, target, drafter, B).key()[1]
    snap, rows = PrefixStore(tmp_path, memory_entries=0).lookup(kid, SHARES_30 + [0])
    assert rows == len(snap.tokens) == len(SHARES_30)
    cache, draft_cache = reference_caches(target, drafter, SHARES_30)
    assert_close_layers(snap.arrays, "target", cache, 40)
    assert_close_layers(snap.arrays, "drafter", draft_cache, 40)


def test_restored_caches_hold_exactly_the_saved_arrays(tmp_path):
    target, drafter = pair_of("llama")
    store = PrefixStore(tmp_path)
    run_batch(BatchDecoder(target, drafter, B, store=store), [PROMPT], 5)
    prefix = BatchPrefix(PrefixStore(tmp_path, memory_entries=0), target, drafter, B)
    snap, _ = prefix.store.lookup(prefix.key()[1], SHARES_30)
    resumed = prefix.resume(SHARES_30)
    assert resumed.rows == 30 and resumed.level == "disk"
    for side, caches in (("target", resumed.cache), ("drafter", resumed.draft_cache)):
        for i, c in enumerate(caches):
            held, _ = layers.take(c)
            assert sorted(held) == ["keys", "values"]
            for name, a in held.items():
                saved = snap.arrays[f"{side}.{i}.{name}"][..., :30, :]
                assert a.shape == saved.shape and a.dtype == saved.dtype, (side, i, name)
                assert mx.array_equal(a, saved).item(), (side, i, name)


def test_a_drafter_without_a_batched_pass_refuses_the_store(tmp_path):
    from conftest import format_drafter

    target, _ = pair_of("llama")
    decoder = BatchDecoder(target, format_drafter(target, "dflash2", block_size=B), B, store=PrefixStore(tmp_path))
    assert decoder.prefix is None and "no batched pass" in decoder.prefix_off


# -- the server's batching engine ---------------------------------------------------------


class Tokenizer(conftest.ByteTokenizer):
    has_chat_template = False


def make_pair(family):
    target, drafter = pair_of(family)
    return SimpleNamespace(model=None, target=target, tokenizer=Tokenizer(), draft_path="tiny", drafter=drafter)


async def finish(job):
    text, last = "", None
    async for c in job:
        text += c.text
        last = c if c.finish_reason or c.error else last
    return text, last


def serve(pair, store, batches, n):
    """Run ``batches`` (lists of prompts) through one batching engine: each batch's
    requests at once, the batches one after another. Returns ``(text, usage)`` per prompt."""
    metrics = ServerMetrics(B)

    async def main():
        engine = Engine(pair, max_batch=4, metrics=metrics, block_size=B, prefill_step_size=STEP, store=store)
        assert isinstance(engine, Engine)
        out = []
        for prompts in batches:
            out += await asyncio.gather(*(finish(engine.submit(GenerationJob(p, n))) for p in prompts))
        engine.shutdown()
        return out

    return [(text, last.usage) for text, last in asyncio.run(main())], metrics


def text_of(pair, ids, n):
    return pair.tokenizer.decode(cold(pair.target, pair.drafter, ids, n))


def test_the_server_reports_batched_reuse(tmp_path, caplog):
    pair, n = make_pair("llama"), 16
    batches = [[PROMPT], [SHARES_30, others(1, seed=5)[0], EXTENDS]]
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        out, metrics = serve(pair, PrefixStore(tmp_path), batches, n)
    assert "prompt cache: batched requests resume from stored prefixes" in caplog.text
    prompts = [p for b in batches for p in b]
    assert [t for t, _ in out] == [text_of(pair, p, n) for p in prompts]
    reused = [u["prompt_tokens_details"]["cached_tokens"] for _, u in out]
    assert reused == [0, 30, 0, 40]
    assert [u["dflash"]["prompt_tokens_reused"] for _, u in out] == reused
    assert [u["dflash"]["prompt_tokens_prefilled"] for _, u in out] == [len(p) - r for p, r in zip(prompts, reused)]
    rendered = metrics.render().decode()
    assert 'dflash_prompt_tokens_total{source="reused"} 70.0' in rendered
    assert f'dflash_prompt_tokens_total{{source="prefilled"}} {float(sum(map(len, prompts)) - 70)}' in rendered


# Rows SHARES_30 resumes at: a Gated-DeltaNet state only at a stored boundary (16); the
# sliding-window caches of the entry at 32 still hold the rows to go back to 30.
@pytest.mark.parametrize("family,shared", [("qwen3_5", 16), ("llama-sliding", 30)])
def test_caches_that_cannot_go_back_resume_at_stored_boundaries(family, shared, tmp_path, monkeypatch):
    """A Gated-DeltaNet hybrid, or sliding-window layers past their window: each prompt is
    prefilled in chunks ending at the boundaries (every 16 tokens here, and the prompt but
    its last token) and the state at each is stored; a later prompt resumes at the last
    stored state it can use, from memory and from disk, and decodes as a cold solo run."""
    monkeypatch.setattr(resume, "DEFAULT_INTERVAL", 16)
    target, drafter = pair_of(family)
    n = 24
    refs = {}
    ref = lambda ids: refs.setdefault(tuple(ids), cold(target, drafter, ids, n))  # noqa: E731
    first = [PROMPT] + others(2, seed=3)
    decoder = BatchDecoder(target, drafter, B, store=PrefixStore(tmp_path / "first", memory_entries=16))
    assert decoder.prefix_off is None and decoder.prefix.at_boundaries
    out, joinings = run_batch(decoder, first, n)
    assert_varied(out[0], at_least=10)
    assert out == [ref(p) for p in first] and [j.reused for j in joinings] == [0, 0, 0]
    kid = decoder.prefix.key()[1]
    stored = sorted(len(PrefixStore(tmp_path / "first", memory_entries=0).lookup(kid, PROMPT[:r] + [0])[0].tokens)
                    for r in (16, 32, 39))
    assert stored == [16, 32, 39]
    shutil.copytree(tmp_path / "first", tmp_path / "later")
    later = others(1, seed=4)
    for store, level in ((None, "memory"), (PrefixStore(tmp_path / "later", memory_entries=0), "disk")):
        decoder = BatchDecoder(target, drafter, B, store=store or joinings[0].decoder.prefix.store)
        prompts = [SHARES_30, later[0], EXTENDS, PROMPT]
        out, resumed = run_batch(decoder, prompts, n)
        assert out == [ref(p) for p in prompts], level
        assert [j.reused for j in resumed] == [shared, 0, 39, 39], level
        assert [j.source for j in resumed] == [level, None, level, level]
        assert [j.stats.prompt_prefilled for j in resumed] == [40 - shared, len(later[0]), 4, 1]


def test_a_restored_boundary_state_holds_exactly_the_saved_arrays(tmp_path, monkeypatch):
    monkeypatch.setattr(resume, "DEFAULT_INTERVAL", 16)
    target, drafter = pair_of("qwen3_5")
    run_batch(BatchDecoder(target, drafter, B, store=PrefixStore(tmp_path)), [PROMPT], 5)
    prefix = BatchPrefix(PrefixStore(tmp_path, memory_entries=0), target, drafter, B)
    snap, rows = prefix.store.lookup(prefix.key()[1], SHARES_30)
    assert rows == len(snap.tokens) == 16
    resumed = prefix.resume(SHARES_30)
    assert resumed.rows == 16 and resumed.level == "disk"
    kinds = set()
    for side, caches in (("target", resumed.cache), ("drafter", resumed.draft_cache)):
        for i, c in enumerate(caches):
            held, _ = layers.take(c)
            kinds.add(layers.kind_of(c))
            for name, a in held.items():
                saved = snap.arrays[f"{side}.{i}.{name}"]
                assert a.shape == saved.shape and mx.array_equal(a, saved).item(), (side, i, name)
    assert len(kinds) >= 2  # Gated-DeltaNet states and attention KV both restored


def test_a_hybrid_batch_reuses_through_the_server(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(resume, "DEFAULT_INTERVAL", 16)
    pair, n = make_pair("qwen3_5"), 16
    batches = [[PROMPT], [SHARES_30, EXTENDS]]
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        out, metrics = serve(pair, PrefixStore(tmp_path), batches, n)
    prompts = [p for b in batches for p in b]
    assert [t for t, _ in out] == [text_of(pair, p, n) for p in prompts]
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, u in out] == [0, 16, 39]
    assert [u["dflash"]["prompt_tokens_prefilled"] for _, u in out] == [40, 24, 4]
    assert "prompt cache: batched requests resume from stored prefixes" in caplog.text
    assert "not used by batched requests" not in caplog.text
