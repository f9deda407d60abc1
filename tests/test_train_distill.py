"""Drafter training additions (issue 15): distillation from the target's distribution,
several block sizes in one run, and their resume, chunking and input checks."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.errors import InputError
from dflash_mlx.train.blocks import position_weights, sample_anchors
from dflash_mlx.train.evaluate import evaluate_block_sizes
from dflash_mlx.train.features import FeatureStore
from dflash_mlx.train.loss import (
    FeatureCache, block_loss, distill_kl, make_batch, sequence_loss_and_grad, target_block_logits, target_outputs,
)
from dflash_mlx.train.trainer import TrainConfig, Trainer, block_size_plan
from dflash_mlx.train.start import init_drafter
from conftest import tiny_training_set

B = 8


@pytest.fixture(scope="module")
def setup():
    _, target, seqs = tiny_training_set(8, 40)
    return target, seqs


def _drafter(target, block_size=B):
    return init_drafter(target, mask_token_id=0, layers=1, block_size=block_size, target_layer_ids=[1, 2], seed=0)


def test_kl_is_zero_for_the_same_distribution_and_positive_otherwise():
    logits = mx.random.normal((3, 7, 64), key=mx.random.key(0)) * 3
    for t in (0.5, 1.0, 2.0):
        assert mx.abs(distill_kl(logits, logits, t)).max().item() < 1e-5
        assert mx.abs(distill_kl(logits + 4.0, logits, t)).max().item() < 1e-5  # softmax ignores a shift
        other = mx.random.normal((3, 7, 64), key=mx.random.key(1))
        assert distill_kl(other, logits, t).min().item() > 0


def test_target_logits_sit_at_the_rows_the_block_predicts(setup):
    """Row k of the block at anchor a predicts token a + k; the data are the target's
    greedy tokens, so the target's logits at those rows must pick exactly them."""
    target, seqs = setup
    seq = seqs[0]
    anchors = sample_anchors(np.random.default_rng(1), seq.tokens.size, seq.response_start, B, 12)
    _, hidden = target_outputs(target, seq.tokens, [1, 2], mx.float32)
    _, targets, anchors_mx, _ = make_batch(seq, B, 0, anchors)
    logits = target_block_logits(target, hidden, anchors_mx, B)
    assert logits.shape == (anchors.size, B - 1, 64)
    assert mx.array_equal(mx.argmax(logits, axis=-1), targets).item()


def test_block_loss_with_the_targets_own_logits_adds_nothing(setup):
    """Where the drafter's logits are the target's, the KL term is zero: the loss with
    distillation equals the cross-entropy alone."""
    target, seqs = setup
    drafter = _drafter(target)
    seq = seqs[1]
    anchors = sample_anchors(np.random.default_rng(2), seq.tokens.size, seq.response_start, B, 8)
    feats, hidden = target_outputs(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    batch = make_batch(seq, B, 0, anchors)
    w = mx.array(position_weights(B, 4.0))
    own = drafter.block_logits(batch[0], feats, batch[2], batch[3])
    ce = block_loss(drafter, feats, *batch, w)
    assert abs(block_loss(drafter, feats, *batch, w, None, own, 1.0, 2.0).item() - ce.item()) < 1e-5
    teacher = target_block_logits(target, hidden, batch[2], B)
    assert block_loss(drafter, feats, *batch, w, None, teacher, 1.0).item() > ce.item()


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_kl_gives_the_one_pass_loss_and_gradients(setup, chunk):
    target, seqs = setup
    drafter = _drafter(target)
    seq = seqs[2]
    anchors = sample_anchors(np.random.default_rng(3), seq.tokens.size, seq.response_start, B, 8)
    feats, hidden = target_outputs(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    w = mx.array(position_weights(B, 4.0))
    fn = nn.value_and_grad(drafter, lambda *a: block_loss(drafter, *a[:5], w, *a[5:], kl_weight=0.7,
                                                          kl_temperature=2.0))
    results = [sequence_loss_and_grad(fn, feats, seq, anchors, B, 0, c, hidden, target) for c in (0, chunk)]
    (l1, g1), (l2, g2) = results
    assert abs(l1.item() - l2.item()) < 1e-5 * abs(l1.item())
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-6).item(), k
    plain, _ = sequence_loss_and_grad(
        nn.value_and_grad(drafter, lambda *a: block_loss(drafter, *a[:5], w, a[5])), feats, seq, anchors, B, 0, chunk)
    assert l1.item() > plain.item()  # the KL term is there


def test_feature_cache_keeps_hidden_states_for_distillation(setup, tmp_path):
    target, seqs = setup
    cache = FeatureCache(target, [1, 2], tmp_path, hidden=True)
    feats, hidden = cache.get(seqs[0], mx.float32)
    ref_feats, ref_hidden = target_outputs(target, seqs[0].tokens, [1, 2], mx.float32)
    assert feats.shape == ref_feats.shape and hidden.shape == ref_hidden.shape
    assert mx.allclose(hidden, ref_hidden, atol=2e-2).item()  # stored as float16
    assert FeatureStore(tmp_path, target, [1, 2]).path(seqs[0].tokens, "hidden").is_file()
    # A cache made without hidden states gains them when a later run distils.
    plain = FeatureCache(target, [1, 2], tmp_path / "p")
    assert plain.get(seqs[1], mx.float32)[1] is None
    assert FeatureCache(target, [1, 2], tmp_path / "p", hidden=True).get(seqs[1], mx.float32)[1] is not None


def test_block_size_plan():
    assert block_size_plan(TrainConfig(), 16) == {16: 7.0}
    assert block_size_plan(TrainConfig(block_sizes=[4, 8, 16]), 16) == {4: 4.0, 8: 4.0, 16: 7.0}
    assert block_size_plan(TrainConfig(block_sizes=[4, 16], gamma=[2.0, 6.0]), 16) == {4: 2.0, 16: 6.0}
    assert block_size_plan(TrainConfig(block_sizes=[4, 16], gamma=5.0), 16) == {4: 5.0, 16: 5.0}
    for sizes in ([4, 32], [1, 16], [8, 8]):
        with pytest.raises(InputError, match="--block-sizes"):
            block_size_plan(TrainConfig(block_sizes=sizes), 16)
    with pytest.raises(InputError, match="--gamma 2.0,4.0,7.0: give one value, or one per block size"):
        block_size_plan(TrainConfig(block_sizes=[8, 16], gamma=[2.0, 4.0, 7.0]), 16)


def test_each_block_size_gets_valid_anchors_and_masks(setup, tmp_path):
    """A multi-size run draws every size, and each sequence's anchors, targets and mask
    fit the size it drew (anchors inside the response, the whole block in the sequence)."""
    target, seqs = setup
    config = TrainConfig(steps=6, anchors=6, grad_accum=2, block_sizes=[2, 4, 8])
    trainer = Trainer(_drafter(target), target, seqs, config, tmp_path)
    drawn = set()
    for step in range(30):
        for micro in range(2):
            b = trainer.block_size_at(step, micro)
            drawn.add(b)
            seq = trainer.sequences[trainer._sequence(step * 2 + micro)]
            anchors = sample_anchors(np.random.default_rng([0, step, micro]), seq.tokens.size, seq.response_start,
                                     b, 6)
            blocks, targets, anchors_mx, mask = make_batch(seq, b, 0, anchors)
            L = seq.tokens.size
            assert blocks.shape == (anchors.size, b) and targets.shape == (anchors.size, b - 1)
            assert mask.shape == (anchors.size, 1, b, L + b)
            assert anchors.min() >= seq.response_start and anchors.max() + b <= L
    assert drawn == {2, 4, 8}
    infos = list(trainer.run())
    assert set(infos[-1].eval or {}) == set()  # no evaluation asked for
    assert all(np.isfinite(i.loss) for i in infos)


def test_multi_size_distilled_run_resumes_exactly(setup, tmp_path):
    target, seqs = setup
    config = TrainConfig(steps=8, anchors=6, grad_accum=2, lr=1e-3, save_every=4, block_sizes=[4, 8],
                         kl_weight=0.5, kl_temperature=2.0)
    straight = Trainer(_drafter(target), target, seqs, config, tmp_path / "a", feature_cache=tmp_path / "fa")
    list(straight.run())
    interrupted = Trainer(_drafter(target), target, seqs, config, tmp_path / "b", feature_cache=tmp_path / "fb")
    for info in interrupted.run():
        if info.step == 6:
            break
    resumed = Trainer.resume(target, seqs, config, tmp_path / "b", feature_cache=tmp_path / "fb")
    assert resumed.step == 4
    list(resumed.run())
    for (k1, v1), (_, v2) in zip(tree_flatten(straight.drafter.parameters()), tree_flatten(resumed.drafter.parameters())):
        assert mx.array_equal(v1, v2).item(), k1
    # Resuming with another block-size list or KL weight would not continue the run.
    for change in (dict(block_sizes=[8]), dict(kl_weight=0.0)):
        with pytest.raises(InputError, match="would not continue it"):
            Trainer.resume(target, seqs, TrainConfig(**{**config.__dict__, **change}), tmp_path / "b")


def test_evaluation_per_block_size(setup, tmp_path):
    target, seqs = setup
    drafter = _drafter(target)
    config = TrainConfig(steps=2, anchors=4, block_sizes=[4, 8], eval_every=2, eval_sequences=2)
    info = list(Trainer(drafter, target, seqs[:6], config, tmp_path, held_out=seqs[6:]).run())[-1]
    assert list(info.eval) == [8, 4]
    assert len(info.eval[8]["acceptance"]) == 7 and len(info.eval[4]["acceptance"]) == 3
    both = evaluate_block_sizes(drafter, target, seqs[6:], [8, 4])
    assert both[8] == evaluate_block_sizes(drafter, target, seqs[6:], [8])[8] and both == info.eval


def test_bad_kl_settings(setup, tmp_path):
    target, seqs = setup
    for kw, message in ((dict(kl_weight=-1.0), "--kl-weight must be >= 0, got -1.0"),
                        (dict(kl_weight=1.0, kl_temperature=0.0), "--kl-temperature must be > 0, got 0.0")):
        with pytest.raises(InputError, match=message):
            Trainer(_drafter(target), target, seqs, TrainConfig(steps=1, **kw), tmp_path)


def test_a_shared_features_folder_serves_any_data_at_its_own_layers(setup, tmp_path):
    """A features folder is keyed by each sequence's tokens: another run's data (here a part of it) reads the
    features kept, not computed again; a run at other layers is refused, the folder left as it was."""
    target, seqs = setup
    FeatureCache(target, [1, 2], tmp_path).get(seqs[0], mx.float32)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other_run = FeatureCache(target, [1, 2], tmp_path)
    other_run.target = None  # a forward would fail: the features must come from the folder
    assert other_run.get(seqs[0], mx.float32)[0].shape == (1, seqs[0].tokens.size, 2 * target.hidden_size)
    with pytest.raises(InputError, match="holds features of another target or other layers; give another"):
        FeatureCache(target, [0, 2], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
