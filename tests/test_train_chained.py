"""Held-out tau along generation's own schedule (dflash_mlx/train/evaluate.py): its steps are
the steps greedy generation takes from the sequence's prompt, step for step."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import generate_step
from dflash_mlx.bench.simulate import SimulatedDrafter
from dflash_mlx.train.data import TrainSequence
from dflash_mlx.train.evaluate import chained_lengths, evaluate_block_sizes, evaluate_chained
from dflash_mlx.train.loss import target_features
from conftest import mlx_lm_greedy, tiny_drafter, tiny_target

B = 8
PROMPT = [1, 17, 33, 2, 9, 100, 42]
N = 60


@pytest.fixture(scope="module")
def setup():
    model, target = tiny_target("qwen3")
    seq = TrainSequence(np.array(PROMPT + mlx_lm_greedy(model, PROMPT, N), dtype=np.int32), len(PROMPT))
    return target, seq


def _generation_lengths(target, drafter, seq):
    prompt = mx.array(seq.tokens[:seq.response_start])
    steps = list(generate_step(prompt, target, drafter, max_tokens=N, block_size=B))
    assert [t for s in steps for t in s.tokens] == seq.tokens[seq.response_start:].tolist()  # lossless
    assert len(steps[0].tokens) == 1  # the prefill's token; the chained walk starts from it
    return [len(s.tokens) for s in steps[1:]]


@pytest.mark.parametrize("trace", [[0], [3, 0, 7, 2, 5, 1, 6]])
def test_chained_steps_are_generation_steps(setup, trace):
    target, seq = setup
    inner = tiny_drafter(target, block_size=B)
    feats = target_features(target, seq.tokens, inner.target_layer_ids, mx.float32)
    chained = chained_lengths(SimulatedDrafter(inner, seq.tokens.tolist(), trace, target.vocab_size), feats, seq, B)
    generated = _generation_lengths(target, SimulatedDrafter(inner, seq.tokens.tolist(), trace, target.vocab_size),
                                    seq)
    assert len(chained) >= 5 and max(chained) > 1 or trace == [0]
    assert generated[:len(chained)] == chained  # the walk stops where a block would pass the end


def test_real_drafter_chained_equals_generation(setup):
    target, seq = setup
    drafter = tiny_drafter(target, block_size=B)
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    chained = chained_lengths(drafter, feats, seq, B)
    assert _generation_lengths(target, drafter, seq)[:len(chained)] == chained
    result = evaluate_chained(drafter, target, [seq], [B], {0: feats})
    assert result[B] == {"tau": round(float(np.mean(chained)), 4), "steps": len(chained)}


def test_training_evaluation_reports_both_taus(setup):
    target, seq = setup
    drafter = tiny_drafter(target, block_size=B)
    out = evaluate_block_sizes(drafter, target, [seq], [B, 4])
    assert set(out) == {B, 4} and all("tau_generation" in r and r["tau_generation"] >= 1.0 for r in out.values())
    assert "tau_generation" not in evaluate_block_sizes(drafter, target, [seq], [B], chained=False)[B]


def test_a_run_reports_tau_as_generated_at_its_last_evaluation(setup, tmp_path):
    from dflash_mlx.train.trainer import TrainConfig, Trainer
    from dflash_mlx.train.start import init_drafter

    target, seq = setup
    drafter = init_drafter(target, mask_token_id=0, layers=1, block_size=4, target_layer_ids=[1, 2])
    config = TrainConfig(steps=4, anchors=4, grad_accum=1, eval_every=2, eval_sequences=1)
    evals = [info.eval for info in Trainer(drafter, target, [seq] * 3, config, tmp_path / "out", held_out=[seq]).run()
             if info.eval]
    assert len(evals) == 2 and "tau_generation" not in evals[0][4] and evals[1][4]["tau_generation"] >= 1.0
