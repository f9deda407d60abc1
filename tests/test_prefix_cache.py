"""The prefix cache (issue 22): a restore from disk in a new store (a later process) gives
the same greedy output as a cold run on every family, restored cache arrays equal the
saved ones bit for bit, longest-prefix matches resume hybrids from the nearest stored
boundary, a corrupt or truncated entry is dropped with one warning and never used, and
a writer killed with SIGKILL mid-write leaves the cache usable."""

import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from dflash_mlx import generate_step
from conftest import pair_cache as PairCache
from dflash_mlx.prompt_cache import layers
from dflash_mlx.prompt_cache.entry import restore, restore_or_warn, take_snapshot
from dflash_mlx.prompt_cache.key import key_id, pair_key
from dflash_mlx.prompt_cache.resume import trims_anywhere
from dflash_mlx.prompt_cache.store import PrefixStore
from dflash_mlx.targets.hybrid import HybridAdapter
from conftest import ROOT, ByteTokenizer, tiny_drafter, tiny_target

STEP, EVERY = 8, 16  # prefill chunk; tokens between stored states of pairs that cannot trim back
PROMPT = [(5 * i) % 200 + 3 for i in range(40)]


def cold(target, drafter, ids, n):
    steps = generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=n, block_size=4,
                          prefill_step_size=STEP)
    return [t for s in steps for t in s.tokens]


def run(pc, ids, n):
    return [t for r in pc.stream(ids, max_tokens=n, block_size=4, prefill_step_size=STEP) for t in r.tokens]


def new_process(target, drafter, root, warnings=None):
    """A PairCache over a fresh store on ``root`` with no memory level: what a later process sees."""
    warn = (warnings.append if warnings is not None else lambda m: None)
    store = PrefixStore(root, memory_entries=0, warn=warn)
    return PairCache(target, ByteTokenizer(), drafter, store=store, interval=EVERY)


def assert_same_layers(a, b):
    """Two lists of layer caches hold the same rows bit for bit and the same integers."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        (ax, ix), (ay, iy) = layers.take(x), layers.take(y)
        assert ix == iy, (i, ix, iy)
        assert sorted(ax) == sorted(ay), i
        for name in ax:
            assert ax[name].dtype == ay[name].dtype and mx.array_equal(ax[name], ay[name]).item(), (i, name)


@pytest.fixture
def pair(family):
    _, target = tiny_target(family)
    return target, tiny_drafter(target)


def test_a_restore_from_disk_in_a_new_process_is_exact(pair, tmp_path):
    target, drafter = pair
    pc = new_process(target, drafter, tmp_path)
    reply = run(pc, PROMPT, 20)
    assert reply == cold(target, drafter, PROMPT, 20)
    # The entry on disk holds the caches bit for bit.
    snap, rows = PrefixStore(tmp_path, memory_entries=0).lookup(pc.pair_key()[1], pc.tokens + [0])
    assert rows == len(pc.tokens) == len(PROMPT) + len(reply) - 1
    cache, draft_cache = target.make_cache(4), drafter.make_cache()
    restore(snap, cache, draft_cache)
    assert_same_layers(cache, pc.cache)
    assert_same_layers(draft_cache, pc.draft_cache)
    # A later process continuing the conversation prefills only the new tokens.
    cont = PROMPT + reply + [9, 8, 7]
    later = new_process(target, drafter, tmp_path)
    assert run(later, cont, 25) == cold(target, drafter, cont, 25)
    assert later.last_reused == len(PROMPT) + len(reply) - 1 and later.last_source == "disk"
    assert later.is_consistent()


def test_an_entry_of_other_layers_is_refused_with_one_warning(tmp_path):
    # An entry whose layers do not fit the pair is refused with one line (never used),
    # and a pair that meets one under its own key prefills instead, exactly.
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    pc = new_process(target, drafter, tmp_path)
    run(pc, PROMPT, 5)
    snap, _ = PrefixStore(tmp_path, memory_entries=0).lookup(pc.pair_key()[1], PROMPT + [0])
    warnings = []
    assert restore_or_warn(snap, target.make_cache(4), drafter.make_cache(), warnings.append)
    assert not restore_or_warn(snap, target.make_cache(4)[:-1], drafter.make_cache(), warnings.append)
    assert len(warnings) == 1 and "does not fit this pair" in warnings[0] and "prefilling instead" in warnings[0]
    _, other = tiny_target("qwen3_5")  # Gated-DeltaNet layers: caches of other kinds
    other_drafter = tiny_drafter(other)
    later = new_process(other, other_drafter, tmp_path, warnings)
    later.pair_key = pc.pair_key  # the other pair meets this entry under its own key
    assert run(later, PROMPT, 5) == cold(other, other_drafter, PROMPT, 5)
    assert later.last_reused == 0 and len(warnings) == 2


def test_the_longest_stored_prefix_is_resumed(pair, tmp_path):
    """A prompt sharing 30 tokens resumes at 30 where every layer can be trimmed back to
    it, and a Gated-DeltaNet hybrid from the state stored at the boundary before (16)."""
    target, drafter = pair
    run(new_process(target, drafter, tmp_path), PROMPT, 12)
    other = PROMPT[:30] + [1, 2, 3]
    later = new_process(target, drafter, tmp_path)
    assert run(later, other, 20) == cold(target, drafter, other, 20)
    assert later.last_reused == (EVERY if isinstance(target, HybridAdapter) else 30)
    assert later.is_consistent()


def test_a_boundary_state_equals_a_cold_prefill_bit_for_bit(tmp_path):
    """States stored at boundaries come from the same prefill chunks as a whole-prompt run."""
    _, target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target)
    pc = new_process(target, drafter, tmp_path)
    assert not trims_anywhere(pc.cache, pc.draft_cache)
    run(pc, PROMPT, 5)
    snap, rows = PrefixStore(tmp_path, memory_entries=0).lookup(pc.pair_key()[1], PROMPT[:EVERY] + [0])
    assert rows == EVERY == len(snap.tokens)
    cache = target.make_cache(4)
    restore(snap, cache, drafter.make_cache())
    ref = target.make_cache(4)
    for lo in range(0, EVERY, STEP):
        target(mx.array(PROMPT[lo:lo + STEP], dtype=mx.int32)[None], ref, drafter.target_layer_ids)
    assert_same_layers(cache, ref)


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_json_field"])
def test_a_corrupt_entry_is_dropped_with_one_warning(damage, tmp_path):
    _, target = tiny_target("qwen3_5")
    drafter = tiny_drafter(target)
    reply = run(new_process(target, drafter, tmp_path), PROMPT, 10)
    folder = tmp_path / key_id(pair_key(target, drafter))
    stored = sorted(folder.glob("*.safetensors"))
    assert len(stored) == 4  # boundaries 16 and 32, the prompt but its last token (39), the end of the reply
    for data in stored:
        raw = data.read_bytes()
        if damage == "truncate":
            data.write_bytes(raw[: len(raw) // 2])
        elif damage == "flip":
            data.write_bytes(raw[:-9] + bytes([raw[-9] ^ 0xFF]) + raw[-8:])
        else:
            side = data.with_suffix(".json")
            side.write_text(side.read_text().replace('"sha256"', '"sha"'))
    warnings = []
    cont = PROMPT + reply + [4, 5]
    later = new_process(target, drafter, tmp_path, warnings)
    assert run(later, cont, 20) == cold(target, drafter, cont, 20)
    assert later.last_reused == 0
    assert warnings and all(w.startswith("prompt cache: dropped a corrupt entry") and "\n" not in w for w in warnings)
    assert len(warnings) == len(stored)  # one per entry, each dropped


WRITER = """
import sys
import mlx.core as mx
from dflash_mlx.prompt_cache.entry import Snapshot
from dflash_mlx.prompt_cache.store import PrefixStore
store = PrefixStore(sys.argv[1], memory_entries=0)
big = mx.random.normal((1, 4, 1 << 18, 16))  # 64 MiB, twice a file: the kill lands mid-write
i = 0
while True:
    i += 1
    store.put(sys.argv[2], Snapshot([7, i], {"target.0.keys": big, "target.0.values": big},
                                    {"target": [{"kind": "KVCache", "ints": {"offset": 2}}]}))
"""


def test_a_writer_killed_mid_write_leaves_the_cache_usable(tmp_path):
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    reply = run(new_process(target, drafter, tmp_path), PROMPT, 10)
    kid = key_id(pair_key(target, drafter))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), kid], env=env)
    try:
        while child.poll() is None and not list((tmp_path / kid).glob(".*.tmp-*")):
            time.sleep(0.005)  # until a write is under way
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    cont = PROMPT + reply + [4, 5]
    warnings = []
    later = new_process(target, drafter, tmp_path, warnings)
    assert not list((tmp_path / kid).glob(".*.tmp-*"))  # the dead writer's temporaries are gone
    assert run(later, cont, 20) == cold(target, drafter, cont, 20)
    assert later.last_reused == len(PROMPT) + len(reply) - 1 and not warnings


def test_least_recently_used_entries_go_past_the_byte_cap(tmp_path):
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    store = PrefixStore(tmp_path, memory_entries=0)
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)
    prompts = [[k] + PROMPT[1:] for k in (11, 12, 13)]
    for p in prompts:
        run(pc, p, 5)
    kid = pc.pair_key()[1]
    sizes = sorted(f.stat().st_size for f in (tmp_path / kid).glob("*.safetensors"))
    assert store.lookup(kid, prompts[0] + [1])[1] > 0  # the first entry is now the most recently used
    store.max_bytes = 2 * sizes[-1] + 4096
    removed = store.evict()
    assert len(removed) == 1
    assert store.lookup(kid, prompts[1] + [1]) is None  # the least recently used one went
    assert store.lookup(kid, prompts[0] + [1]) and store.lookup(kid, prompts[2] + [1])


def test_the_byte_cap_holds_without_a_scan_after_every_write(tmp_path, monkeypatch):
    # A store adds its own writes to its last scan's total and scans (and evicts) again
    # when that passes the cap, or when RESCAN_S has passed (other processes' entries).
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    store = PrefixStore(tmp_path, memory_entries=0)
    scans, evict = [], store.evict
    monkeypatch.setattr(store, "evict", lambda: scans.append(1) or evict())
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)
    prompts = [[k] + PROMPT[1:] for k in (11, 12, 13, 14)]
    run(pc, prompts[0], 5)
    assert len(scans) == 1  # the first write scans
    run(pc, prompts[1], 5)
    assert len(scans) == 1  # later ones are counted
    on_disk = lambda: sum(f.stat().st_size for f in tmp_path.glob("*/*") if f.name != "key.json")  # noqa: E731
    assert store.disk_bytes == on_disk()
    store.max_bytes = on_disk() + 100
    run(pc, prompts[2], 5)
    assert len(scans) == 2 and on_disk() <= store.max_bytes  # past the cap: scanned, the oldest went
    kid = pc.pair_key()[1]
    assert store.lookup(kid, prompts[0] + [1]) is None and store.lookup(kid, prompts[2] + [1])
    other = PrefixStore(tmp_path, memory_entries=0)  # another process writes past the cap
    run(PairCache(target, ByteTokenizer(), drafter, store=other), prompts[3], 5)
    other_grew = on_disk()
    monkeypatch.setattr(store, "RESCAN_S", -1.0)
    run(pc, prompts[2], 5)
    assert len(scans) == 3 and on_disk() <= store.max_bytes < other_grew + 1


def test_another_pair_never_meets_these_entries(tmp_path):
    _, target = tiny_target("llama")
    drafter, other = tiny_drafter(target, seed=1), tiny_drafter(target, seed=5)
    run(new_process(target, drafter, tmp_path), PROMPT, 5)
    assert key_id(pair_key(target, drafter)) != key_id(pair_key(target, other))
    later = new_process(target, other, tmp_path)
    assert run(later, PROMPT + [1], 10) == cold(target, other, PROMPT + [1], 10)
    assert later.last_reused == 0


def test_a_snapshot_refuses_an_unknown_cache_kind():
    class Odd:
        offset = 0

    assert take_snapshot([], [Odd()], None) is None
    with pytest.raises(layers.LayerMismatch, match="cannot store a Odd"):
        layers.take(Odd())


def test_a_new_server_engine_resumes_from_disk_and_says_so_in_usage(tmp_path):
    """A server restarted on the same prompt cache: its first request reuses the prefix
    the previous server stored, with the cold run's tokens, and usage counts it."""
    import asyncio
    from types import SimpleNamespace

    from dflash_mlx.serve.engine import Engine, GenerationJob

    model, target = tiny_target("qwen3_5")
    pair = SimpleNamespace(model=model, target=target, tokenizer=ByteTokenizer(), drafter=tiny_drafter(target))

    async def one(ids, n):
        engine = Engine(pair, block_size=4, prefill_step_size=STEP, store=PrefixStore(tmp_path, memory_entries=0))
        job = engine.submit(GenerationJob(ids, n))
        last = None
        async for chunk in job:
            last = chunk if chunk.finish_reason else last
        engine.shutdown()
        return engine.pair_cache, last.usage

    first, _ = asyncio.run(one(PROMPT, 10))
    cont = list(first.tokens) + [4, 5, 6]
    second, u = asyncio.run(one(cont, 12))
    assert second.last_source == "disk"
    assert u["dflash"]["prompt_tokens_reused"] == len(first.tokens)
    assert u["dflash"]["prompt_tokens_reused"] + u["dflash"]["prompt_tokens_prefilled"] == u["prompt_tokens"] == len(cont)
    assert second.tokens == cont + cold(target, pair.drafter, cont, 12)[:-1]  # the reply's last token is not cached


def test_a_side_file_with_malformed_layers_is_dropped(tmp_path):
    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    reply = run(new_process(target, drafter, tmp_path), PROMPT, 10)
    for side in (tmp_path / key_id(pair_key(target, drafter))).glob("*.json"):
        if side.name != "key.json":
            side.write_text(side.read_text().replace('"KVCache"', '"NoSuchCache"'))
    warnings = []
    cont = PROMPT + reply + [4, 5]
    later = new_process(target, drafter, tmp_path, warnings)
    assert run(later, cont, 20) == cold(target, drafter, cont, 20)
    assert later.last_reused == 0 and len(warnings) == 1 and '"layers" malformed' in warnings[0]


def test_an_entry_stored_again_is_read_back_without_a_warning(tmp_path):
    """The same tokens stored again with other arrays (a batched prefill rounds differently
    from a single one): the store reads the new entry back, never its old side file."""
    from dflash_mlx.prompt_cache.entry import Snapshot

    warnings = []
    store = PrefixStore(tmp_path, memory_entries=0, warn=warnings.append)
    layers = {"target": [{"kind": "KVCache", "ints": {"offset": 2}}]}
    for value in (1.0, 2.0):
        store.put("a" * 24, Snapshot([7, 8], {"target.0.keys": mx.full((1, 1, 2, 4), value)}, layers))
        snap, rows = store.lookup("a" * 24, [7, 8, 9])
        assert rows == 2 and snap.arrays["target.0.keys"].max().item() == value
    assert not warnings, warnings


@pytest.mark.parametrize("family", ["llama-sliding", "gemma3_text"])
def test_prompt_lookup_through_kept_caches_of_a_sliding_window_target(family):
    """The caches a PairCache keeps hold the slack a copy's verify (16 rows) needs, on a sliding-window
    target without a drafter: the second turn, copying from its first, says what fresh decoding says."""
    model, target = tiny_target(family)
    pc = PairCache(target, ByteTokenizer(), None)
    first = [1, 17, 33, 2, 9, 100, 42] * 3
    reply = [t for r in pc.stream(first, max_tokens=40, prompt_lookup=True) for t in r.tokens]
    ids = first + reply + [5, 6]
    again = [t for r in pc.stream(ids, max_tokens=40, prompt_lookup=True) for t in r.tokens]
    fresh = [t for s in generate_step(mx.array(ids), target, None, max_tokens=40) for t in s.tokens]
    assert again == fresh


def test_what_auto_learned_carries_to_the_next_generation_and_process(tmp_path, monkeypatch):
    """Auto's draft survival and timings carry from one generation of a pair to the next (chat's turns), and
    through ``KEY/auto.json`` beside the pair's entries to a later process; an unreadable file is one warning,
    ignored, and written anew; the text is the target's own throughout."""
    import json

    from dflash_mlx.decode.width import WidthChooser

    _, target = tiny_target("llama")
    drafter = tiny_drafter(target)
    learned, learn = [], WidthChooser.learn
    monkeypatch.setattr(WidthChooser, "learn", lambda self, state: learned.append(learn(self, state)) or learned[-1])

    def auto(pc, ids, n):
        return [t for r in pc.stream(ids, max_tokens=n, block_size="auto", prefill_step_size=STEP) for t in r.tokens]

    live = PairCache(target, ByteTokenizer(), drafter)  # no store: this process only
    assert auto(live, PROMPT, 30) == cold(target, drafter, PROMPT, 30) and learned == []
    assert auto(live, PROMPT[:25], 20) == cold(target, drafter, PROMPT[:25], 20) and learned == [True]
    assert auto(new_process(target, drafter, tmp_path), PROMPT, 30) == cold(target, drafter, PROMPT, 30)
    path = tmp_path / key_id(pair_key(target, drafter)) / "auto.json"
    kept = json.loads(path.read_text())
    assert kept["seconds"] and sum(kept["reached"]) > 0  # plain steps and chains timed, drafts verified
    assert auto(new_process(target, drafter, tmp_path), PROMPT[:25], 20) == cold(target, drafter, PROMPT[:25], 20)
    assert learned == [True, True]
    path.write_text("{not json")
    warnings = []
    assert auto(new_process(target, drafter, tmp_path, warnings), PROMPT[:30], 10) == cold(target, drafter,
                                                                                          PROMPT[:30], 10)
    assert learned == [True, True] and len(warnings) == 1
    assert warnings[0].startswith("prompt cache: ignored what auto learned before") and "\n" not in warnings[0]
    assert json.loads(path.read_text())["seconds"]
    path.unlink()
    path.mkdir()  # cannot be replaced by a file: the write fails, the reply is whole, the store goes memory-only
    warnings = []
    later = new_process(target, drafter, tmp_path, warnings)
    assert auto(later, PROMPT[:28], 10) == cold(target, drafter, PROMPT[:28], 10)
    assert len(warnings) == 1 and "cannot write under" in warnings[0] and later.store.degraded is not None
