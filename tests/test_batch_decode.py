"""Continuous batching (decode/batch.py): every sequence of a batch emits exactly the
tokens it emits alone, with ragged acceptance (full, partial and none in one verify),
joins mid-decode, prefills in chunks, stop tokens and strings, and cancellations;
the batched cache holds, per sequence, exactly the rows of a solo cache."""

import random
from collections import Counter, deque

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache

from dflash_mlx import DFlashDrafter, GenerationStats, bind_drafter, generate_step
from dflash_mlx.decode import batch as batch_module
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.batch_join import OwnCaches
from dflash_mlx.decode.width import make_chooser
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.drafter.batch import batch_drafts, pad_contexts
from dflash_mlx.errors import InputError, RollbackError
from dflash_mlx.prompt_cache.batch import RaggedRoll, not_batchable, common_padding, extend, share_offsets
from dflash_mlx.prompt_cache.batch import BatchGatedDeltaCache
from dflash_mlx.prompt_cache.gated_delta import GatedDeltaCache
from dflash_mlx.sampling import Sampling
from dflash_mlx.targets import TargetAdapter
from conftest import ByteTokenizer, _Position, assert_varied, tiny_drafter, tiny_drafter_args, tiny_target

# attention targets, Gated-DeltaNet hybrids and sliding-window targets (more in test_batch_window.py)
BATCHED = ("llama", "qwen3", "qwen3_5", "qwen3_next", "llama-sliding", "gemma3_text", "gemma4_text", "gpt_oss")
_TARGETS = {}


def target_of(family):
    if family not in _TARGETS:
        _TARGETS[family] = tiny_target(family)[1]
    return _TARGETS[family]


def solo(target, prompt, n, stop_strings=(), stop_ids=()):
    """The request run alone: plain greedy decoding of the target."""
    stop = StopCondition(n, stop_ids, stop_strings, ByteTokenizer().decode)
    steps = generate_step(mx.array(prompt, dtype=mx.int32), target, None, stop=stop)
    return [t for s in steps for t in s.tokens]


class JoinOrderDrafter:
    """Scripted drafts per sequence: ``scripts[key] = (continuation, correct)``, given to
    a sequence's drafter cache when it joins (:meth:`assign`): its first ``correct``
    slots right, the rest wrong (``correct`` None: a random number per block, so blocks
    are fully, partly and not accepted within one batch)."""

    def __init__(self, scripts, block_size, vocab=256, seed=0, check_anchor=True):
        self.scripts, self.block_size, self.vocab = scripts, block_size, vocab
        self.check_anchor = check_anchor
        self.target_layer_ids = [1]
        self.rng = random.Random(seed)

    def make_cache(self):
        return [_Position()]

    def assign(self, cache, key):
        cache[0].sequence, cache[0].correct = self.scripts[key]

    def ingest(self, context, cache):
        cache[0].offset += context.shape[1]

    def draft(self, token, context, cache, block_size):
        c = cache[0]
        pos = c.offset = c.offset + context.shape[1]
        assert not self.check_anchor or int(token.item()) == c.sequence[pos], "t_last is not at offset + S"
        correct = self.rng.randrange(block_size) if c.correct is None else c.correct
        out = []
        for k in range(1, block_size):
            right = c.sequence[pos + k] if pos + k < len(c.sequence) else 0
            out.append(right if k <= correct else (right + 1) % self.vocab)
        return mx.array(out, dtype=mx.int32)


def drive(decoder, plan, chunk=3, max_batch=None):
    """Run a schedule: ``plan`` is a list of dicts (key, prompt, n, join, cancel, stop, sampler, seed);
    a request joins at step ``join`` or later, when fewer than ``max_batch`` are in
    (prefilled one chunk per step), leaves at step ``cancel`` (None: never). Returns
    ``{key: tokens}``."""
    out = {p["key"]: [] for p in plan}
    waiting, joining, step = deque(sorted(plan, key=lambda p: p["join"])), deque(), 0
    room = lambda: max_batch is None or len(joining) + len(decoder) < max_batch  # noqa: E731
    while waiting or joining or len(decoder):
        while waiting and waiting[0]["join"] <= step and room():
            p = waiting.popleft()
            stop = StopCondition(p["n"], (), p.get("stop", ()), ByteTokenizer().decode)
            joining.append(decoder.start(p["key"], p["prompt"], p.get("sampler"), stop, step_size=chunk,
                                         seed=p.get("seed")))
        decoder.remove([p["key"] for p in plan if p.get("cancel") is not None and p["cancel"] <= step])
        if joining:
            r = joining[0].advance()
            if r is not None:
                key = joining.popleft().key
                out[key] += r.tokens
                if r.finish_reason is None and hasattr(decoder.drafter, "assign"):
                    decoder.drafter.assign(decoder.sequences[-1].draft_cache, key)
        keys = [s.key for s in decoder.sequences]
        for key, r in zip(keys, decoder.step()):
            out[key] += r.tokens
        step += 1
    return out


def prompts(count, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("family", BATCHED)
def test_ragged_acceptance_equals_solo(family):
    """Four sequences joining at different steps; drafts fully accepted, half accepted,
    all rejected and random, so every verify is ragged."""
    target, B, n = target_of(family), 6, 60
    ps = prompts(4, seed=1)
    refs = [solo(target, p, n + B) for p in ps]
    assert_varied(refs[0][:n])
    scripts = {f"r{i}": (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 2, 0, None)))}
    decoder = BatchDecoder(target, JoinOrderDrafter(scripts, B), B)
    plan = [dict(key=f"r{i}", prompt=p, n=n, join=3 * i) for i, p in enumerate(ps)]
    out = drive(decoder, plan)
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == refs[i][:n], f"sequence {i} differs from its solo run"


@pytest.mark.parametrize("family", BATCHED)
def test_random_drafter_joins_stops_and_cancellations(family):
    """A real (random) DFlash drafter; 12 requests of random lengths through a batch,
    some with stop strings, two cancelled mid-decode (their tokens so far are a prefix
    of the solo run; the others are unaffected)."""
    target = target_of(family)
    rng = random.Random(3)
    plan = []
    for i, p in enumerate(prompts(12, seed=4)):
        plan.append(dict(key=f"r{i}", prompt=p, n=rng.randint(1, 40), join=rng.randint(0, 30),
                         stop=("ab",) if i % 3 == 0 else ()))
    plan[2]["cancel"], plan[5]["cancel"] = plan[2]["join"] + 6, plan[5]["join"] + 9
    out = drive(BatchDecoder(target, tiny_drafter(target, block_size=8), 8), plan)
    for p in plan:
        ref = solo(target, p["prompt"], p["n"], p.get("stop", ()))
        got = out[p["key"]]
        if "cancel" in p:
            assert got == ref[: len(got)] and len(got) < len(ref)
        else:
            assert got == ref, f"{p['key']} differs from its solo run"


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_cache_rows_equal_a_solo_cache(family):
    """After ragged steps, each sequence's rows of the batched cache (keys and values,
    not only offsets; a hybrid's conv and recurrent states) are those of the target run
    alone over the same tokens."""
    target, B = target_of(family), 5
    ps = prompts(3, seed=7)
    refs = [solo(target, p, 110) for p in ps]
    # No sequence keeps a whole block, so each ragged rollback also trims rows from all (mlx-lm's trim).
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 2, 1, 0)))}
    decoder = BatchDecoder(target, JoinOrderDrafter(scripts, B, seed=2), B)
    plan = [dict(key=i, prompt=p, n=100, join=i) for i, p in enumerate(ps)]
    waiting, emitted = deque(plan), {i: [] for i in range(3)}
    for step in range(9):  # part-way: all three active
        if waiting and waiting[0]["join"] <= step:
            p = waiting.popleft()
            j = decoder.start(p["key"], p["prompt"], None, StopCondition(p["n"]), step_size=64)
            emitted[p["key"]] += j.advance().tokens
            decoder.drafter.assign(decoder.sequences[-1].draft_cache, p["key"])
        keys = [s.key for s in decoder.sequences]
        for k, r in zip(keys, decoder.step()):
            emitted[k] += r.tokens
    assert len(decoder) == 3
    for i, p in enumerate(ps):
        rows = [b.extract(i) for b in decoder.cache]
        tokens = p + emitted[i][:-1]  # the last committed token is not in the cache yet
        fresh = target.make_cache()
        target(mx.array(tokens, dtype=mx.int32)[None], fresh)
        for layer, (got, want) in enumerate(zip(rows, fresh)):
            if isinstance(want, GatedDeltaCache):  # conv state, recurrent state
                pairs = list(zip(got.cache, want.cache))
            else:
                assert got.offset == want.offset == len(tokens)
                pairs = [(a[..., : want.offset, :], b[..., : want.offset, :])
                         for a, b in ((got.keys, want.keys), (got.values, want.values))]
            for a, b in pairs:
                np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4,
                                           err_msg=f"sequence {i} layer {layer}")
    full = [b for b in decoder.cache if type(b) is BatchKVCache]
    assert full and all(min(b.left_padding.tolist()) == 0 for b in full)  # columns: the longest sequence's rows


def test_ragged_roll_is_mlx_lm_roll_then_filter():
    """:class:`RaggedRoll` (each sequence's rows rolled on their own) leaves each
    sequence's rows, offset and padding as mlx-lm's ``prepare(right_padding)`` +
    ``finalize()`` then ``filter`` (which drops the padding every sequence has) do."""
    rng = np.random.default_rng(3)
    right = [1, 0, 3]

    def cache() -> BatchKVCache:
        b = BatchKVCache([2, 5, 3])
        k = mx.array(rng.standard_normal((3, 2, 10, 4)).astype(np.float32))
        b.update_and_fetch(k, k + 1)
        return b

    mine, theirs = cache(), cache()
    theirs.keys, theirs.values = mine.keys, mine.values
    drop = common_padding(mine, right)
    assert drop == 3
    RaggedRoll(right, drop)(mine)
    theirs.prepare(right_padding=right)
    theirs.finalize()
    theirs.filter(mx.arange(3))
    assert mine._idx == theirs._idx == 7
    assert mine.left_padding.tolist() == theirs.left_padding.tolist() == [0, 2, 3]
    assert mine.offset.tolist() == theirs.offset.tolist() == [7, 5, 4]
    for i in range(3):
        a, b = mine.extract(i), theirs.extract(i)
        assert a.offset == b.offset
        np.testing.assert_array_equal(np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]))
        np.testing.assert_array_equal(np.array(a.values[..., : a.offset, :]), np.array(b.values[..., : b.offset, :]))



def test_shared_offsets_are_never_updated_in_place():
    """``share_offsets`` relies on mlx-lm's ``BatchKVCache`` replacing its offset array,
    never updating it in place: after every cache operation a batch uses, each of two
    layers sharing one offset object holds what it would alone."""
    def layer() -> BatchKVCache:
        b = BatchKVCache([2, 0])
        k = mx.ones((2, 1, 6, 4))
        b.update_and_fetch(k, k)
        return b

    shared, alone = [layer(), layer()], [layer(), layer()]
    for step in range(2):
        share_offsets(shared)
        assert shared[0].offset is shared[1].offset
        for b in shared + alone:
            b.update_and_fetch(mx.ones((2, 1, 3, 4)), mx.ones((2, 1, 3, 4)))
            b.trim(1)
            RaggedRoll([1, 0], 0)(b)
            b.prepare(right_padding=[0, 1])
            b.finalize()
            b.filter(mx.arange(2))
        for b, want in zip(shared, alone):
            assert b.offset.tolist() == want.offset.tolist(), f"step {step}"


def assert_batch_differs_from_solo(family: str, B: int = 6, n: int = 40, every: bool = False) -> None:
    """Three sequences (blocks fully, partly and not accepted) batched on ``family``:
    at least one output (``every``: each one) must differ from its solo run (for tests
    of a broken rollback or mask)."""
    target = target_of(family)
    ps = prompts(3, seed=1)
    refs = [solo(target, p, n + B) for p in ps]
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 2, 0)))}
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B, check_anchor=False), B),
                [dict(key=i, prompt=p, n=n, join=0) for i, p in enumerate(ps)])
    differs = [out[i] != refs[i][:n] for i in range(3)]
    assert all(differs) if every else any(differs), differs


def test_broken_per_sequence_rollback_is_caught(monkeypatch):
    """The lossless check has power: trimming every sequence by the batch's fewest
    rejected rows (no per-sequence rollback) must change the output."""
    real = TargetAdapter.rollback
    monkeypatch.setattr(TargetAdapter, "rollback", lambda self, cache, rejected: real(
        self, cache, [min(rejected)] * len(rejected) if isinstance(rejected, list) else rejected))
    assert_batch_differs_from_solo("llama")


def test_broken_recurrent_rollback_is_caught(monkeypatch):
    """For a hybrid, rolling every sequence's Gated-DeltaNet state back to the batch's
    longest kept prefix (no per-sequence replay) must change the output."""
    real = BatchGatedDeltaCache.trim_ragged
    monkeypatch.setattr(BatchGatedDeltaCache, "trim_ragged", lambda self, rejected: real(
        self, [min(rejected)] * len(rejected)))
    assert_batch_differs_from_solo("qwen3_5")


def test_a_refused_batch_rollback_changes_no_layer():
    """The one rollback routine on a batch (per-sequence counts): a count beyond a Gated-DeltaNet layer's
    last forward is a RollbackError naming the layer, raised before any layer, attention included, is
    trimmed; counts within it trim each sequence by its own."""
    target, batch = target_of("qwen3_5"), None
    for p in prompts(2, seed=5):
        cache = target.make_cache(4)
        target(mx.array([p], dtype=mx.int32), cache)
        batch = extend(batch, cache)
    target(mx.array([[3, 4, 5, 6], [7, 8, 9, 10]], dtype=mx.int32), batch)
    full = [b for b in batch if type(b) is BatchKVCache]
    recurrent = [b for b in batch if isinstance(b, BatchGatedDeltaCache)]
    offsets, states = [b.offset.tolist() for b in full], [list(b.cache) for b in recurrent]
    assert full and recurrent
    with pytest.raises(RollbackError, match=r"target layer \d+: BatchGatedDeltaCache cannot remove its last \[5, 0\]"):
        target.rollback(batch, [5, 0])
    assert [b.offset.tolist() for b in full] == offsets
    assert all(a is b for r, s in zip(recurrent, states) for a, b in zip(r.cache, s))
    target.rollback(batch, [3, 1])
    assert [b.offset.tolist() for b in full] == [[o[0] - 3, o[1] - 1] for o in offsets]


def plain_decoder(target, ahead: bool) -> BatchDecoder:
    """A decoder without a drafter that dispatches each plain step's next before reading it where ``ahead`` and the
    target's caches can take it back (a GatedDeltaCache replays its last forward only); never on a CPU."""
    decoder = BatchDecoder(target, None, 1)
    assert decoder.ahead is (mx.default_device() == mx.gpu and target.rollback_spans_forwards)
    decoder.ahead = ahead and target.rollback_spans_forwards
    return decoder


@pytest.mark.parametrize("ahead", [True, False])
def test_a_seeded_sequence_samples_the_same_whoever_joins_or_leaves(ahead):
    """Plain steps dispatched a step early (as on a GPU; ``ahead``): a sequence joining or leaving takes that step
    back, its rows and its draws: a seeded sampled sequence decodes the same text alone and among others coming and
    going. The same without dispatching ahead (as on a CPU)."""
    target = target_of("llama")
    seeded = dict(key="seeded", prompt=[3, 4, 5], n=40, join=0, sampler=Sampling(1.0), seed=7)
    mates = [dict(key=i, prompt=p, n=4 + 3 * i, join=1 + 2 * i, sampler=Sampling(0.8)) for i, p in
             enumerate(prompts(4, seed=6))]
    alone = drive(plain_decoder(target, ahead), [seeded])["seeded"]
    crowded = drive(plain_decoder(target, ahead), [seeded] + mates)["seeded"]
    other = drive(plain_decoder(target, ahead), [dict(seeded, seed=8)])["seeded"]
    assert_varied(alone)
    assert crowded == alone and other != alone


@pytest.mark.parametrize("tree_budget", [6, "auto"])
def test_a_batch_refuses_trees(tree_budget):
    """A tree verifies one sequence in its own caches: a batched decoder given tree plans refuses them at once."""
    target = target_of("llama")
    drafter = tiny_drafter(target, block_size=4)
    chooser = make_chooser(target, drafter, 4, tree_budget)
    with pytest.raises(InputError, match="trees verify one sequence"):
        BatchDecoder(target, drafter, 4, chooser)
    BatchDecoder(target, drafter, 4, chooser, caches=OwnCaches())


def test_each_result_says_what_ran_and_the_stats_count_exactly_that():
    """A step's result carries its source, width, drafts and time; the sequence's stats are those results
    counted (the one place steps are recorded), its tokens included."""
    target = target_of("llama")
    stats = GenerationStats(block_size=4)
    results = list(generate_step(mx.array([1, 5, 9, 5, 9, 5, 9], dtype=mx.int32), target,
                                 tiny_drafter(target, block_size=4), max_tokens=60, block_size="auto",
                                 prompt_lookup=True, stats=stats))
    first, steps = results[0], results[1:]
    assert first.source is None and {r.source for r in steps} <= {"plain", "chain", "lookup"}
    widths = Counter("plain" if r.source == "plain" else f"{r.source} {r.width}" for r in steps)
    assert len(widths) >= 2 and dict(widths) == stats.widths
    assert sum(r.drafted for r in steps) == stats.drafted and sum(r.probe for r in steps) == stats.probe_steps
    assert sum(len(r.tokens) for r in results) == stats.generation_tokens
    assert sum(r.seconds for r in steps) == pytest.approx(sum(stats.mode_s.values()))


@pytest.mark.parametrize("waiting", [False, True])
def test_auto_in_a_batch_is_told_what_each_reply_has_left_unless_requests_wait(waiting):
    """Where nothing waits to join, a batch ends with its last reply: each plan gets every sequence's key and tokens
    left, for the chooser to weigh chains by the slowest; where the server says requests wait, none."""
    target = target_of("llama")
    drafter = tiny_drafter(target, block_size=4)
    decoder = BatchDecoder(target, drafter, 4, make_chooser(target, drafter, "auto", None))
    seen, plan = [], decoder.chooser.plan
    decoder.chooser.plan = lambda n, seeded, behind=None: seen.append(behind) or plan(n, seeded, behind)
    decoder.waiting = waiting
    drive(decoder, [{"key": k, "prompt": p, "n": 12, "join": 0} for k, p in zip("ab", prompts(2))])
    both = [dict(b) for b in seen if b is not None and len(b) == 2]
    if waiting:
        assert seen and all(b is None for b in seen)
    else:
        assert len(both) >= 3 and all(set(b) == {"a", "b"} and 0 < min(b.values()) <= 11 for b in both)
        assert both[-1]["a"] < both[0]["a"]


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4_text", "gpt_oss"])
def test_plain_batch_equals_solo(family, ahead):
    """Plain steps dispatched a step early (``ahead``, as on a GPU; taken back as sequences join and leave) or not
    (as on this CPU) decode as one at a time."""
    target = target_of(family)
    plan = [dict(key=i, prompt=p, n=25, join=2 * i) for i, p in enumerate(prompts(5, seed=9))]
    out = drive(plain_decoder(target, ahead), plan)
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], 25)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "llama-sliding", "gpt_oss",
                                    "gemma3_text", "gemma4_text"])
def test_every_family_batches(family):
    """Attention, hybrid and sliding-window targets all have a batched cache."""
    assert not_batchable(tiny_target(family)[1]) is None


def test_not_batchable_names_the_reason():
    """A layer cache with no batched form (here mlx-lm's RotatingKVCache, which our
    targets replace) is refused, naming the layer and the cache."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    class Odd:
        def make_cache(self, max_verify):
            return [KVCache(), RotatingKVCache(8)]

    reason = not_batchable(Odd())
    assert "layer 1" in reason and "RotatingKVCache" in reason and "no batched form" in reason


@pytest.mark.parametrize("compiled,fast_exp,fmt", [("1", "1", None), ("0", "1", None), ("1", "0", None),
                                                   ("1", "1", "dspark"), ("0", "1", "dspark"),
                                                   ("1", "1", "dflash-block7")])
def test_one_drafter_pass_drafts_as_each_sequence_alone(compiled, fast_exp, fmt, monkeypatch):
    """The batched drafter pass (ragged new context rows, different context lengths),
    with its block halves compiled and not, its attention with the CPU's fast exp and
    MLX's fused one, gives every sequence the drafts and context cache rows of its own
    drafter run; for a DSpark drafter (``fmt``) its anchor-first rows and the Markov
    head's walk over the batch too."""
    from conftest import format_drafter

    monkeypatch.setenv("DFLASH_COMPILE", compiled)
    monkeypatch.setenv("DFLASH_FAST_EXP", fast_exp)

    target = target_of("llama")
    drafter = tiny_drafter(target, block_size=6) if fmt is None else format_drafter(target, fmt, block_size=6)
    batch = batch_drafts(drafter)
    assert batch is not None
    rng = np.random.default_rng(0)
    F = len(drafter.target_layer_ids) * target.hidden_size
    solos, tokens = [], [mx.array([t], dtype=mx.int32) for t in (5, 77, 130)]
    for P in (3, 9, 1):
        prompt = mx.array(rng.standard_normal((1, P, F)).astype(np.float32))
        batch.join(prompt)
        solos.append(drafter.make_cache())
        drafter.ingest(prompt, solos[-1])
    for step in range(3):
        contexts = [None if step == 0 else mx.array(rng.standard_normal((1, int(s), F)).astype(np.float32))
                    for s in rng.integers(1, 6, size=3)]
        rows = [0 if c is None else c.shape[1] for c in contexts]
        got = batch.draft(mx.concatenate(tokens), pad_contexts(contexts, rows), rows, 6)
        for i, (context, cache) in enumerate(zip(contexts, solos)):
            if context is None:
                context = mx.zeros((1, 0, F))
            want = drafter.propose(tokens[i], context, cache, 6)
            assert got[i].tolist() == want.tokens.tolist(), f"step {step} sequence {i}"
    assert all(min(c.left_padding.tolist()) == 0 for c in batch.cache)  # no column is padding in every row
    for i, cache in enumerate(solos):
        for got, want in zip([b.extract(i) for b in batch.cache], cache):
            assert got.offset == want.offset
            np.testing.assert_allclose(np.array(got.keys[..., : got.offset, :]),
                                       np.array(want.keys[..., : want.offset, :]), rtol=1e-4, atol=1e-5)


def test_drafters_without_a_batched_pass_draft_per_sequence():
    from conftest import format_drafter

    target = target_of("llama")
    assert batch_drafts(format_drafter(target, "dflash2")) is None
    assert batch_drafts(format_drafter(target, "v1-sliding")) is None
    plan = [dict(key=i, prompt=p, n=30, join=i) for i, p in enumerate(prompts(3, seed=12))]
    out = drive(BatchDecoder(target, format_drafter(target, "v1-sliding", block_size=5), 5), plan)
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], 30)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("fmt", ["dspark", "dflash-block7"])
def test_dspark_drafters_batch(family, fmt):
    """DSpark drafters draft a batch in one pass (anchor-first rows, the Markov head walked for every sequence
    at once): requests joining at different steps, one with a stop string, each equal their solo run."""
    from conftest import format_drafter

    target = target_of(family)
    drafter = format_drafter(target, fmt)
    assert batch_drafts(drafter) is not None
    plan = [dict(key=i, prompt=p, n=30, join=2 * i, stop=("ab",) if i == 1 else ())
            for i, p in enumerate(prompts(4, seed=7))]
    out = drive(BatchDecoder(target, drafter, 8), plan)
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], 30, p["stop"])


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_200_requests_equal_their_solo_runs(family):
    """200 requests of random prompts and lengths, a third with stop strings, a fifth
    cancelled mid-decode, joining at random steps (at most 8 decode at once), drafts
    accepted fully, partly or not at random: each equals its solo run (a prefix of it
    when cancelled)."""
    target, B, rng = target_of(family), 6, random.Random(21)
    plan, join = [], 0
    for i, p in enumerate(prompts(200, seed=22)):
        join += rng.choice([0, 0, 1, 3])
        plan.append(dict(key=i, prompt=p, n=rng.randint(1, 24), join=join,
                         stop=("ab", "e") if rng.random() < 0.33 else (),
                         cancel=join + rng.randint(1, 12) if rng.random() < 0.2 else None))
    full = {p["key"]: solo(target, p["prompt"], p["n"] + B) for p in plan}  # what the scripted drafts follow
    # Greedy decoding of n tokens is the first n of n + B: only stop strings need a run of their own.
    refs = {p["key"]: solo(target, p["prompt"], p["n"], p["stop"]) if p["stop"] else full[p["key"]][:p["n"]]
            for p in plan}
    scripts = {p["key"]: (p["prompt"] + full[p["key"]], None) for p in plan}
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B, seed=5), B), plan, max_batch=8)
    assert_varied([t for r in refs.values() for t in r], at_least=100)
    cancelled = 0
    for p in plan:
        got, ref = out[p["key"]], refs[p["key"]]
        if p["cancel"] is not None and len(got) < len(ref):
            cancelled += 1
            assert got == ref[: len(got)], p["key"]
        else:
            assert got == ref, p["key"]
    assert cancelled >= 10


@pytest.mark.parametrize("prompt,n,words", [([], 5, "prompt is empty"), ([1, 2], 0, "max_tokens must be at least 1")])
def test_bad_requests_are_refused_before_anything_runs(prompt, n, words):
    from dflash_mlx.errors import InputError

    decoder = BatchDecoder(target_of("llama"), None, 1)
    with pytest.raises(InputError, match=words):
        decoder.start("x", prompt, None, StopCondition(n))
    assert len(decoder) == 0 and decoder.cache is None


def test_compacting_padding_every_step_keeps_every_sequence_exact(monkeypatch):
    """Dropping the common padding columns as soon as there is one (instead of 32)
    changes nothing a sequence emits."""
    from dflash_mlx.prompt_cache import batch as batch_cache

    monkeypatch.setattr(batch_module, "compact", lambda batch: batch_cache.compact(batch, at_least=1))
    target, B, n = target_of("llama"), 6, 60
    ps = prompts(4, seed=1)
    refs = [solo(target, p, n + B) for p in ps]
    scripts = {f"r{i}": (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 2, 0, None)))}
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B), B),
                [dict(key=f"r{i}", prompt=p, n=n, join=3 * i) for i, p in enumerate(ps)])
    for i in range(4):
        assert out[f"r{i}"] == refs[i][:n]


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_prompt_lookup_in_a_batch_equals_solo(family, monkeypatch):
    """Prompt lookup in a batch: each sequence's copies (scripted: all right, half right, wrong from the first,
    none at every third step) verified beside the others' DFlash chains (cut to the chain's width) in one forward,
    or, without a drafter, where every sequence copies: every sequence emits its solo greedy tokens; trimming every
    sequence by the batch's fewest rejected rows changes some output."""
    from test_lossless import ScriptedLookup

    target, B, n = target_of(family), 6, 48
    ps = prompts(4, seed=3)
    refs = [solo(target, p, n + 16) for p in ps]
    assert_varied(refs[0][:n])

    class Lookup(ScriptedLookup):  # sequence i copies its own reference, with no match every third step
        def __init__(self, tokens):
            i = next(i for i, p in enumerate(ps) if tokens[:len(p)] == p)
            super().__init__(tokens, ps[i], refs[i])
            self.calls = i

        def propose(self, limit=15):
            self.calls += 1
            return [] if self.calls % 3 == 0 else super().propose(limit)

    verifies, real_copied = [], batch_module.copied  # (any copy, all copy) of each verify
    monkeypatch.setattr(batch_module, "PromptLookup", Lookup)
    monkeypatch.setattr(batch_module, "copied", lambda copies, chains: verifies.append(
        (any(copies), all(copies))) or real_copied(copies, chains))
    scripts = {i: (p + r, c) for i, (p, r, c) in enumerate(zip(ps, refs, (B - 1, 2, 0, None)))}
    plan = [dict(key=i, prompt=p, n=n, join=2 * i) for i, p in enumerate(ps)]
    for drafter, width, kind in ((JoinOrderDrafter(scripts, B, check_anchor=False), B, (True, False)),
                                 (None, 1, (True, True))):
        verifies.clear()
        out = drive(BatchDecoder(target, drafter, width, lookup=True), plan)
        assert all(out[i] == refs[i][:n] for i in range(len(ps))), family
        assert verifies.count(kind) >= 3, verifies  # copies beside chains; without a drafter, all copying
    real = TargetAdapter.rollback
    monkeypatch.setattr(TargetAdapter, "rollback", lambda self, cache, rejected: real(
        self, cache, [min(rejected)] * len(rejected) if isinstance(rejected, list) else rejected))
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B, check_anchor=False), B, lookup=True), plan)
    assert any(out[i] != refs[i][:n] for i in range(len(ps)))


def test_a_quantized_drafter_with_a_draft_vocabulary_decodes_in_another_thread():
    """dflash serve steps its batch in a worker thread: nothing the loader left lazy may belong to the loading
    thread's stream (a quantized drafter dequantized on a CPU, its draft vocabulary's head and ids)."""
    import threading

    import mlx.nn as nn

    from dflash_mlx.drafter.vocab import set_draft_vocab

    target = target_of("llama")
    mx.random.seed(2)
    drafter = DFlashDrafter(tiny_drafter_args(target))
    nn.quantize(drafter, group_size=32, bits=8)
    set_draft_vocab(drafter, mx.arange(0, target.vocab_size, 2))
    drafter = bind_drafter(drafter, target)
    out, errors = {}, []

    def serve():
        try:
            out.update(drive(BatchDecoder(target, drafter, 4), [dict(key=i, prompt=p, n=12, join=0)
                                                                  for i, p in enumerate(prompts(2, seed=4))]))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join()
    assert not errors and all(len(v) == 12 for v in out.values()), errors
