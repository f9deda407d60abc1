"""Where --block-size auto's seconds come from, and what a later process starts from.

- With fixed timings the widths chosen do not depend on the clock: a clock that
  jumps at random gives the same steps, token for token and width for width.
- A calibration and the drafter's acceptance profile are kept on disk per pair,
  device, dtypes and versions; a new process starts from them ("stored": no timing
  runs); ``recalibrate`` re-times and keeps the acceptance profile; a changed
  checkpoint, a corrupt or foreign file, or a wrapped (simulated) drafter is never
  reused or stored.
"""

import json
import random

import mlx.core as mx
import pytest

import dflash_mlx.decode.generate as generate_module
import dflash_mlx.decode.policy as policy
from dflash_mlx import GenerationStats, generate_step
from dflash_mlx.decode.calibration import CalibrationStore, FixedTimings, folder_fingerprint, store_key
from dflash_mlx.decode.cost import CostModel
from dflash_mlx.bench.simulate import SimulatedDrafter
from conftest import ScriptedDrafter, mlx_lm_greedy, tiny_drafter, tiny_target

PROMPT = [1, 17, 33, 2, 9, 100, 42]


class CountingTimings(FixedTimings):
    """Fixed seconds that count as measured (so they are stored), counting calibrations."""

    measured = True

    def __init__(self, store):
        super().__init__()
        self.store, self.calibrations = store, 0

    def calibrate(self, *args):
        self.calibrations += 1
        return super().calibrate(*args)


def run(target, drafter, n=60, **kw):
    stats = GenerationStats(block_size=drafter.block_size)
    tokens = [t for s in generate_step(mx.array(PROMPT, dtype=mx.int32), target, drafter, max_tokens=n,
                                       block_size="auto", stats=stats, **kw) for t in s.tokens]
    return tokens, stats


@pytest.fixture(scope="module")
def qwen3():
    model, target = tiny_target("qwen3")
    return target, mlx_lm_greedy(model, PROMPT, 140)


def test_fixed_timings_make_the_widths_independent_of_the_clock(qwen3, monkeypatch):
    target, ref = qwen3
    runs = []
    for jitter in (0.0, 1.0):
        rng = random.Random(0)
        clock = iter(range(10**6))
        # A clock that jumps by up to a second between readings, or ticks evenly.
        monkeypatch.setattr(generate_module.time, "perf_counter",
                            lambda: next(clock) * 1e-3 + jitter * rng.random())
        policy._MODELS.clear()
        drafter = ScriptedDrafter(PROMPT + ref, correct=5, block_size=16, vocab=256)
        tokens, stats = run(target, drafter, n=120)
        assert tokens == ref[:120]
        runs.append(stats.widths)
    # the timed block that holds the right drafts and one more (5 + 1 <= 8), at every step
    assert runs[0] == runs[1] == {"chain 8": runs[0]["chain 8"]}


def test_the_store_round_trip_and_what_it_refuses(tmp_path):
    store = CalibrationStore(tmp_path)
    key = {"target": "t", "drafter": "d", "draft_block": 16}
    assert store.load(key) is None
    assert store.save(key, {"x": 1}) and store.load(key) == {"x": 1}
    assert sorted(p.name for p in (tmp_path / "calibration").iterdir()) == [".dflash-mlx", store.path(key).name]  # the store's mark, no temp files
    assert store.load({**key, "drafter": "other"}) is None
    store.path(key).write_text('{"key": {"target": "t"')  # truncated
    assert store.load(key) is None
    other = {**key, "draft_block": 8}
    store.path(other).write_text(json.dumps({"key": key, "state": {"x": 2}}))  # a file under the wrong name
    assert store.load(other) is None
    (tmp_path / "file").write_text("")
    assert CalibrationStore(tmp_path / "file").save(key, {}) is False  # the folder cannot be made: no error


def test_cost_model_state_round_trip_and_bad_states():
    cost = CostModel(block_size=4)
    cost.calibrate(FixedTimings().calibrate(None, None, [1, 2, 4], [2, 4]))
    cost.record_step("chain", 4, 2 * cost.estimate("chain", 4, 0), 0, overhead=1e-4)
    cost.record_step("plain", 1, 0.8 * 2 * cost.estimate("plain", 1, 0), 0)
    cost.record_step("chain", 4, 2 * cost.estimate("chain", 4, 0), 0)  # a switch back: the widths' factors differ
    assert cost.width_factor[4].value != 1.0
    for s in range(5):
        cost.record_drafts(4 * s, [7, 7, 0])
        cost.record_committed([7, 7, 8, 9], 4 * s)
    state = json.loads(json.dumps(cost.state()))
    again = CostModel(block_size=4)
    assert again.restore(state)
    for n in (1, 2, 3, 4):
        assert again.rate(n, 100) == pytest.approx(cost.rate(n, 100))
    assert again.survival() == pytest.approx(cost.survival())
    fresh = CostModel(block_size=4)
    assert not fresh.restore({**state, "tried": [1.0, 1.0]})  # another block size
    assert not fresh.restore({**state, "speed": float("nan")})
    assert not fresh.restore({**state, "width_factor": {"4": 0.0}})  # a step that costs nothing
    assert not fresh.restore({**state, "width_factor": {"four": 1.0}})
    assert not fresh.restore({**state, "calibration": {**state["calibration"], "verify_s": {"1": [-1.0, 1.0]}}})
    assert not fresh.restore({"tried": "x"})
    assert fresh.tried == [0.0] * 3 and fresh.calibration is None  # nothing half-restored


def test_a_stored_profile_gives_way_when_the_first_blocks_differ():
    from dflash_mlx.decode.cost import RESTORED_BLOCKS, SURPRISE_BLOCKS

    cost = CostModel(block_size=4)
    for s in range(60):  # many blocks of math-like text: the first draft always wrong
        cost.record_drafts(4 * s, [7, 7, 7])
        cost.record_committed([8, 7, 7, 7], 4 * s)
    state = json.loads(json.dumps({**cost.state(), "probe_gap": 128}))

    same = CostModel(block_size=4)  # the same kind of text again: the profile stays whole
    assert same.restore(state, timings=False) and same.tried == pytest.approx(cost.tried)
    assert same.probe_gap == same.max_probe_every // 4  # probes resume sooner than they had got
    for s in range(SURPRISE_BLOCKS):
        same.record_drafts(4 * s, [7, 7, 7])
        same.record_committed([8, 7, 7, 7], 4 * s)
    assert same.tried[0] > 2 * RESTORED_BLOCKS

    other = CostModel(block_size=4)  # stories after math: the first block is right
    assert other.restore(state, timings=False)
    other.record_drafts(0, [7, 7, 7])
    other.record_committed([7, 7, 7, 7], 0)
    keep = 1 - other.acceptance_decay  # scaled down before the block counts: this run's text takes over
    assert other.tried[0] == pytest.approx(RESTORED_BLOCKS * keep + 1)
    for s in range(1, 6):
        other.record_drafts(4 * s, [7, 7, 7])
        other.record_committed([7, 7, 7, 7], 4 * s)
    assert other.survival()[0] > 0.5


def fingerprinted(target, drafter, tag="a"):
    target.fingerprint, drafter.fingerprint = f"target-{tag}", f"drafter-{tag}"
    return target, drafter


def test_a_new_process_starts_from_the_stored_calibration_and_profile(qwen3, tmp_path):
    target, ref = qwen3
    drafter = ScriptedDrafter(PROMPT + ref, correct=5, block_size=16, vocab=256, check_anchor=False)
    fingerprinted(target, drafter)
    timings = CountingTimings(CalibrationStore(tmp_path))
    try:
        tokens, stats = run(target, drafter, timings=timings)
        assert tokens == ref[:60] and stats.verify["calibration"] == "timed" and timings.calibrations == 1
        (cost,) = policy._models_of(drafter).values()
        learned = cost.state()
        assert learned["tried"][0] > 0
        tokens, stats = run(target, drafter, timings=timings)
        assert stats.verify["calibration"] == "kept" and timings.calibrations == 1

        policy._MODELS.clear(), policy._CALIBRATIONS.clear()  # a new process
        tokens, stats = run(target, drafter, n=1, timings=timings)
        assert stats.verify["calibration"] == "stored" and timings.calibrations == 1
        (restored,) = policy._models_of(drafter).values()
        assert restored.right[0] > 0 and restored.estimate("chain", 16, 50) == pytest.approx(
            cost.estimate("chain", 16, 50))

        policy.recalibrate(drafter)  # --recalibrate: timed again, the profile kept
        tokens, stats = run(target, drafter, n=1, timings=timings)
        assert stats.verify["calibration"] == "timed" and timings.calibrations == 2
        (again,) = policy._models_of(drafter).values()
        assert again.right == pytest.approx(restored.right)
        tokens, stats = run(target, drafter, n=1, timings=timings)
        assert stats.verify["calibration"] == "kept"  # only the next generation recalibrates

        policy._MODELS.clear(), policy._CALIBRATIONS.clear()
        fingerprinted(target, drafter, tag="b")  # a changed checkpoint
        tokens, stats = run(target, drafter, n=1, timings=timings)
        assert stats.verify["calibration"] == "timed" and timings.calibrations == 3
    finally:
        del target.fingerprint


def test_simulated_and_in_memory_drafters_are_never_stored(qwen3, tmp_path):
    target, ref = qwen3
    drafter = tiny_drafter(target)
    assert store_key(target, drafter, 16, [1, 16]) is None  # built in memory: no fingerprints
    fingerprinted(target, drafter)
    try:
        simulated = SimulatedDrafter(drafter, PROMPT + ref, 3, 256)
        assert store_key(target, simulated, 16, [1, 16]) is None
        tokens, _ = run(target, simulated, timings=CountingTimings(CalibrationStore(tmp_path)))
        assert tokens == ref[:60] and not (tmp_path / "calibration").exists()
    finally:
        del target.fingerprint


def test_folder_fingerprint_follows_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = folder_fingerprint(tmp_path)
    assert folder_fingerprint(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 2}')
    second = folder_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert folder_fingerprint(tmp_path) not in (first, second)


def test_a_wider_chain_step_costs_at_least_the_narrower_plus_its_extra_forward_and_drafting():
    from dflash_mlx.decode.calibration import Calibration

    ms = lambda *t: tuple(x / 1e3 for x in t)  # noqa: E731
    cal = Calibration(
        verify_s={1: ms(1.7, 1.7), 8: ms(1.8, 2.7), 16: ms(2.1, 3.4)},
        draft_s={8: ms(0.7, 1.1), 16: ms(1.1, 1.3)},
        chain_s={1: ms(1.6, 1.7), 8: ms(3.0, 4.3), 16: ms(3.0, 5.3)},  # a fast outlier at 16, context 0
        contexts=(32, 256)).capped()
    assert cal.chain_s[16][0] == pytest.approx(ms(3.0 + 0.4 + 0.3)[0])  # raised by the extra drafting and forward
    assert cal.chain_s[16][1] == pytest.approx(ms(5.3)[0])  # timed above the floor: kept
    assert cal.chain_s[8] == pytest.approx(ms(3.0, 4.3)) and cal.chain_s[1] == pytest.approx(ms(1.6, 1.7))
