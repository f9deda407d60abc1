"""Drafters move between this project and the authors' code (z-lab ``dflash`` 0.1.0 on PyPI).

A drafter saved here (v1, and v1 with a causal sliding-window layer) loads in the authors'
PyTorch ``DFlashDraftModel`` (``dflash/model.py``, through transformers) and in their MLX
``load_draft`` (``dflash/model_mlx.py``); given the same target features, its block logits
match ours within 1e-4 in float32 and its greedy drafts are equal. The other way round, a
drafter written by their PyTorch code (``save_pretrained``) loads here and drafts the same.

Needs the ``interop`` extra (``pip install -e ".[interop]"``: CPU torch, transformers and
``dflash``); skipped without it. The extra installs a ``dflash`` command of its own:
reinstall this project afterwards (``pip install -e .``) to get ours back.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra is not installed (pip install -e '.[interop]')")
theirs_pt = pytest.importorskip("dflash.model", reason="the authors' dflash package (interop extra) is not installed")
theirs_mlx = pytest.importorskip("dflash.model_mlx", reason="the authors' dflash package has no model_mlx")

from dflash_mlx import bind_drafter, load_drafter, save_drafter  # noqa: E402
from conftest import format_drafter, tiny_target  # noqa: E402

B = 8
TOL = 1e-4
CALLS = [(9, 17), (3, 42), (12, 5)]  # (new context rows, first block token): past the window of 5


@pytest.fixture(scope="module")
def pair():
    return tiny_target("qwen3")  # (mlx-lm model, adapter), float32


def _features(drafter, target, rows, seed):
    F = len(drafter.target_layer_ids) * target.hidden_size
    return np.random.default_rng(seed).standard_normal((1, rows, F)).astype(np.float32)


def _block(mask_id, token):
    return np.array([[token] + [mask_id] * (B - 1)], dtype=np.int32)


def _ours(drafter, target, calls=CALLS):
    """Our logits [B-1, V] per call, one cache across the calls (context grows)."""
    cache, out = drafter.make_cache(), []
    for i, (rows, token) in enumerate(calls):
        ctx = mx.array(_features(drafter, target, rows, i))
        out.append(np.array(drafter(mx.array(_block(drafter.args.mask_token_id, token)), ctx, cache)[0]))
    return out


def _torch_logits(model, target, ctx, block):
    """The authors' PyTorch forward on one block over ``ctx`` (no cache): logits [B-1, V]
    through our target's head (the drafter has none of its own)."""
    S = ctx.shape[1]
    emb = torch.tensor(np.array(target.embed(mx.array(block))))
    with torch.no_grad():
        hidden = model(position_ids=torch.arange(S + B)[None], noise_embedding=emb,
                       target_hidden=torch.tensor(ctx))[:, 1:]
    return np.array(target.lm_head(mx.array(hidden.numpy())))[0]


def _assert_same(a, b):
    assert np.abs(a - b).max() < TOL, np.abs(a - b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()  # the greedy drafts


@pytest.mark.parametrize("fmt", ["v1", "v1-sliding"])
def test_ours_loads_in_their_pytorch_model(pair, tmp_path, fmt):
    _, target = pair
    drafter = format_drafter(target, fmt)
    folder = save_drafter(drafter, tmp_path / fmt)
    model = theirs_pt.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert model.mask_token_id == drafter.args.mask_token_id and model.block_size == B
    assert [layer.self_attn.sliding_window for layer in model.layers] == \
        [drafter.args.sliding_window if drafter.args.is_sliding(i) else None for i in range(2)]
    for i, (rows, token) in enumerate(CALLS):  # each call alone: a fresh cache on both sides
        ctx = _features(drafter, target, rows, i)
        block = _block(drafter.args.mask_token_id, token)
        ours = np.array(drafter(mx.array(block), mx.array(ctx), drafter.make_cache())[0])
        _assert_same(_torch_logits(model, target, ctx, block), ours)


@pytest.mark.parametrize("fmt", ["v1", "v1-sliding"])
def test_ours_loads_in_their_mlx_load_draft(pair, tmp_path, fmt, monkeypatch):
    # Window 8 = B: the authors' MLX code does not window the block's own keys, their
    # PyTorch code (and ours) does, so the two differ when B > W (released windows are >> B).
    model, target = pair
    drafter = format_drafter(target, fmt, **({"sliding_window": B} if fmt == "v1-sliding" else {}))
    folder = save_drafter(drafter, tmp_path / fmt)
    monkeypatch.setattr(theirs_mlx, "snapshot_download", lambda repo, **kw: repo)  # a local folder, offline
    theirs = theirs_mlx.load_draft(str(folder)).bind(model)
    cache = theirs.make_cache()
    for (rows, token), ours in zip(CALLS, _ours(drafter, target)):
        ctx = mx.array(_features(drafter, target, rows, CALLS.index((rows, token))))
        logits = np.array(theirs(mx.array(_block(drafter.args.mask_token_id, token)), ctx, cache, logits_start=1)[0])
        _assert_same(logits, ours)


def _their_drafter(folder, sliding):
    """A random drafter made and saved by the authors' PyTorch code."""
    from transformers import Qwen3Config

    layer_types = ["sliding_attention", "full_attention"] if sliding else ["full_attention"] * 2
    config = Qwen3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, rms_norm_eps=1e-6, max_position_embeddings=4096,
        layer_types=layer_types, use_sliding_window=sliding, sliding_window=5 if sliding else None,
        architectures=["DFlashDraftModel"], block_size=B, num_target_layers=4,
        dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 255},
    )
    torch.manual_seed(3)
    model = theirs_pt.DFlashDraftModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("sliding", [False, True], ids=["v1", "v1-sliding"])
def test_theirs_loads_here_and_drafts_the_same(pair, tmp_path, sliding):
    _, target = pair
    model = _their_drafter(tmp_path / "theirs", sliding)
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())
    drafter = bind_drafter(load_drafter(str(tmp_path / "theirs")), target)
    assert drafter.args.sliding_window == (5 if sliding else None) and drafter.block_size == B
    assert config["architectures"] == ["DFlashDraftModel"]
    for i, (rows, token) in enumerate(CALLS):
        ctx = _features(drafter, target, rows, i)
        block = _block(255, token)
        ours = np.array(drafter(mx.array(block), mx.array(ctx), drafter.make_cache())[0])
        _assert_same(_torch_logits(model, target, ctx, block), ours)
