"""Drafter training: anchors and mask, forward consistency, learning, resume, bad input."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import GenerationStats, generate_step
from dflash_mlx.errors import InputError, MismatchError
from dflash_mlx.train.blocks import block_mask, position_weights, sample_anchors, valid_anchors
from dflash_mlx.train.data import read_prompt_file, regenerate
from dflash_mlx.train.evaluate import evaluate_block_sizes
from dflash_mlx.train.loss import block_loss, make_batch, sequence_loss_and_grad, target_features
from dflash_mlx.train.trainer import TrainConfig, Trainer, check_fresh_out
from dflash_mlx.train.start import init_drafter
from conftest import tiny_target, tiny_training_set

B = 8


def test_anchors_stay_inside_the_response():
    rng = np.random.default_rng(0)
    for _ in range(50):
        length, start = int(rng.integers(12, 60)), int(rng.integers(0, 10))
        a = sample_anchors(rng, length, start, B, 16)
        assert np.all(a >= max(start, 1)) and np.all(a <= length - B)
        assert len(set(a.tolist())) == a.size and np.all(np.diff(a) > 0)
    assert valid_anchors(10, 5, B).size == 0


def test_block_mask_matches_brute_force():
    anchors, L = np.array([3, 7, 20]), 30
    mask = block_mask(anchors, L, B)
    assert mask.shape == (3, 1, B, L + B)
    for n, a in enumerate(anchors):
        for q in range(B):
            for key in range(L + B):
                # Context key j is visible iff j < anchor; the block's own keys always.
                expect = key < a if key < L else True
                assert mask[n, 0, q, key] == expect
    # No block sees a context row at or after its anchor (which holds later blocks' tokens).
    assert not mask[0, 0, :, 3:L].any()


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0 and np.isclose(w[7], np.exp(-1.0))


@pytest.fixture(scope="module")
def setup():
    return tiny_training_set(12, 48)


def _drafter(target, seed=0):
    return init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=seed)


def test_training_forward_equals_inference_forward(setup):
    _, target, seqs = setup
    drafter = _drafter(target)
    seq = seqs[0]
    anchors = np.array([4, 9, 30], dtype=np.int32)
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    blocks, _, anchors_mx, mask = make_batch(seq, B, 0, anchors)
    train_logits = drafter.block_logits(blocks, feats, anchors_mx, mask)
    for i, a in enumerate(anchors):
        infer = drafter(blocks[i:i + 1], feats[:, :a], drafter.make_cache())
        assert mx.allclose(train_logits[i], infer[0], atol=1e-5).item()


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_anchor_chunks_give_the_one_pass_loss_and_gradients(setup, chunk):
    """16 anchors in chunks of 1, 5 (uneven: 5+5+5+1) or 16: the same loss and
    gradients as one pass, up to float rounding."""
    import mlx.nn as nn

    _, target, seqs = setup
    drafter = _drafter(target)
    seq = seqs[1]
    anchors = sample_anchors(np.random.default_rng(3), seq.tokens.size, seq.response_start, B, 16)
    weights = mx.array(position_weights(B, 4.0))
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    fn = nn.value_and_grad(drafter, lambda *a: block_loss(drafter, *a[:5], weights, a[5]))
    one_loss, one_grads = fn(feats, *make_batch(seq, B, 0, anchors), anchors.size)
    loss, grads = sequence_loss_and_grad(fn, feats, seq, anchors, B, 0, chunk)
    assert abs(loss.item() - one_loss.item()) < 1e-5 * abs(one_loss.item())
    for (k, g1), (_, g2) in zip(tree_flatten(one_grads), tree_flatten(grads)):
        assert mx.allclose(g1, g2, rtol=1e-4, atol=1e-6).item(), k


def test_chunked_training_follows_the_one_pass_run(setup, tmp_path):
    _, target, seqs = setup
    runs = []
    for chunk in (0, 3):
        config = TrainConfig(steps=5, anchors=8, anchor_chunk=chunk, grad_accum=2, lr=3e-3)
        trainer = Trainer(_drafter(target), target, seqs, config, tmp_path / str(chunk))
        runs.append(([info.loss for info in trainer.run()], trainer.drafter))
    assert np.allclose(runs[0][0], runs[1][0], rtol=1e-4)
    for (k, a), (_, b) in zip(tree_flatten(runs[0][1].parameters()), tree_flatten(runs[1][1].parameters())):
        assert mx.allclose(a, b, rtol=1e-3, atol=1e-5).item(), k


def _engine_tau(target, drafter, seqs):
    """Mean tau of real decoding from each sequence's prompt."""
    taus = []
    for seq in seqs:
        stats = GenerationStats(block_size=B)
        list(generate_step(mx.array(seq.tokens[:4]), target, drafter, max_tokens=40, block_size=B, stats=stats))
        taus.append(stats.tau)
    return float(np.mean(taus))


def test_short_run_learns(setup, tmp_path):
    _, target, seqs = setup
    drafter = _drafter(target)
    untrained_tau = _engine_tau(target, drafter, seqs[:4])
    config = TrainConfig(steps=100, anchors=16, grad_accum=2, lr=3e-3, warmup=0.05)
    trainer = Trainer(drafter, target, seqs, config, tmp_path / "out")
    losses = [info.loss for info in trainer.run()]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    trained_tau = _engine_tau(target, drafter, seqs[:4])
    assert trained_tau > untrained_tau + 0.5
    assert evaluate_block_sizes(drafter, target, seqs[:4], [B])[B]["tau"] > 1.5
    # The output folder is a drafter in the released format.
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_json["dflash_config"]["target_layer_ids"] == [1, 2]


def test_resume_reproduces_uninterrupted_run(setup, tmp_path):
    _, target, seqs = setup
    config = TrainConfig(steps=12, anchors=8, grad_accum=2, lr=1e-3, save_every=6)
    straight = Trainer(_drafter(target), target, seqs, config, tmp_path / "a")
    list(straight.run())

    interrupted = Trainer(_drafter(target), target, seqs, config, tmp_path / "b")
    for info in interrupted.run():
        if info.step == 8:  # stopped after step 8; the newest checkpoint is step 6
            break
    resumed = Trainer.resume(target, seqs, config, tmp_path / "b")
    assert resumed.step == 6
    list(resumed.run())
    for (k1, v1), (k2, v2) in zip(tree_flatten(straight.drafter.parameters()),
                                  tree_flatten(resumed.drafter.parameters())):
        assert k1 == k2 and mx.array_equal(v1, v2).item(), k1


def test_resume_with_another_target_fails_and_keeps_checkpoint(setup, tmp_path):
    _, target, seqs = setup
    config = TrainConfig(steps=2, anchors=4, save_every=2)
    list(Trainer(_drafter(target), target, seqs, config, tmp_path).run())
    ckpt = tmp_path / "checkpoints" / "step_0000002"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    _, other = tiny_target("qwen3", vocab=64, hidden=32, layers=4, seed=9)
    with pytest.raises(MismatchError, match="trained for target"):
        Trainer.resume(other, seqs, config, tmp_path)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


@pytest.mark.parametrize("change, needle", [
    (dict(steps=10), "--steps 4; resuming with --steps 10"),  # would reshape the learning-rate schedule
    (dict(lr=1e-2, seed=3), "--lr 0.001, --seed 0; resuming with --lr 0.01, --seed 3"),
])
def test_resume_with_other_run_settings_is_refused(setup, tmp_path, change, needle):
    _, target, seqs = setup
    config = TrainConfig(steps=4, anchors=4, lr=1e-3, save_every=2)
    trainer = Trainer(_drafter(target), target, seqs, config, tmp_path)
    for info in trainer.run():
        if info.step == 2:
            break
    with pytest.raises(InputError, match=needle):
        Trainer.resume(target, seqs, TrainConfig(**{**config.__dict__, **change}), tmp_path)
    # Settings that do not shape the run may change.
    resumed = Trainer.resume(target, seqs, TrainConfig(**{**config.__dict__, "eval_every": 1, "save_every": 1}),
                             tmp_path)
    assert resumed.step == 2


def test_resume_of_a_finished_run_is_refused(setup, tmp_path):
    _, target, seqs = setup
    config = TrainConfig(steps=2, anchors=4, save_every=2)
    list(Trainer(_drafter(target), target, seqs, config, tmp_path).run())
    with pytest.raises(InputError, match="already finished its 2 steps"):
        Trainer.resume(target, seqs, config, tmp_path)


def test_fresh_run_into_an_earlier_run(setup, tmp_path):
    _, target, seqs = setup
    check_fresh_out(tmp_path / "new")  # a new folder is fine, and so is an unrelated one
    (tmp_path / "notes.txt").write_text("mine")
    check_fresh_out(tmp_path)
    list(Trainer(_drafter(target), target, seqs, TrainConfig(steps=2, anchors=4, save_every=1), tmp_path).run())
    with pytest.raises(InputError, match="checkpoints up to step_0000002.*--resume.*--overwrite"):
        check_fresh_out(tmp_path)
    check_fresh_out(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dflash-mlx", "notes.txt"]  # the run's mark stays
    check_fresh_out(tmp_path)


def test_resume_without_checkpoint(setup, tmp_path):
    _, target, seqs = setup
    with pytest.raises(InputError, match="no checkpoint"):
        Trainer.resume(target, seqs, TrainConfig(), tmp_path)


def test_empty_prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n\n")
    with pytest.raises(InputError, match="empty"):
        read_prompt_file(path)
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(InputError, match="prompts.jsonl:1"):
        read_prompt_file(path)


def test_prompt_longer_than_max_length(setup, tmp_path):
    model, _, _ = setup
    with pytest.raises(InputError, match="--max-length 8"):
        regenerate(None, None, [[1, 2, 3], list(range(10))], tmp_path, max_length=8)
    assert not (tmp_path / "manifest.json").exists()


def test_a_data_folder_of_other_settings_names_them(setup, tmp_path):
    """Regenerating into a folder made with other settings is refused, naming what differs."""
    _, target, _ = setup
    from conftest import ByteTokenizer

    regenerate(target, ByteTokenizer(), [[5, 9, 11]], tmp_path, max_tokens=3, end_tokens=[None], target_id="a")
    with pytest.raises(InputError, match=r"other max_tokens 3 \(now 4\), target 'a' \(now 'b'\); pass a new --out"):
        regenerate(target, ByteTokenizer(), [[5, 9, 11]], tmp_path, max_tokens=4, end_tokens=[None], target_id="b")
    with pytest.raises(InputError, match=r"holds data from other prompts; pass a new --out"):
        regenerate(target, ByteTokenizer(), [[5, 9]], tmp_path, max_tokens=3, end_tokens=[None], target_id="a")


def test_bad_layer_ids_and_mask(setup):
    _, target, _ = setup
    with pytest.raises(InputError, match="--target-layer-ids"):
        init_drafter(target, 0, target_layer_ids=[0, 3])
    with pytest.raises(InputError, match="--mask-token-id"):
        init_drafter(target, 64)


def test_bfloat16_training_runs_and_learns(setup, tmp_path):
    _, target, seqs = setup
    drafter = _drafter(target)
    config = TrainConfig(steps=30, anchors=16, grad_accum=1, lr=3e-3, dtype="bfloat16")
    losses = [info.loss for info in Trainer(drafter, target, seqs, config, tmp_path).run()]
    assert drafter.fc.weight.dtype == mx.bfloat16
    assert all(np.isfinite(losses)) and np.mean(losses[-5:]) < np.mean(losses[:5])


@pytest.mark.parametrize("negatives,step", [(0, False), (5, False), (10**6, False), (5, True), (10**6, True)])
def test_loss_vocab_data_is_the_cross_entropy_over_its_columns(setup, negatives, step):
    """--loss-vocab data: the loss equals the cross-entropy, computed by hand, of the full logits restricted
    to the data's tokens and the drawn others, each drawn logit raised by log(R / K); with every other token
    drawn (10**6 asks for more than there are) that is the full vocabulary's cross-entropy. ``step``
    (--loss-vocab step): the data is the step's own target tokens."""
    from dflash_mlx.train.loss import LossVocab

    _, target, seqs = setup
    drafter = _drafter(target)
    vocab = LossVocab(target, seqs, mx.float32, negatives=negatives)
    rest = target.vocab_size - vocab.ids.size
    assert 0 < vocab.ids.size and rest > 5  # a real subset, else the test proves nothing
    seq = seqs[2]
    anchors = sample_anchors(np.random.default_rng(5), seq.tokens.size, seq.response_start, B, 8)
    weights = mx.array(position_weights(B, 4.0))
    feats = target_features(target, seq.tokens, drafter.target_layer_ids, mx.float32)
    blocks, targets, anchors_mx, mask = make_batch(seq, B, 0, anchors)
    data_size = vocab.ids.size
    vocab.draw(np.random.default_rng(3), np.array(targets) if step else None)
    rest = target.vocab_size - vocab.ids.size
    assert not step or 0 < vocab.ids.size < data_size
    got = block_loss(drafter, feats, blocks, targets, anchors_mx, mask, weights, vocab=vocab).item()
    logits = np.array(drafter.block_logits(blocks, feats, anchors_mx, mask))
    data = logits[..., vocab.ids]
    drawn = vocab.columns[vocab.ids.size:]
    assert len(set(drawn.tolist()) & set(vocab.ids.tolist())) == 0 and drawn.size == min(negatives, rest)
    extra = logits[..., drawn] + (np.log(rest / drawn.size) if drawn.size else 0.0)
    cols = np.concatenate([data, extra], axis=-1)
    cols -= cols.max(axis=-1, keepdims=True)
    log_p = cols - np.log(np.exp(cols).sum(axis=-1, keepdims=True))
    idx = np.searchsorted(vocab.ids, np.array(targets))
    per_row = -np.take_along_axis(log_p, idx[..., None], axis=-1)[..., 0]
    w = np.array(weights)
    want = (per_row * w).sum() / (w.sum() * blocks.shape[0])
    assert abs(got - want) < 1e-4 * abs(want)
    if negatives >= rest:
        full = -np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)),
                                   np.array(targets)[..., None], axis=-1)[..., 0]
        assert abs(got - (full * w).sum() / (w.sum() * blocks.shape[0])) < 1e-4 * abs(want)


@pytest.mark.parametrize("loss_vocab", ["data", "step"])
def test_loss_vocab_refuses_a_softcapped_head_naming_the_flag_given(loss_vocab):
    """A sampled softmax needs the head to be a matrix product: Gemma 4's softcapped logits are refused, in one
    line naming the --loss-vocab value the user gave and the one that works."""
    from dflash_mlx.train.loss import LossVocab

    _, target = tiny_target("gemma4_text", vocab=256, hidden=32, layers=4)
    with pytest.raises(InputError, match=f"^--loss-vocab {loss_vocab} needs a linear output head.*--loss-vocab full$"):
        LossVocab(target, tiny_training_set(2, 8)[2], mx.float32, loss_vocab)


@pytest.mark.parametrize("loss_vocab", ["data", "step"])
def test_loss_vocab_data_run_learns_and_pushes_the_rest_down(tmp_path, loss_vocab):
    """A short --loss-vocab data (or step) run learns, and no held-out argmax over the whole vocabulary falls
    outside the data's tokens (when the rest got no gradient, 5 of 336 did here; on SmolLM2 most did)."""
    from conftest import mlx_lm_greedy
    from dflash_mlx.train.data import TrainSequence

    model, target = tiny_target("qwen3", vocab=256, hidden=32, layers=3, seed=5, scale=1.5)
    rng = np.random.default_rng(0)
    seqs = [TrainSequence(np.array(p + mlx_lm_greedy(model, p, 48), dtype=np.int32), 4)
            for p in (rng.integers(3, 40, size=4).tolist() for _ in range(12))]
    data = np.unique(np.concatenate([s.tokens for s in seqs]))
    assert data.size < 0.6 * target.vocab_size
    config = TrainConfig(steps=60, anchors=16, grad_accum=2, lr=3e-3, warmup=0.05, loss_vocab=loss_vocab)
    trainer = Trainer(_drafter(target), target, seqs, config, tmp_path / "out")
    losses = [info.loss for info in trainer.run()]
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])
    assert evaluate_block_sizes(trainer.drafter, target, seqs[:4], [B])[B]["tau"] > 1.3
    picks = []
    for seq in seqs[:6]:
        anchors = sample_anchors(np.random.default_rng(1), seq.tokens.size, seq.response_start, B, 8)
        feats = target_features(target, seq.tokens, trainer.drafter.target_layer_ids, mx.float32)
        blocks, _, anchors_mx, mask = make_batch(seq, B, 0, anchors)
        picks += np.array(trainer.drafter.block_logits(blocks, feats, anchors_mx, mask).argmax(-1)).ravel().tolist()
    assert np.isin(picks, data).all()
    with pytest.raises(InputError, match="--loss-vocab"):
        TrainConfig(loss_vocab="some").check()
    with pytest.raises(InputError, match="--kl-weight"):
        TrainConfig(loss_vocab=loss_vocab, kl_weight=1.0).check()


def test_regenerated_responses_stay_with_their_prompts(setup, tmp_path):
    """Prompts of different lengths are generated shortest first; each response is written beside its own
    prompt, and equals that prompt's greedy decoding."""
    from conftest import ByteTokenizer, mlx_lm_greedy
    from dflash_mlx.train.data import load_sequences

    model, target, _ = setup
    prompts = [[5, 9, 11, 3, 7, 8, 20], [4, 6], [30, 2, 9, 9, 12], [17, 3, 40], [8, 8, 1], [2, 50, 3, 4]]
    tokenizer = ByteTokenizer()
    regenerate(target, tokenizer, prompts, tmp_path, max_tokens=12, shard_size=6, batch_size=3,
               end_tokens=[None] * len(prompts))
    seqs = load_sequences(tmp_path)
    assert [s.tokens[:s.response_start].tolist() for s in seqs] == prompts
    for seq, prompt in zip(seqs, prompts):
        assert seq.tokens[seq.response_start:].tolist() == mlx_lm_greedy(model, prompt, 12)


def test_features_kept_while_generating_equal_a_forward_of_the_sequence(setup, tmp_path):
    """`dflash data --target-layer-ids`: the features the target computed while generating, batched, left
    padded and joining as others finish, equal one plain forward of each whole sequence through mlx-lm's
    layers (a hand-made capture); training reads them instead of computing its own."""
    from conftest import ByteTokenizer
    from dflash_mlx.train.data import load_sequences
    from dflash_mlx.train.features import FeatureStore
    from dflash_mlx.train.loss import FeatureCache

    model, target, _ = setup
    prompts = [[5, 9, 11, 3, 7, 8, 20], [4, 6], [30, 2, 9, 9, 12], [17, 3, 40], [8, 8, 1]]
    store = FeatureStore(tmp_path / "data" / "features", target, [0, 2], write=True)
    regenerate(target, ByteTokenizer(), prompts, tmp_path / "data", max_tokens=10, shard_size=5, batch_size=2,
               end_tokens=[None] * len(prompts), keep_features=store.put, capture=[0, 2])
    for seq in load_sequences(tmp_path / "data"):
        kept = store.get(seq.tokens)
        assert kept is not None and kept.dtype == np.float16 and kept.shape == (1, seq.tokens.size, 2 * 32)
        h, rows = model.model.embed_tokens(mx.array(seq.tokens[None])), []
        for i, layer in enumerate(model.model.layers):
            h = layer(h, "causal", None)
            if i in (0, 2):  # Hugging Face's hidden_states[i + 1]: the last layer's after the final norm
                rows.append(model.model.norm(h) if i == len(model.model.layers) - 1 else h)
        want = np.array(mx.concatenate(rows, axis=-1))[0, :-1]  # the last token's row is never fed
        assert np.allclose(kept[0, :-1].astype(np.float32), want, atol=2e-2, rtol=1e-2)
        assert not kept[0, -1].any()
    cache = FeatureCache(target, [0, 2], stores=[FeatureStore(tmp_path / "data" / "features", target, [0, 2])])
    seq = load_sequences(tmp_path / "data")[0]
    assert np.array_equal(np.array(cache.get(seq, mx.float16)[0]), store.get(seq.tokens))
    other = FeatureCache(target, [1, 2], stores=[FeatureStore(tmp_path / "data" / "features", target, [1, 2])])
    assert other.stores == [] and "other layers" in other.unused[0]


@pytest.fixture(scope="module")
def wide_set():
    """A target as wide as SmolLM2-135M (hidden 576) and 8 varied sequences of its greedy output."""
    from conftest import assert_varied, mlx_lm_greedy
    from dflash_mlx.train.data import TrainSequence

    model, target = tiny_target("llama", vocab=512, hidden=576, layers=4, seed=5, scale=2.0)
    rng = np.random.default_rng(0)
    seqs = [TrainSequence(np.array(p + mlx_lm_greedy(model, p, 60), dtype=np.int32), 4)
            for p in (rng.integers(3, 500, size=4).tolist() for _ in range(8))]
    assert_varied(np.concatenate([s.tokens[4:] for s in seqs]).tolist(), at_least=40)
    return target, seqs


def _wide_run(wide_set, tmp_path, **settings):
    target, seqs = wide_set
    drafter = init_drafter(target, mask_token_id=0, layers=1, block_size=B, target_layer_ids=[1, 2], seed=0)
    config = TrainConfig(**{"steps": 100, "anchors": 16, "grad_accum": 1, "warmup": 0.05, **settings})
    return config, list(Trainer(drafter, target, seqs, config, tmp_path).run())


def test_the_default_rate_memorises_a_few_sequences_at_a_real_width(wide_set, tmp_path):
    """At the published rate (the default) a 576-wide drafter learns 8 sequences and stays healthy; it is
    below the width's stable rate, so no warning."""
    from dflash_mlx.train.health import lr_warning

    config, infos = _wide_run(wide_set, tmp_path)
    losses = [i.loss for i in infos]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    measured = [i for i in infos if i.health is not None]
    assert [i.step for i in measured] == [1, 50, 100]
    assert measured[-1].health.warning(config.lr) is None and measured[-1].health.rms < 100
    assert lr_warning(config.lr, 576) is None and lr_warning(3e-3, 64) is None


def test_a_rate_far_too_high_collapses_and_says_so(wide_set, tmp_path):
    """At 2e-2 the same drafter collapses (residual RMS in the millions, every block row alike, loss stuck):
    the health measured says so, and the rate is warned about before the run."""
    from dflash_mlx.train.health import lr_warning

    config, infos = _wide_run(wide_set, tmp_path, lr=2e-2, steps=60)
    last = infos[-1].health
    assert "collapsing" in last.warning(config.lr) and "--lr (now 0.02)" in last.warning(config.lr)
    assert np.mean([i.loss for i in infos[-10:]]) > 0.8 * np.mean([i.loss for i in infos[:10]])  # stuck
    assert "--lr 0.02" in lr_warning(2e-2, 576) and lr_warning(2e-3, 576) is not None
