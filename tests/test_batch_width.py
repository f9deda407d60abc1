"""``--block-size auto`` with batching (decode/batch_width.py): the width of each batched
step comes from injected step times and the pooled acceptance, and a batch whose width
changes from step to step still gives every sequence exactly its solo tokens."""

import random

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.batch_width import BatchWidths, block_widths
from dflash_mlx.decode.width import Plan
from dflash_mlx.serve.engine import Engine
from conftest import assert_varied, tiny_drafter
from test_batch_decode import JoinOrderDrafter, drive, prompts, solo, target_of


class Chooser:
    """The chooser interface (dflash_mlx.decode.width) over a BatchWidths, its clock timing each step."""

    def __init__(self, widths):
        self.widths, self.max_verify, self.started = widths, widths.trained, None

    def plan(self, n, seeded=False):
        self.started = self.widths.start()
        w = self.widths.trained if seeded else self.widths.choose(n)
        return Plan(w, w if w > 1 else 0)

    def observe(self, plan, seconds, accepted):
        self.widths.observe(self.started, plan.width, accepted)


class StepClock:
    """A clock that a step of width w with n sequences advances by ``cost(w, n)`` seconds."""

    def __init__(self, cost):
        self.cost, self.now = cost, 0.0

    def __call__(self):
        return self.now


def run(widths, clock, n, accepted_of, steps):
    """``steps`` batched steps of ``n`` sequences; ``accepted_of(w)`` gives each
    sequence's accepted drafts at width w. Returns the widths chosen."""
    chosen = []
    for _ in range(steps):
        started = widths.start()
        w = widths.choose(n)
        clock.now += clock.cost(w, n)
        widths.observe(started, w, [accepted_of(w) for _ in range(n)])
        chosen.append(w)
    return chosen


def timed_batch(target, B, plan, cost, drafter_seed, max_batch):
    """Drive ``plan`` through a batch whose widths auto chooses (:class:`BatchWidths`)
    from injected step times: choosing width w with n sequences advances the clock by
    ``cost(w, n)`` seconds. Scripted drafts follow each request's solo continuation,
    right, partly right or wrong at random. Returns ``({key: tokens}, widths chosen)``."""
    full = {p["key"]: solo(target, p["prompt"], p["n"] + B) for p in plan}
    scripts = {p["key"]: (p["prompt"] + full[p["key"]], None) for p in plan}
    clock = StepClock(None)
    widths = BatchWidths(B, clock=clock)
    chosen, choose = [], widths.choose

    def timed_choose(n):
        w = choose(n)
        chosen.append(w)
        clock.now += cost(w, n)
        return w

    widths.choose = timed_choose
    out = drive(BatchDecoder(target, JoinOrderDrafter(scripts, B, seed=drafter_seed), B, Chooser(widths)), plan,
                max_batch=max_batch)
    return out, chosen


def test_block_widths():
    assert block_widths(16) == [1, 2, 4, 8, 16]
    assert block_widths(6) == [1, 2, 4, 6]
    assert block_widths(2) == [1, 2]


def test_every_width_is_timed_twice_before_choosing():
    clock = StepClock(lambda w, n: 0.01)
    widths = BatchWidths(16, clock=clock)
    assert run(widths, clock, 4, lambda w: w - 1, 10) == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]
    assert widths.estimate(8, 4) == pytest.approx(0.01)
    assert not widths.timed(8, 5) and widths.estimate(8, 5) == pytest.approx(0.01)  # from N = 4


def test_a_new_batch_size_is_estimated_not_explored():
    """Widths timed at N = 2 only: at N = 6 each is estimated from N = 2, scaled by what
    the width run at both batch sizes took; the best estimate runs, nothing is explored."""
    cost = {(2, 2): 0.010, (4, 2): 0.012, (8, 2): 0.016, (2, 6): 0.030}
    clock = StepClock(lambda w, n: cost[(w, n)])
    widths = BatchWidths(8, clock=clock)
    widths.widths = [2, 4, 8]  # no plain steps here
    run(widths, clock, 2, lambda w: w - 1, 6)  # 2, 2, 4, 4, 8, 8
    assert widths.estimate(4, 6) == pytest.approx(0.012)  # nothing timed at 6 yet
    widths.choose = lambda n: 2
    run(widths, clock, 6, lambda w: w - 1, 2)
    del widths.choose
    assert widths.timed(2, 6) and not widths.timed(4, 6)
    assert widths.estimate(4, 6) == pytest.approx(0.012 * 3) and widths.estimate(8, 6) == pytest.approx(0.048)
    assert widths.choose(6) == 8  # right drafts: about 7 tokens for 0.048 s beat 4 for 0.036 s


def test_cheap_verify_and_right_drafts_choose_the_widest():
    clock = StepClock(lambda w, n: 0.010 + 0.0001 * w * n)
    widths = BatchWidths(16, clock=clock)
    chosen = run(widths, clock, 8, lambda w: w - 1, 60)
    assert chosen[-20:].count(16) == 20


def test_costly_wide_verify_and_poor_drafts_choose_a_narrow_width():
    """Seconds grow with w * N (a CPU), drafts 2-3 right: width 4 (3.5 tokens for a
    4-wide verify) beats 2, 8 and 16, and every ``wide_every`` steps one step is 8 wide."""
    rng = random.Random(0)
    clock = StepClock(lambda w, n: 0.01 + 0.001 * w * n)
    widths = BatchWidths(16, clock=clock)
    chosen = run(widths, clock, 8, lambda w: min(w - 1, rng.choice([2, 3])), 80)
    tail = chosen[-40:]
    assert set(tail) == {4, 8} and tail.count(8) == 5, tail


def test_poor_drafts_on_a_costly_verify_choose_plain_steps_and_probe_at_two():
    """Seconds grow with w * N and no draft is ever right: a plain step (1 token for
    the cost of a 1-wide forward) beats every width, and every ``wide_every`` steps one
    step is 2 wide, so the drafts' acceptance is still measured."""
    clock = StepClock(lambda w, n: 0.001 + 0.002 * w * n)
    widths = BatchWidths(16, clock=clock)
    tail = run(widths, clock, 8, lambda w: 0, 80)[-40:]
    assert set(tail) == {1, 2} and tail.count(2) == 5, tail
    assert widths.expected_tokens(1) == 1.0 and widths.survival()[0] < 0.1


def test_a_pause_is_not_a_timing():
    costs = {"pause": False}
    clock = StepClock(lambda w, n: 10.0 if costs["pause"] else 0.01)
    widths = BatchWidths(4, clock=clock)
    run(widths, clock, 2, lambda w: w - 1, 6)  # 1, 1, 2, 2, 4, 4
    costs["pause"] = True
    run(widths, clock, 2, lambda w: w - 1, 1)
    assert widths.estimate(4, 2) == pytest.approx(0.01) and widths.estimate(2, 2) == pytest.approx(0.01)


def test_survival_learns_where_drafts_fail():
    widths = BatchWidths(8)
    for _ in range(50):
        widths.observe(widths.start(), 8, [2, 2, 2])  # drafts 1-2 right, the third wrong
    s = widths.survival()
    assert s[0] > 0.95 and s[1] > 0.95 and s[2] < 0.05
    assert widths.expected_tokens(8) == pytest.approx(1 + sum(s[:7]))
    assert 2.9 < widths.expected_tokens(8) < 3.1


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "llama-sliding", "gemma4_text"])
def test_changing_widths_keep_every_sequence_exact(family):
    """Twelve requests joining and leaving a batch whose width changes between steps
    (every width tried at every batch size, then chosen by injected times), drafts
    right, partly right or wrong at random: each equals its solo run."""
    target, B = target_of(family), 8
    ps = prompts(12, seed=7)
    rng = random.Random(8)
    plan = [dict(key=f"r{i}", prompt=p, n=rng.randint(8, 40), join=rng.randint(0, 20)) for i, p in enumerate(ps)]
    out, chosen = timed_batch(target, B, plan, lambda w, n: 0.001 * (1 + w) * n + rng.random() * 0.002,
                              drafter_seed=9, max_batch=6)
    assert set(chosen) == {1, 2, 4, 8}
    assert_varied([t for p in plan for t in out[p["key"]]], at_least=40)
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], p["n"]), f"{p['key']} differs from its solo run"


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "llama-sliding"])
def test_plain_steps_among_chains_keep_every_sequence_exact(family):
    """Injected times that make plain steps the best (a width-w step costs w^2): the
    batch runs mostly plain steps, chains of 2 every ``wide_every`` steps. Each draft
    after plain steps is anchored where the scripted drafter expects it (so each plain
    step's context row reached the drafter) and each request equals its solo run."""
    target, B = target_of(family), 8
    ps = prompts(8, seed=17)
    rng = random.Random(18)
    plan = [dict(key=f"p{i}", prompt=p, n=rng.randint(12, 40), join=rng.randint(0, 12)) for i, p in enumerate(ps)]
    out, chosen = timed_batch(target, B, plan, lambda w, n: 0.001 * w * w * n, drafter_seed=19, max_batch=5)
    assert chosen.count(1) > len(chosen) / 2 and 2 in chosen[-20:]
    assert_varied([t for p in plan for t in out[p["key"]]], at_least=30)
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], p["n"]), f"{p['key']} differs from its solo run"


@pytest.mark.parametrize("cycle", [[1, 1, 1, 4, 1, 2, 1, 1, 4], [4, 4, 2, 4]])
def test_plain_steps_with_a_drafter_network_keep_its_context(cycle):
    """A real (tiny, random) drafter drafting the batch in one pass, widths 1, 2 and 4
    in turn (or verifies only: the drafter then takes the last verify's features as one
    array): every draft's anchor token follows exactly the context rows the drafter has
    been given for that sequence, those rows equal the target's own features of the
    sequence's tokens (one row per token, none lost or doubled by plain steps), and
    each text equals its solo run."""
    target = target_of("llama")
    drafter = tiny_drafter(target, block_size=4)
    widths = BatchWidths(4)
    plan_widths = iter(cycle * 60)
    widths.choose = lambda n: next(plan_widths)
    decoder = BatchDecoder(target, drafter, 4, Chooser(widths))
    plan = [dict(key=f"q{i}", prompt=p, n=40, join=2 * i) for i, p in enumerate(prompts(3, seed=23))]
    rows, anchors = {}, []
    join, draft = decoder.drafts.join, decoder.drafts.draft

    def joined(context, cache=None):
        rows[plan[len(rows)]["key"]] = [context]
        return join(context, cache)

    refs = {p["key"]: p["prompt"] + solo(target, p["prompt"], p["n"] + 4) for p in plan}

    seen = []

    def drafted(tokens, context, counts, width):
        seen.extend(counts)
        drafts = draft(tokens, context, counts, width).tolist()
        for i, (s, n) in enumerate(zip(decoder.sequences, counts)):
            rows[s.key] += [context[i : i + 1, :n]] if n else []
            anchors.append((s.key, sum(r.shape[1] for r in rows[s.key]), tokens[i].item()))
            mode, at = (len(anchors) + i) % 3, anchors[-1][1]
            right = (refs[s.key][at + 1 : at + width] + [0] * width)[: width - 1]
            if mode == 1:  # all right
                drafts[i] = right
            elif mode == 2:  # the last one wrong: ragged acceptance, new rows of 1..width
                drafts[i] = right[:-1] + [right[-1] ^ 1]
        return mx.array(drafts, dtype=mx.int32)

    decoder.drafts.join, decoder.drafts.draft = joined, drafted
    out = drive(decoder, plan, max_batch=3)
    assert len(anchors) >= 20
    assert {1, 2, 3} <= set(seen), "new context rows were not ragged"
    for p in plan:
        assert out[p["key"]] == solo(target, p["prompt"], p["n"])
    for key, n_rows, token in anchors:
        p = next(q for q in plan if q["key"] == key)
        assert token == (p["prompt"] + out[key])[n_rows], f"{key}: the anchor is not the token after its context"
    for p in plan:
        tokens = p["prompt"] + out[p["key"]]
        _, want = target(mx.array(tokens)[None], target.make_cache(4), drafter.target_layer_ids)
        got = mx.concatenate(rows[p["key"]], axis=1)
        np.testing.assert_allclose(np.array(got), np.array(want[:, : got.shape[1]]), rtol=1e-4, atol=1e-4)


def test_a_seeded_sampled_sequence_keeps_the_batch_at_the_block_size():
    """Seeded draws must not depend on timings: while one is active, steps verify B."""
    target = target_of("llama")
    widths = BatchWidths(8)
    widths.choose = lambda n: pytest.fail("auto chose a width with a seeded sequence active")
    decoder = BatchDecoder(target, tiny_drafter(target, block_size=8), 8, Chooser(widths))
    from dflash_mlx.decode.stopping import StopCondition
    from dflash_mlx.sampling import make_sampler
    joining = decoder.start("s", [3, 4, 5], make_sampler(1.0, 1.0, 0.0, 0, target.vocab_size),
                            StopCondition(6, (), (), None), seed=11)
    while joining.advance() is None:
        pass
    while len(decoder):
        decoder.step()
    assert joining.stats.verify["block_size"] == 8


def test_the_batch_engine_uses_auto_widths_for_auto(monkeypatch):
    """``serve --block-size auto --max-batch N`` chooses widths per step; a fixed B does not."""
    monkeypatch.setattr(Engine, "_loop", lambda self: None)  # no worker: only the wiring is checked
    target = target_of("llama")

    class Pair:
        pass

    pair = Pair()
    pair.target, pair.drafter, pair.tokenizer = target, tiny_drafter(target, block_size=8), None
    auto = Engine(pair, max_batch=4, block_size="auto")
    fixed = Engine(pair, max_batch=4, block_size=4)
    assert auto.decoder.width == 8 and auto.decoder.chooser.plan(4).width == 1  # auto times the plain step first
    assert fixed.decoder.width == 4 and all(fixed.decoder.chooser.plan(4).width == 4 for _ in range(9))
