"""Anchors after misses (--miss-anchors): sampling, block lengths, resume, bad input."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.errors import InputError
from dflash_mlx.train.blocks import next_anchors, position_weights, sample_anchors, valid_anchors
from dflash_mlx.train.loss import block_loss, make_batch, sequence_loss_and_grad, target_features
from dflash_mlx.train.trainer import TrainConfig, Trainer
from dflash_mlx.train.start import init_drafter
from conftest import tiny_training_set

B = 8


@pytest.fixture(scope="module")
def setup():
    return tiny_training_set(12, 48)


def _drafter(target):
    return init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=0)


def test_sampled_anchors_take_the_asked_share_after_misses():
    rng = np.random.default_rng(0)
    preferred = np.array([5, 9, 14, 20, 33, 41, 60, 70])  # 60 and 70 are past the last valid anchor
    for _ in range(20):
        a = sample_anchors(rng, 60, 4, B, 16, preferred, 0.5)
        assert a.size == 16 and np.all(np.diff(a) > 0) and np.isin(a, valid_anchors(60, 4, B)).all()
        assert set(preferred[:6]) <= set(a.tolist())  # 8 asked for, 6 valid: all taken
    a = sample_anchors(rng, 60, 4, B, 16, preferred, 0.0)
    assert a.size == 16
    assert sample_anchors(rng, 60, 4, B, 100, preferred, 1.0).size == valid_anchors(60, 4, B).size


def test_next_anchors_follow_each_block_length():
    out = next_anchors(np.array([4, 10, 30]), np.array([3, 1, 8]), length=37)
    assert out.tolist() == [7, 11]  # 30 + 8 = 38 is past the end


def test_block_lengths_are_the_greedy_acceptance_and_leave_the_loss_alone(setup):
    _, target, seqs = setup
    drafter, seq = _drafter(target), seqs[0]
    feats = target_features(target, seq.tokens, [1, 2], mx.float32)
    anchors = np.array([4, 9, 20, 30], dtype=np.int32)
    blocks, targets, anchors_mx, mask = make_batch(seq, B, 0, anchors)
    w = mx.array(position_weights(B, 4.0))
    loss, lengths = block_loss(drafter, feats, blocks, targets, anchors_mx, mask, w, with_lengths=True)
    assert abs(loss.item() - block_loss(drafter, feats, blocks, targets, anchors_mx, mask, w).item()) < 1e-7
    right = np.array(drafter.block_logits(blocks, feats, anchors_mx, mask).argmax(-1)) == np.array(targets)
    for n in range(anchors.size):
        wrong = np.flatnonzero(~right[n])
        assert lengths[n].item() == (wrong[0] if wrong.size else B - 1) + 1


def test_chunked_lengths_cover_every_anchor(setup):
    _, target, seqs = setup
    drafter, seq = _drafter(target), seqs[1]
    feats = target_features(target, seq.tokens, [1, 2], mx.float32)
    anchors = np.array([4, 9, 20, 30, 35], dtype=np.int32)
    w = mx.array(position_weights(B, 4.0))
    fn = nn.value_and_grad(drafter, lambda *a: block_loss(drafter, *a[:5], w, a[5], with_lengths=True))
    whole, parts = [], []
    sequence_loss_and_grad(fn, feats, seq, anchors, B, 0, 0, lengths_out=whole)
    sequence_loss_and_grad(fn, feats, seq, anchors, B, 0, 2, lengths_out=parts)
    assert np.concatenate([np.array(x) for x in parts]).tolist() == np.array(whole[0]).tolist()


def test_resume_reproduces_a_run_with_anchors_after_misses(setup, tmp_path):
    _, target, seqs = setup
    config = TrainConfig(steps=12, anchors=8, grad_accum=2, lr=1e-3, save_every=6, miss_anchors=0.5)
    straight = Trainer(_drafter(target), target, seqs, config, tmp_path / "a")
    list(straight.run())
    assert len(straight.after_misses) == len(seqs)  # every sequence visited and remembered
    uniform = Trainer(_drafter(target), target, seqs, TrainConfig(**{**config.__dict__, "miss_anchors": 0.0}),
                      tmp_path / "u")
    list(uniform.run())
    assert not uniform.after_misses

    interrupted = Trainer(_drafter(target), target, seqs, config, tmp_path / "b")
    for info in interrupted.run():
        if info.step == 8:  # the newest checkpoint is step 6; steps 6-11 revisit sequences
            break
    resumed = Trainer.resume(target, seqs, config, tmp_path / "b")
    assert resumed.after_misses.keys() == {i for i in range(len(seqs))}
    list(resumed.run())
    same = [mx.array_equal(v1, v2).item() for (_, v1), (_, v2) in
            zip(tree_flatten(straight.drafter.parameters()), tree_flatten(resumed.drafter.parameters()))]
    assert all(same)
    differs = [not mx.array_equal(v1, v2).item() for (_, v1), (_, v2) in
               zip(tree_flatten(straight.drafter.parameters()), tree_flatten(uniform.drafter.parameters()))]
    assert any(differs)  # the anchors after misses changed the run


def test_a_fraction_outside_0_to_1_is_refused(setup, tmp_path):
    _, target, seqs = setup
    with pytest.raises(InputError, match="--miss-anchors"):
        Trainer(_drafter(target), target, seqs, TrainConfig(steps=1, anchors=4, miss_anchors=1.5), tmp_path)
