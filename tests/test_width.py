"""The width chooser (dflash_mlx.decode.width) through its interface, with scripted step
seconds and acceptance: no clock decides what is checked."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_mlx.decode.width import (AUTO, DECAY, FIRST_GAP, MAX_GAP, PLAIN_MARGIN, PROBE_EVERY, Plan, WidthChooser,
                                     make_chooser, parse_block_size, parse_tree_budget)
from dflash_mlx.errors import InputError

B = 16
STAY = 1 - 1 / PROBE_EVERY  # the share of steps left to the best option by the probes


def seconds_of(plan: Plan, n: int = 1) -> float:
    """A machine where a step costs 1 ms, plus 0.05 ms per verified token per sequence,
    plus 1 ms to draft."""
    return 1e-3 + 5e-5 * plan.width * n + (1e-3 if plan.block else 0.0)


def run(chooser, steps, accept, n=1, seeded=False, cost=seconds_of, tokens=None):
    """Runs ``steps`` planned steps; ``accept(k)`` says whether draft k of a block is
    right. Returns the plans, in order (and appends each step's committed tokens to ``tokens``)."""
    plans = []
    for _ in range(steps):
        plan = chooser.plan(n, seeded)
        accepted = []
        for _ in range(n):
            a = 0
            while a < plan.width - 1 and accept(a + 1):
                a += 1
            accepted.append(a)
        chooser.observe(plan, cost(plan, n), accepted)
        plans.append(plan)
        if tokens is not None:
            tokens.append(sum(accepted) + n)
    return plans


def fake_drafter(block_size=B, tree=False):
    drafter = SimpleNamespace(block_size=block_size)
    if tree:
        drafter.propose = lambda *a: None
    return drafter


def auto():
    return make_chooser(None, fake_drafter(), AUTO, None)


def test_a_drafter_that_always_agrees_gets_the_widest_block():
    plans = run(auto(), 200, lambda k: True)
    assert sum(p == Plan(B, B) for p in plans[-64:]) >= 64 * STAY


def test_a_drafter_that_never_agrees_gets_plain_steps():
    plans = run(auto(), 400, lambda k: False)
    tail = plans[-200:]
    assert all(p.block == 0 for p in tail if p.width == 1)
    assert sum(p.width == 1 for p in tail) >= STAY * len(tail)  # probes only in between


def test_the_probe_brings_drafting_back_when_drafts_start_to_agree():
    chooser = auto()
    plans = run(chooser, 300, lambda k: False)
    assert sum(p.width == 1 for p in plans[-64:]) >= 64 * STAY
    plans = run(chooser, 20 * PROBE_EVERY, lambda k: True)
    assert sum(p.width == B for p in plans[-64:]) >= 64 * STAY


def test_draft_survival_keeps_learning_in_a_long_run():
    """1,000 steps whose drafts are all right, then 400 whose drafts never are: auto goes back to plain steps (the
    evidence never grows beyond what DECAY lets it weigh; rescaled by 1e9 when the prior came near underflow, it
    outweighed every later step, and no step of the last 200 was plain)."""
    chooser = auto()
    run(chooser, 1000, lambda k: True)
    plans = run(chooser, 400, lambda k: False)
    assert sum(p.width == 1 for p in plans[-200:]) >= 200 * STAY and max(chooser.survival.reached) < 1 / (1 - DECAY)


def chat_costs(plan, n=1):
    """SmolLM2-135M's steps on MT-Bench as traced on one CPU core, relative to a plain step's 112 ms: chains of 2, 4,
    8 and 16 cost 1.25, 1.27, 1.43 and 2.0 of it."""
    return 1e-3 * {1: 1.0, 2: 1.25, 4: 1.27, 8: 1.43, 16: 2.0}[plan.width] * n


def after_a_good_start(first_draft, seed):
    """100 steps whose drafts are right 60% of the time, then 400 whose first draft is right at ``first_draft`` and
    later ones at 0.2: the 400 steps' plans and their committed tokens per plain step's time."""
    rng, tokens = random.Random(seed), []
    chooser = auto()
    run(chooser, 100, lambda k: rng.random() < 0.6, cost=chat_costs)
    plans = run(chooser, 400, lambda k: rng.random() < (first_draft if k == 1 else 0.2), cost=chat_costs, tokens=tokens)
    return plans, sum(tokens) * chat_costs(Plan(1, 0)) / sum(chat_costs(p) for p in plans)


def test_a_drafter_that_stops_agreeing_is_left_within_a_few_steps():
    """After a good start the drafts never agree again: the run of misses is unlikely under what was learned, so the
    older evidence is cut and auto is back on plain steps within a few steps, not after its long memory fades."""
    speeds = [after_a_good_start(0.0, seed)[1] for seed in range(20)]
    assert min(speeds) >= 0.96 and sum(speeds) / 20 >= 0.97


def test_a_drafter_that_misses_often_but_pays_keeps_its_chains():
    """Chat-like drafts near break-even (first draft right 35% of the time; a chain of 4 pays from 0.28 drafts a
    step): a few misses in a row must not send auto to plain steps, where no evidence comes back."""
    runs = [after_a_good_start(0.35, seed) for seed in range(20)]
    assert sum(sum(p.width > 1 for p in plans) for plans, _ in runs) >= 0.9 * 20 * 400
    assert sum(speed for _, speed in runs) / 20 >= 1.1


def test_a_width_whose_deep_drafts_were_never_verified_is_tried_on_its_best_case():
    """A chain costs 3 plain steps whatever its width (a tiny target: the draft's fixed cost is most of it); draft 1
    is right half the time, and the rest whenever it is. Chains of 2 lose to plain steps; chains of 8 pay (4.5
    tokens a step). Their best case counts the positions never verified as right, so they are tried and carry 5 runs
    of 300 steps (with PRIOR there, a chain of 8 looked no better than 2.2 tokens: 2 of the 5 stayed plain)."""
    for seed in range(5):
        rng = random.Random(seed)
        plans = run(auto(), 300, lambda k: k > 1 or rng.random() < 0.5,
                    cost=lambda plan, n: 1e-3 * (1 if plan.width == 1 else 3))
        assert sum(p.width >= 8 for p in plans[-100:]) >= 100 * STAY - 5, seed


def test_a_probe_whose_first_run_rules_it_out_does_not_run_again():
    """Drafts 1-3 always right, 4 on never: a chain of 8 not yet timed is promised 8 tokens (its unverified drafts
    counted right) against the chain of 4's 4, and probed. Its first run is left out of its timings (it pays the
    shape's setup), but its drafts show it commits 4 tokens for 1.5x the time: it is not run a second time."""
    plans = run(auto(), 200, lambda k: k <= 3, cost=width_costs)
    widths = [p.width for p in plans]
    assert 8 in widths and all(a != 8 or b != 8 for a, b in zip(widths, widths[1:]))
    assert sum(w == 4 for w in widths[-100:]) >= 100 * STAY


def test_a_middling_drafter_gets_a_middle_width():
    rng = random.Random(0)
    plans = run(auto(), 600, lambda k: rng.random() < 0.7)
    widths = [p.width for p in plans[-200:]]
    assert 2 < max(set(widths), key=widths.count) < B


def test_batched_steps_get_their_own_timing():
    chooser = auto()
    run(chooser, 100, lambda k: True, n=1)

    def costly_batch(plan, n):  # at n = 4 each verified token costs as much as a step
        return 1e-3 + (1e-3 * plan.width * n if n > 1 else 5e-5 * plan.width) + (1e-3 if plan.block else 0.0)

    rng = random.Random(1)
    plans = run(chooser, 400, lambda k: rng.random() < 0.5, n=4, cost=costly_batch)
    alone = run(chooser, 100, lambda k: True, n=1, cost=costly_batch)[-4 * PROBE_EVERY:]  # acceptance relearnt
    assert sum(p.width == B for p in alone) >= 4 * PROBE_EVERY - 4
    assert sum(p.width == 1 for p in plans[-100:]) >= 80


def test_a_batch_nothing_waits_on_is_paced_by_its_slowest_reply():
    """Four replies, one whose drafts never agree: a chain of 16 commits 12.25 tokens a sequence on average for 5
    plain steps' time, but the batch lasts as long as the fourth reply, which every chain moves one token. Where
    nothing waits to join (``behind`` given), auto decodes plainly; where requests wait, it drafts 16 wide; where
    every reply's drafts agree, 16 wide either way."""
    def cost(plan, n):
        return 1e-3 if plan.width == 1 else 1e-3 + 2.5e-4 * plan.width

    def batch(behind, agree=3):
        chooser, plans = auto(), []
        for _ in range(400):
            plans.append(plan := chooser.plan(4, False, behind))
            chooser.observe(plan, cost(plan, 4), [plan.width - 1] * agree + [0] * (4 - agree))
        return plans[-100:]

    behind = [(key, 500) for key in "abcd"]
    assert sum(p.width == 1 for p in batch(behind)) >= 100 * STAY
    assert sum(p.width == B for p in batch(None)) >= 100 * STAY
    assert sum(p.width == B for p in batch(behind, agree=4)) >= 100 * STAY


def test_a_batch_is_expected_to_last_as_long_as_its_slowest_reply_not_its_mean_one():
    """Eight replies, 100 tokens left each, whose chains of 4 accept 0, 1, 2 or 3 drafts alike (1 to 4 tokens a step,
    2.5 on average): the batch ends when the last reply does, after more than 100 / 2.5 = 40 steps. What a chain is
    expected to commit per step of the batch is checked against a simulation of such batches."""
    chooser = auto()
    for _ in range(300):
        chooser.observe(Plan(4, 4), 1e-3, [0, 1, 2, 3] * 2)
    assert chooser.expected_tokens(Plan(4, 4)) == pytest.approx(2.5, rel=1e-3)  # one reply: its mean
    chooser.plan(8, False, [(key, 100) for key in range(8)])
    rng = np.random.default_rng(0)
    done = np.cumsum(rng.integers(1, 5, size=(20000, 8, 100)), axis=-1) >= 100  # 20,000 batches of 8
    slowest = (done.argmax(axis=-1) + 1).max(axis=-1).mean()  # steps until the last reply has its 100 tokens
    assert slowest > 42
    assert chooser.expected_tokens(Plan(4, 4)) == pytest.approx(100 / slowest, rel=0.02)


@pytest.mark.parametrize("two, four, eight", [(0.22, 0.33, 0.55), (0.34, 0.33, 0.34)])
def test_an_untimed_wider_chain_is_promised_the_growth_the_timed_chains_show(two, four, eight):
    """A CPU's verify grows with the tokens it feeds: after chains of 2 and 4 took 220 and 330 ms at 8 sequences, a
    chain of 8 not yet timed is promised its best case over 330 + 4 x 55 ms, not over 330; where they took about
    the same (a GPU), over the slowest timed option."""
    chooser = auto()
    for plan, seconds in [(Plan(1, 0), 0.14), (Plan(2, 2), two), (Plan(4, 4), four)]:
        for _ in range(2):  # the first run of a shape is left out
            chooser.observe(plan, seconds, [1] * 8 if plan.width > 1 else [0] * 8)
    assert chooser.promise(Plan(8, 8), 8) == pytest.approx(8 * chooser.expected_tokens(Plan(8, 8), 1.0) / eight)


def width_costs(plan, n=1):
    """A machine where each verified token costs 0.5 ms besides 1 ms a step and 1 ms to draft: with
    the first two drafts right (:func:`two_right`) a chain of 4 has the best rate, 12% above the next."""
    return 1e-3 + 5e-4 * plan.width + (1e-3 if plan.block else 0.0)


def two_right(k):
    return k <= 2


def test_the_best_width_gets_nearly_every_step():
    plans = run(auto(), 300, two_right, cost=width_costs)
    assert sum(p == Plan(4, 4) for p in plans[-200:]) >= 200 * STAY - 5
    assert sum(p != Plan(4, 4) for p in plans) <= 300 / PROBE_EVERY + 20


def test_clearly_slower_options_are_probed_ever_more_rarely():
    """Under :func:`width_costs` every other option measures below 90% of a chain of 4's rate: once
    their gaps reach MAX_GAP, each is probed about once per MAX_GAP steps (not once per 4 probes)."""
    plans = run(auto(), 600, two_right, cost=width_costs)
    assert sum(p != Plan(4, 4) for p in plans[200:]) <= 4 * (400 // MAX_GAP + 2)


def test_one_slow_step_does_not_move_the_choice():
    chooser = auto()
    assert run(chooser, 200, two_right, cost=width_costs)[-1] == Plan(4, 4)
    plan = Plan(4, 4)
    chooser.observe(plan, 10 * width_costs(plan), [2])
    plans = run(chooser, PROBE_EVERY, two_right, cost=width_costs)
    assert sum(p == plan for p in plans) >= PROBE_EVERY - 1


def test_pipelined_plain_timings_are_judged_by_their_mean():
    """Plain steps timed in pairs (the second dispatched while the first ran: all the cost on the
    first) at 1.1 times a chain of 4's seconds per token: the chain is chosen."""
    pairs = iter(range(10**6))

    def cost(plan, n):
        if plan.width == 1:
            return 2 * 1.1 * width_costs(Plan(4, 4)) / 3 if next(pairs) % 2 == 0 else 1e-5
        return width_costs(plan)

    plans = run(auto(), 300, two_right, cost=cost)
    assert sum(p == Plan(4, 4) for p in plans[-200:]) >= 200 * STAY - 5


def test_a_chain_must_gain_the_margin_to_be_chosen_over_plain_steps():
    """Only a measured gain moves off plain: drafts always right, every chain 1.5% faster per token than plain steps
    (within :data:`PLAIN_MARGIN`): plain steps stay the best and run between the probes (with plain's rate
    handicapped instead, a chain of 2 was the best, and no step of the last 100 was plain)."""
    chooser = auto()
    plans = run(chooser, 300, lambda k: True, cost=lambda plan, n: 1e-3 * plan.width / (1.015 if plan.width > 1 else 1))
    assert 1.015 < PLAIN_MARGIN and chooser.best[1] == Plan(1, 0)
    assert sum(p.width == 1 for p in plans[-100:]) >= 50  # a probe every other step, as each one's drafts all agree


def test_the_first_plain_step_of_a_batch_size_is_left_out_as_a_chains_is():
    """The first step at a batch size pays a setup that later ones do not (the first plain step at 8 sequences
    copies the batched cache the joins left: 224 against 143 ms on SmolLM2): plain steps' first timing is left out,
    as a chain's is. 8 sequences whose drafts are right half the time, where a chain costs 2-6x a plain step: plain
    steps commit 28% more per second, and 10 batches of 100 steps run 90 plain steps each at least on average
    (95 here; with that first timing counted, plain looked twice as slow: 2 each)."""
    plain = 0
    for seed in range(10):
        rng, seen = random.Random(seed), set()

        def cost(plan, n):
            first = plan.width == 1 and n not in seen
            seen.add(n)
            return 0.145 * (3 if first else 1) if plan.width == 1 else 0.2 + 0.04 * plan.width

        plain += sum(p.width == 1 for p in run(auto(), 100, lambda k: rng.random() < 0.5, n=8, cost=cost))
    assert plain >= 900, plain


def test_a_slow_plain_step_now_and_then_does_not_send_plain_decoding_to_chains():
    """Plain steps' timing must not follow one slow step: with drafts never right and one plain step in
    12 taking 10 times as long (a busy machine; a 1 ms step of stories260K), the chains are probes only."""
    count = iter(range(10**6))

    def cost(plan, n):
        return width_costs(plan) * (10 if plan.width == 1 and next(count) % 12 == 11 else 1)

    plans = run(auto(), 400, lambda k: False, cost=cost)
    assert sum(p.width > 1 for p in plans[100:]) <= 300 / 32, "".join("p" if p.width == 1 else "c" for p in plans)


def test_seeded_sampled_sequences_get_the_fixed_block():
    chooser = auto()
    assert all(p == Plan(B, B) for p in run(chooser, 50, lambda k: False, seeded=True))


def test_fixed_block_and_tree_budget_are_constant_plans():
    fixed = make_chooser(None, fake_drafter(), 4, None)
    assert {fixed.plan(n) for n in (1, 3)} == {Plan(4, 4)} and fixed.max_verify == 4
    assert fixed.verify == {"block_size": 4, "tree_budget": None, "reason": None}
    target = SimpleNamespace(supports_tree=True)
    tree = make_chooser(target, fake_drafter(tree=True), 8, 10)
    assert tree.plan(1) == Plan(11, 8, 10) and tree.max_verify == 11
    chain = make_chooser(target, fake_drafter(tree=False), 8, 10)
    assert chain.plan(1) == Plan(8, 8) and "log-probabilities" in chain.verify["reason"]


def test_tree_auto_takes_the_tree_when_it_commits_more():
    target = SimpleNamespace(supports_tree=True)
    chooser = make_chooser(target, fake_drafter(tree=True), AUTO, AUTO)
    assert chooser.max_verify == 17
    rng = random.Random(2)
    plans = []
    for _ in range(300):
        plan = chooser.plan(1)
        a = 8 if plan.tree_budget else next((k for k in range(plan.width - 1) if rng.random() > 0.5), plan.width - 1)
        chooser.observe(plan, seconds_of(plan), [a])
        plans.append(plan)
    assert sum(p.tree_budget is not None for p in plans[-100:]) >= 80


def test_widths_verified_never_exceed_max_verify():
    chooser = WidthChooser(8)
    assert all(p.width <= chooser.max_verify and p.block >= p.width * (p.block > 0) for p in
               run(chooser, 100, lambda k: k < 3))


@pytest.mark.parametrize("value,parsed", [(None, None), ("auto", AUTO), ("4", 4), (8, 8)])
def test_parse_block_size(value, parsed):
    assert parse_block_size(value) == parsed


@pytest.mark.parametrize("value", ["x", "1", "-3"])
def test_bad_block_size_is_an_input_error(value):
    with pytest.raises(InputError, match="--block-size"):
        parse_block_size(value)


@pytest.mark.parametrize("value", ["x", "0", 1.5j])
def test_bad_tree_budget_is_an_input_error(value):
    with pytest.raises(InputError, match="--tree-budget"):
        parse_tree_budget(value)
    assert parse_tree_budget("32") == 32 and parse_tree_budget(AUTO) == AUTO


def smollm2_costs(plan, n=1):
    """SmolLM2-135M in float32 on one CPU core, as measured there: a plain step 72 ms, a chain of 16
    123 ms, linear between, plus 4 ms to draft."""
    return (72 + 51 * (plan.width - 1) / 15 + (4 if plan.block else 0)) * 1e-3 * n


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("steps", [48, 150, 600])
def test_a_drafter_that_never_agrees_costs_at_most_3_percent(steps, learned):
    """Auto against plain decoding, on a machine where chains cost up to 1.8x a plain step: nothing is ever
    accepted, so each token's time may exceed a plain step's by 3% at most (a short reply included); also in
    a later generation, which starts from what an earlier one of the same length learned and times again."""
    chooser = auto()
    if learned:
        run(chooser, steps, lambda k: False, cost=smollm2_costs)
        state, chooser = chooser.state(), auto()
        assert chooser.learn(state)
    plans = run(chooser, steps, lambda k: False, cost=smollm2_costs)
    spent = sum(smollm2_costs(p) for p in plans)
    assert steps * smollm2_costs(Plan(1, 0)) / spent >= 0.97
    assert sum(p.width > 1 for p in plans[steps // 2:]) <= max(2, steps // 2 // MAX_GAP + 2)  # rare probes


def test_probes_are_flagged_and_back_off():
    chooser = auto()
    flags = []
    for _ in range(400):
        plan = chooser.plan(1)
        flags.append(chooser.probing)
        chooser.observe(plan, smollm2_costs(plan), [0] * 1)
    assert sum(flags[200:]) <= 200 // MAX_GAP + 2 and chooser.gap == MAX_GAP
    assert not any(f for f, p in zip(flags, run(chooser, 0, lambda k: False)))


def test_a_good_drafter_on_the_same_machine_gets_drafting():
    plans = run(auto(), 200, lambda k: True, cost=smollm2_costs)
    assert sum(p == Plan(B, B) for p in plans[-64:]) >= 64 * STAY


def test_a_busy_machine_still_gets_the_best_chain():
    """Other work on the machine slows steps in bursts (1x-2x for a while, and a step in 30 three times
    slower): auto's tokens per second stay within 5% of the best fixed chain's on the same bursts.
    Costs: SmolLM2-135M float32 on this CPU (`benchmarks/step_cost.py`): a target forward of 1, 4, 8, 16
    tokens 64, 67, 92, 113 ms, a draft 24-31 ms; draft k right with probability 0.8 falling to 0.5."""
    forward = {1: 64, 2: 66, 4: 67, 8: 92, 16: 113}
    draft = {0: 0, 2: 24, 4: 25, 8: 29, 16: 31}
    right = [0.8, 0.75, 0.7, 0.65, 0.6, 0.55] + [0.5] * 9

    def rate(chooser, seed, steps=800):
        rng, tokens, seconds, load = random.Random(seed), 0, 0.0, 1.0
        for _ in range(steps):
            plan = chooser.plan(1)
            a = 0
            while a < plan.width - 1 and rng.random() < right[a]:
                a += 1
            if rng.random() < 0.05:
                load = rng.choice([1.0, 1.0, 1.3, 1.6, 2.0])
            spent = (forward[plan.width] + draft[plan.block]) * 1e-3 * load * (1 + abs(rng.gauss(0, 0.1)))
            spent *= 3 if rng.random() < 1 / 30 else 1
            chooser.observe(plan, spent, [a])
            tokens, seconds = tokens + a + 1, seconds + spent
        return tokens / seconds

    seeds = range(12)
    best = max(sum(rate(WidthChooser(B, Plan(w, w)), s) for s in seeds) for w in (4, 8))
    assert sum(rate(auto(), s) for s in seeds) >= 0.95 * best


def test_a_later_generation_starts_from_what_auto_learned():
    """A chooser given an earlier one's state (through JSON, as the prompt cache keeps it) runs the best chain
    from its first step until the earlier one's probe schedule comes due (after PROBE_EVERY steps at the earliest),
    where a fresh one starts plain and probes; within 48 steps it commits more per second."""
    import json

    def right(k):  # draft k right with probability 0.8 falling to 0.5, the same draws for both
        return rng.random() < max(0.8 - 0.05 * (k - 1), 0.5)

    rng = random.Random(0)
    earlier = auto()
    run(earlier, 300, right, cost=smollm2_costs)
    best = earlier.best[1]
    later, state = auto(), json.loads(json.dumps(earlier.state()))
    assert best.width > 1 and later.learn(state)
    committed = [[], []]
    rng = random.Random(1)
    learned = run(later, 48, right, cost=smollm2_costs, tokens=committed[0])
    rng = random.Random(1)
    fresh = run(auto(), 48, right, cost=smollm2_costs, tokens=committed[1])
    due = max(PROBE_EVERY, state["gap"] - state["since"])
    assert learned[:due] == [best] * min(due, 48) and fresh[0] == Plan(1, 0)
    rates = [sum(c) / sum(smollm2_costs(p) for p in plans) for c, plans in zip(committed, (learned, fresh))]
    assert rates[0] > 1.05 * rates[1], rates  # no plain start, fewer probes
    plain = [i for i, p in enumerate(learned) if p.width == 1]  # one probe where due, run twice as any first run
    assert plain == [i for i in (due, due + 1) if i < 48] and fresh[:2] == [Plan(1, 0)] * 2


def test_later_generations_keep_the_probe_schedule():
    """Generations of 60 steps, each starting from the state the one before left (a chain best, no other option
    close to it): each probes once at most (run twice, as any first run at a size in a process), where the schedule the
    one before left puts it, not again PROBE_EVERY steps in."""
    import json

    def right(k):  # draft k right with probability 0.6 falling to 0.5
        return rng.random() < max(0.6 - 0.05 * (k - 1), 0.5)

    rng = random.Random(0)
    chooser = auto()
    run(chooser, 300, right, cost=smollm2_costs)
    for _ in range(4):
        state, chooser = json.loads(json.dumps(chooser.state())), auto()
        assert chooser.learn(state)
        probes = []
        for step in range(60):
            plan = run(chooser, 1, right, cost=smollm2_costs)[0]
            probes += [step] if chooser.probing else []
            assert chooser.probing or plan.width > 1
        assert len(probes) <= 2 and all(step >= max(PROBE_EVERY, state["gap"] - state["since"]) for step in probes)


def test_a_state_that_stopped_before_its_first_step_keeps_its_schedule():
    """A generation that ran no step (one token, from the prefill), started from a state whose probe had just beaten
    the best (gap FIRST_GAP), leaves a state a later one takes, its next probe still PROBE_EVERY steps away."""
    earlier = auto()
    run(earlier, 300, lambda k: k < 3, cost=smollm2_costs)
    middle, state = auto(), {**earlier.state(), "gap": FIRST_GAP, "since": 0}
    assert earlier.best[1].width > 1 and middle.learn(state)
    later = auto()
    assert later.learn(middle.state())
    plans = run(later, PROBE_EVERY + 2, lambda k: k < 3, cost=smollm2_costs)
    assert plans[:PROBE_EVERY] == [earlier.best[1]] * PROBE_EVERY and plans[PROBE_EVERY] == Plan(1, 0)


def test_a_later_generation_whose_best_was_plain_probes_as_soon_as_a_fresh_one():
    """Plain steps timed early in a generation and chains late in it (a longer context, slower steps) can leave plain
    the best of what was learned: a later generation then probes after FIRST_GAP steps, as a fresh one does, not
    after PROBE_EVERY."""
    earlier = auto()
    run(earlier, 60, lambda k: False, cost=smollm2_costs)
    later = auto()
    assert earlier.best[1] == Plan(1, 0) and later.learn(earlier.state())
    plans = run(later, FIRST_GAP + 1, lambda k: False, cost=smollm2_costs)
    assert plans[:FIRST_GAP] == [Plan(1, 0)] * FIRST_GAP and plans[FIRST_GAP].width > 1 and later.probing


@pytest.mark.parametrize("state", [{}, {"reached": "x"}, {"reached": [0.0] * 4, "right": [0.0] * 4, "prior": 1,
                                                          "tree_tokens": [], "seconds": []},
                                   {"reached": [float("nan")] * B, "right": [0.0] * B, "prior": 1, "tree_tokens": [],
                                    "seconds": []},
                                   {"reached": [6.8e7] * B, "right": [0.0] * B, "prior": 0.05, "tree_tokens": [],
                                    "seconds": []},
                                   {"reached": [0.0] * B, "right": [0.0] * B, "prior": 1, "tree_tokens": [],
                                    "seconds": [], "gap": 0, "since": 0},
                                   {"reached": [0.0] * B, "right": [0.0] * B, "prior": 1, "tree_tokens": [],
                                    "seconds": [], "gap": PROBE_EVERY, "since": "x"},
                                   {"reached": [0.0] * B, "right": [0.0] * B, "prior": 1, "tree_tokens": [],
                                    "seconds": [], "gap": PROBE_EVERY, "since": float("inf")}])
def test_a_state_that_does_not_fit_changes_nothing(state):
    """Malformed, another block size's (4 positions where B = 16 has 16), NaN, more weight than DECAY lets steps
    have (such evidence would outweigh the next 600 steps'), or a probe schedule out of range: refused, the chooser
    as new."""
    chooser = auto()
    assert not chooser.learn(state)
    assert chooser.state() == auto().state() and chooser.plan(1) == Plan(1, 0)


def test_a_fixed_block_learns_nothing_and_keeps_nothing():
    fixed = make_chooser(None, fake_drafter(), 8, None)
    run(fixed, 20, lambda k: True)
    assert fixed.state() == {} and not fixed.learn(auto().state())


def test_timings_learned_on_a_busy_machine_do_not_keep_a_chain_from_the_probes():
    """An earlier generation timed chains of 4 while other work ran (0.3 s, 4x their cost now) and left that in
    its state; chains of 2 and 8 were timed quiet. Chains of 4 commit the most per second on the quiet machine
    (draft k right with probability 0.8 falling by 0.1): within 200 steps the later generation runs them, as the
    earlier one did; it does not stay on chains of 2 with chains of 4 never probed again."""
    def right(k):
        return rng.random() < 0.9 - 0.1 * k

    def cost(plan, n=1):  # chains of 8 cost more than chains of 4 gain here
        return smollm2_costs(plan, n) + (0.03 if plan.width > 4 else 0.0)

    rng = random.Random(0)
    earlier = auto()
    run(earlier, 300, right, cost=cost)
    state = earlier.state()
    state["seconds"] = [[w, b, t, [0.3] * 6 if w == 4 else v] for w, b, t, v in state["seconds"]]
    later = auto()
    assert later.learn(state)
    plans = run(later, 200, right, cost=cost)
    assert sum(p == Plan(4, 4) for p in plans[-64:]) >= 64 * STAY
