"""Training a DSpark drafter (spec section 11): every block row drafts, a Markov head's bias from the true
previous token; the same forward as decoding, learning, saved in the released layout, lossless."""

import json

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import GenerationStats, bind_drafter, generate_step, load_drafter
from dflash_mlx.train.loss import LossVocab, block_loss, make_batch, target_features
from dflash_mlx.train.blocks import position_weights, previous_tokens
from dflash_mlx.train.trainer import TrainConfig, Trainer
from dflash_mlx.train.start import init_drafter
from conftest import mlx_lm_greedy, tiny_training_set

B = 8


@pytest.fixture(scope="module")
def setup():
    return tiny_training_set(12, 48)


def _drafter(target, rank):
    return init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=0,
                        markov_rank=rank)


@pytest.mark.parametrize("rank", [8, 0])
def test_training_forward_equals_decoding_plus_the_markov_bias_by_hand(setup, rank):
    """Row k of a training block at anchor a: the decoding forward's row k (a block of B-1 rows) plus
    ``markov_w2 @ markov_w1[token[a+k]]`` computed in NumPy."""
    _, target, seqs = setup
    drafter, seq = _drafter(target, rank), seqs[0]
    assert (drafter.drafter_format, drafter.block_size, drafter.args.block_size) == ("Qwen3DSparkModel", B, B - 1)
    if rank:  # a bias that is not zero, so that the check can fail
        w2 = drafter.markov_head["markov_w2"]
        w2.weight = mx.random.normal(w2.weight.shape, key=mx.random.key(3))
    anchors = np.array([4, 9, 30], dtype=np.int32)
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    blocks, targets, anchors_mx, mask = make_batch(seq, B, 0, anchors)
    train = np.array(drafter.block_logits(blocks, feats, anchors_mx, mask, previous_tokens(blocks, targets)))
    assert train.shape == (3, B - 1, target.vocab_size)
    for i, a in enumerate(anchors):
        decoded = np.array(drafter(drafter.blocks_of(mx.array([int(seq.tokens[a])]), B), feats[:, :a],
                                   drafter.make_cache())[0], dtype=np.float64)
        if rank:
            w1 = np.array(drafter.markov_head["markov_w1"].weight, dtype=np.float64)
            decoded += w1[seq.tokens[a:a + B - 1]] @ np.array(w2.weight, dtype=np.float64).T
        assert np.abs(train[i] - decoded).max() < 1e-4


def test_the_sampled_softmax_over_every_column_is_the_full_loss(setup):
    """``--loss-vocab step`` with every token drawn: the Markov bias over the columns gives the full loss."""
    _, target, seqs = setup
    drafter, seq = _drafter(target, 8), seqs[1]
    w2 = drafter.markov_head["markov_w2"]
    w2.weight = mx.random.normal(w2.weight.shape, key=mx.random.key(4))
    anchors = np.array([5, 12, 20, 33], dtype=np.int32)
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    batch = make_batch(seq, B, 0, anchors)
    weights = mx.array(position_weights(B, 4.0))
    vocab = LossVocab(target, [seq], mx.float32, "step", negatives=target.vocab_size)
    vocab.draw(np.random.default_rng(0), np.array(batch[1]).ravel())
    full = block_loss(drafter, feats, *batch, weights).item()
    assert abs(block_loss(drafter, feats, *batch, weights, vocab=vocab).item() - full) < 1e-4 * full
    w2.weight = mx.zeros_like(w2.weight)
    assert abs(block_loss(drafter, feats, *batch, weights).item() - full) > 1e-3  # the bias counts


@pytest.mark.parametrize("rank", [8, 0])
def test_a_short_run_learns_saves_the_released_layout_and_decodes_losslessly(setup, tmp_path, rank):
    model, target, seqs = setup
    drafter = _drafter(target, rank)
    config = TrainConfig(steps=80, anchors=16, grad_accum=2, lr=3e-3, warmup=0.05,
                         loss_vocab="step" if rank else "full")
    losses = [info.loss for info in Trainer(drafter, target, seqs, config, tmp_path / "out").run()]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config_json["architectures"], config_json["block_size"], config_json["markov_rank"]) == (
        ["Qwen3DSparkModel"], B - 1, rank)
    stored = mx.load(str(tmp_path / "out" / "model.safetensors"))  # the target's own, as released
    assert mx.array_equal(stored["embed_tokens.weight"], target.inner.embed_tokens.weight).item()
    assert mx.array_equal(stored["lm_head.weight"], target.inner.embed_tokens.weight).item()  # tied
    loaded = bind_drafter(load_drafter(str(tmp_path / "out")), target)
    assert "embed_tokens" not in loaded and "lm_head" not in loaded
    outputs, taus = [], []
    for seq in seqs[:3]:
        prompt, stats = seq.tokens[:4].tolist(), GenerationStats(block_size=B)
        out = [t for r in generate_step(mx.array(prompt), target, loaded, max_tokens=30, block_size=B, stats=stats)
               for t in r.tokens]
        assert out == mlx_lm_greedy(model, prompt, 30)[:len(out)] and len(out) == 30
        outputs.append(tuple(out))
        taus.append(stats.tau)
    assert len(set(outputs)) == 3 and np.mean(taus) > 1.8


def test_deepspecs_losses_by_hand(setup):
    """With the target's logits: ``l1_weight`` times the L1 distance of the two distributions, and the
    confidence head's binary cross-entropy to 1 - TV, both per row as NumPy computes them, on top of the
    cross-entropy."""
    from dflash_mlx.train.loss import target_block_logits, target_outputs

    _, target, seqs = setup
    seq = seqs[2]
    drafter = init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=0,
                           markov_rank=8, confidence=True)
    w2 = drafter.markov_head["markov_w2"]
    w2.weight = mx.random.normal(w2.weight.shape, key=mx.random.key(5))
    proj = drafter.confidence_head["proj"]
    assert proj.weight.shape == (1, target.hidden_size + 8)
    anchors = np.array([4, 11, 25], dtype=np.int32)
    feats, hidden = target_outputs(target, seq.tokens, [1, 2], mx.float32)
    batch = make_batch(seq, B, 0, anchors)
    blocks, targets, anchors_mx, mask = batch
    teacher = target_block_logits(target, hidden, anchors_mx, B)
    weights = np.array(position_weights(B, 4.0), dtype=np.float64)
    ce = block_loss(drafter, feats, *batch, mx.array(weights.astype(np.float32))).item()

    previous = previous_tokens(blocks, targets)
    logits = np.array(drafter.block_logits(blocks, feats, anchors_mx, mask, previous), dtype=np.float64)
    hid = np.array(drafter.block_hidden(blocks, feats, anchors_mx, mask), dtype=np.float64)
    markov = np.array(drafter.markov_head["markov_w1"].weight, dtype=np.float64)[np.array(previous)]
    conf = np.concatenate([hid, markov], -1) @ np.array(proj.weight, dtype=np.float64)[0] + np.array(proj.bias)[0]

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    tv = 0.5 * np.abs(softmax(logits) - softmax(np.array(teacher, dtype=np.float64))).sum(-1)  # [N, B-1]
    y = 1 - tv
    bce = np.maximum(conf, 0) - conf * y + np.log1p(np.exp(-np.abs(conf)))
    extra = ((2 * 0.7 * tv + bce) * weights).sum() / (weights.sum() * len(anchors))
    got = block_loss(drafter, feats, *batch, mx.array(weights.astype(np.float32)), None, teacher, l1_weight=0.7).item()
    assert extra > 0.1 and abs(got - (ce + extra)) < 1e-4 * got


def test_the_confidence_head_learns_to_predict_acceptance(setup, tmp_path):
    """After a short run with DeepSpec's losses, sigmoid(confidence) is nearer 1 - TV(draft, target) than at
    the start, on sequences it trained on."""
    from dflash_mlx.train.loss import target_block_logits, target_outputs

    _, target, seqs = setup
    drafter = init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=0,
                           markov_rank=8, confidence=True)

    def error():
        errs = []
        for seq in seqs[:4]:
            feats, hidden = target_outputs(target, seq.tokens, [1, 2], mx.float32)
            blocks, targets, at, mask = make_batch(seq, B, 0, np.arange(4, seq.tokens.size - B, 3, dtype=np.int32))
            previous, hid = previous_tokens(blocks, targets), drafter.block_hidden(blocks, feats, at, mask)
            q = mx.softmax(drafter.block_logits(blocks, feats, at, mask, previous, hid), axis=-1)
            p = mx.softmax(target_block_logits(target, hidden, at, B), axis=-1)
            accept = 1 - 0.5 * mx.abs(q - p).sum(-1)
            errs.append(np.array(mx.abs(mx.sigmoid(drafter.confidence(hid, previous)) - accept)).ravel())
        return float(np.concatenate(errs).mean())

    before = error()
    config = TrainConfig(steps=60, anchors=16, grad_accum=2, lr=3e-3, warmup=0.05, l1_weight=1.0)
    list(Trainer(drafter, target, seqs, config, tmp_path / "out").run())
    assert error() < 0.6 * before
