"""scripts/smollm2/cuda_train.py (PyTorch, for a CUDA machine) against this project's MLX training code: its
target, read from a GGUF file, gives mlx-lm's model's context features; its drafter, float or 8-bit as `dflash
convert` writes it, gives `dflash train`'s block loss and greedy acceptance lengths on the same anchors, also
beside a longer sequence in a padded batch.

Needs torch and transformers (the interop extra); skipped without them."""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[interop]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[interop]')")

from conftest import ROOT, tiny_drafter, tiny_target  # noqa: E402
from gguf_files import byte_level_vocab, write_gguf  # noqa: E402
from dflash_mlx import load_drafter  # noqa: E402
from dflash_mlx.pair.writing import write_drafter  # noqa: E402
from dflash_mlx.train.blocks import position_weights  # noqa: E402
from dflash_mlx.train.data import TrainSequence  # noqa: E402
from dflash_mlx.train.loss import block_loss, make_batch, target_features  # noqa: E402

spec = importlib.util.spec_from_file_location("cuda_train", ROOT / "scripts/smollm2/cuda_train.py")
ct = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ct)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny llama, its adapter, its GGUF file read back by cuda_train, a sequence and the drafters' folder."""
    tmp = tmp_path_factory.mktemp("cuda_train")
    _, tokens, merges = byte_level_vocab()
    model, target = tiny_target("llama", vocab=len(tokens), hidden=64, layers=4, seed=5)
    path = write_gguf(tmp / "t.gguf", model, tokens, merges=merges)
    a = model.args
    cfg = {"hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
           "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
           "num_key_value_heads": a.num_key_value_heads, "head_dim": a.hidden_size // a.num_attention_heads,
           "rms_norm_eps": a.rms_norm_eps, "max_position_embeddings": 4096, "vocab_size": len(tokens),
           "tie_word_embeddings": a.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
           "rope_theta": a.rope_theta}
    theirs = ct.load_target(str(path), cfg, CPU)
    seq = TrainSequence(np.random.default_rng(0).integers(0, len(tokens) - 1, 90).astype(np.int32), 20)
    return target, theirs, seq, tmp


def test_gguf_target_gives_mlx_lm_features(setup):
    """The same residual streams after layers 1 and 3 (llama.cpp's rotary interleave undone)."""
    target, theirs, seq, _ = setup
    ours = np.array(target_features(target, seq.tokens, [1, 3], mx.float32)[0])
    ids = torch.from_numpy(seq.tokens.astype(np.int64))[None]
    got = ct.target_features(theirs, ids, torch.ones_like(ids), [1, 3])[0].numpy()
    assert np.abs(ours).max() > 0.1
    np.testing.assert_allclose(got, ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())


@pytest.mark.parametrize("bits", [None, 8])
def test_drafter_block_loss_equals_dflash_train(setup, bits):
    """Block logits, loss and acceptance lengths at B=8 and B=4 on the same anchors: MLX's (`dflash train`'s
    loss, full vocabulary) and cuda_train's, from one drafter file; the sequence alone and first in a padded
    batch beside a longer one."""
    target, theirs, seq, tmp = setup
    drafter = tiny_drafter(target, layers=2, block_size=8, layer_ids=[1, 3])
    folder = tmp / f"drafter-{bits}"
    write_drafter(drafter, folder, bits, 64)
    ours = load_drafter(str(folder)).bind(target.embed, target.lm_head)
    cfg = json.loads((folder / "config.json").read_text())
    mine = ct.make_drafter(cfg)
    ct.load_drafter_weights(mine, folder)
    embed = theirs.model.embed_tokens.weight.detach()
    mask_id, feats = cfg["dflash_config"]["mask_token_id"], target_features(target, seq.tokens, [1, 3], mx.float32)
    longer = np.concatenate([seq.tokens, seq.tokens[:30]]).astype(np.int64)
    for B in (8, 4):
        anchors = np.arange(seq.response_start, seq.tokens.size - B + 1, 3).astype(np.int32)
        batch = make_batch(seq, B, mask_id, anchors)
        logits = np.array(ours.block_logits(batch[0], feats, batch[2], batch[3]))
        loss, lengths = block_loss(ours, feats, *batch, mx.array(position_weights(B, ct.GAMMA[B])), with_lengths=True)
        for pair in ([(seq.tokens.astype(np.int64), seq.response_start)],
                     [(seq.tokens.astype(np.int64), seq.response_start), (longer, seq.response_start)]):
            mine_batch = ct.make_batch(pair, np.random.default_rng(0), B, anchors.size, CPU)
            tokens, attention, at, valid, labels = mine_batch
            at[0], valid[0] = torch.from_numpy(anchors.astype(np.int64)), True
            labels[0] = torch.from_numpy(seq.tokens[anchors[:, None] + np.arange(1, B)].astype(np.int64))
            with torch.no_grad():
                got, got_lengths = ct.block_loss(mine, cfg, theirs, embed, mine_batch, mask_id, B, [1, 3])
                blocks = torch.full((*at.shape, B), mask_id, dtype=torch.long)
                blocks[:, :, 0] = torch.gather(tokens, 1, at)
                f = ct.target_features(theirs, tokens, attention, [1, 3])
                h = ct.drafter_hidden(mine, cfg, embed, f, blocks, at, valid)
            np.testing.assert_allclose((h[0] @ theirs.lm_head.weight.T).numpy(), logits, rtol=1e-3,
                                       atol=1e-3 * np.abs(logits).max())
            np.testing.assert_array_equal(got_lengths[: anchors.size].numpy(), np.array(lengths))
            if len(pair) == 1:  # the padded batch's loss averages over the second sequence's blocks too
                assert abs(float(got) - loss.item()) < 1e-4 * abs(loss.item())
    # a file with a draft vocabulary (d2t) loads the same weights: cuda_train trains over the whole vocabulary
    raw = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), {**raw, "d2t": mx.arange(4, dtype=mx.int32)})
    again = ct.make_drafter(cfg)
    ct.load_drafter_weights(again, folder)
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), again.state_dict().values()))


def test_generation_out_of_memory_keeps_what_was_made(setup):
    """A batch the GPU has no memory for runs again in halves; the replies made before it are kept."""
    theirs, prompts, calls = setup[1], [[5, 6, 7]] * 5 + [[8] * 9] * 3, []
    generate = theirs.generate

    def scarce(input_ids, **kw):  # no memory for more than 2 sequences of 9 prompt tokens
        calls.append(tuple(input_ids.shape))
        if input_ids.shape[0] > 2 and input_ids.shape[1] >= 9:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return generate(input_ids=input_ids, **kw)

    theirs.generate, lines = scarce, []
    try:
        made = ct.generate(theirs, prompts, 2, CPU, lines.append, float("inf"), 4, do_sample=False, max_new_tokens=2)
    finally:
        del theirs.generate
    assert [n for _, n, _ in made] == [3] * 5 + [9] * 3  # every prompt, in its order
    assert calls == [(4, 3), (4, 9), (2, 9), (2, 9)], calls
    assert any("batches of 2 from here" in line for line in lines)
