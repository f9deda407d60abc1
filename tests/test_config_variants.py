"""Config variants other tools write for the same drafter (dflash_mlx/drafter/variants.py):
each is read into the same drafter, or refused with one line naming the field.

A tiny v1 drafter (and a sliding one) is saved here, its config rewritten the other tool's
way, and loaded back: the drafts must equal the original's.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_mlx import DrafterArgs, bind_drafter, load_drafter, save_drafter
from dflash_mlx.drafter.formats import DFLASH2, V1
from dflash_mlx.drafter.vocab import set_draft_vocab
from dflash_mlx.errors import CheckpointError, ConfigError
from conftest import format_drafter, tiny_target

B = 8


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")[1]


def _drafts(drafter, target, seed=0):
    """Greedy drafts of three calls over random context features (the same for every drafter)."""
    rng = np.random.default_rng(seed)
    cache, out = drafter.make_cache(), []
    F = len(drafter.target_layer_ids) * target.hidden_size
    for rows, token in ((7, 17), (3, 42), (9, 5)):
        ctx = mx.array(rng.standard_normal((1, rows, F)).astype(np.float32))
        out.append(drafter.draft(mx.array([token]), ctx, cache, B).tolist())
    return out


def _saved(target, tmp_path, fmt="v1"):
    drafter = format_drafter(target, fmt)
    folder = save_drafter(drafter, tmp_path / "orig")
    return drafter, folder, json.loads((folder / "config.json").read_text())


def _load(folder, config, target):
    (folder / "config.json").write_text(json.dumps(config))
    return bind_drafter(load_drafter(str(folder)), target)


def test_ids_mask_and_block_at_the_top_level_as_sglang_writes(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    nested = cfg.pop("dflash_config")
    cfg.update(mask_token_id=nested["mask_token_id"], target_layer_ids=nested["target_layer_ids"])
    loaded = _load(folder, cfg, target)
    assert loaded.args.mask_token_id == drafter.args.mask_token_id and loaded.block_size == B
    assert _drafts(loaded, target) == _drafts(drafter, target)


def test_block_size_and_num_target_layers_under_dflash_config(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    cfg["dflash_config"].update(block_size=cfg.pop("block_size"), num_target_layers=cfg.pop("num_target_layers"))
    loaded = _load(folder, cfg, target)
    assert loaded.block_size == B and loaded.args.num_target_layers == drafter.args.num_target_layers


@pytest.mark.parametrize("key,top,nested", [("mask_token_id", 3, 4), ("block_size", 8, 16)])
def test_two_places_that_disagree_are_refused(target, tmp_path, key, top, nested):
    _, folder, cfg = _saved(target, tmp_path)
    cfg[key], cfg["dflash_config"][key] = top, nested
    with pytest.raises(ConfigError, match=f"'dflash_config.{key}' {nested} and top-level '{key}' {top} disagree"):
        _load(folder, cfg, target)


def test_rope_parameters_instead_of_rope_theta(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    loaded = _load(folder, cfg, target)
    assert loaded.args.rope_theta == drafter.args.rope_theta
    assert _drafts(loaded, target) == _drafts(drafter, target)
    cfg["rope_theta"] = 5.0
    with pytest.raises(ConfigError, match="'rope_theta' 5.0 and 'rope_parameters.rope_theta'"):
        _load(folder, cfg, target)


def test_vllm_swa_keys_stand_for_the_window(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path, "v1-sliding")
    cfg["dflash_config"].update(use_swa=True, swa_window_size=cfg.pop("sliding_window"))
    loaded = _load(folder, cfg, target)
    assert loaded.args.sliding_window == 5
    assert _drafts(loaded, target) == _drafts(drafter, target)


@pytest.mark.parametrize("change,field", [
    (dict(swa_window_size=7), "dflash_config.swa_window_size"),
    (dict(use_swa=False), "dflash_config.use_swa"),
    (dict(use_swa="yes"), "dflash_config.use_swa"),
])
def test_vllm_swa_keys_that_contradict_are_refused(target, tmp_path, change, field):
    _, folder, cfg = _saved(target, tmp_path, "v1-sliding")
    cfg["dflash_config"].update(change)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        _load(folder, cfg, target)


def test_use_swa_without_sliding_layers_is_refused(target, tmp_path):
    _, folder, cfg = _saved(target, tmp_path)
    cfg["dflash_config"]["use_swa"] = True
    with pytest.raises(ConfigError, match="'dflash_config.use_swa' is true but 'layer_types' names no sliding"):
        _load(folder, cfg, target)


def test_vllm_causal_key_sets_in_block_causality(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    cfg["dflash_config"]["causal"] = True
    loaded = _load(folder, cfg, target)
    assert loaded.args.is_causal is True and loaded.args.is_causal_layer(0)
    cfg["is_causal"] = False
    with pytest.raises(ConfigError, match="'dflash_config.causal' True and 'is_causal' False disagree"):
        _load(folder, cfg, target)


def test_target_hidden_size_must_be_the_width(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    cfg["target_hidden_size"] = cfg["hidden_size"]
    assert _drafts(_load(folder, cfg, target), target) == _drafts(drafter, target)
    cfg["target_hidden_size"] = 2 * cfg["hidden_size"]
    with pytest.raises(ConfigError, match="'target_hidden_size' 128 differs from hidden_size 64"):
        _load(folder, cfg, target)


def test_reduced_draft_vocabulary_drafts_inside_it(target, tmp_path):
    """EAGLE-3's ``draft_vocab_size`` and ``d2t`` (FR-Spec's reduced head): each draft is the argmax of the whole
    head's logits over the mapped tokens only (masked here by numpy); saved back as read; a map without its size,
    or a size past the vocabulary, is refused in one line."""
    drafter, folder, cfg = _saved(target, tmp_path)
    ids = np.sort(np.random.default_rng(3).choice(cfg["vocab_size"], 32, replace=False))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "d2t": ids - np.arange(32)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected weight 'd2t'"):
        _load(folder, cfg, target)
    cfg["draft_vocab_size"] = 257
    with pytest.raises(ConfigError, match="'draft_vocab_size' 257 must be 1 to vocab_size 256"):
        _load(folder, cfg, target)
    cfg["draft_vocab_size"] = 32
    reduced, rng = _load(folder, cfg, target), np.random.default_rng(0)
    caches, F = (drafter.make_cache(), reduced.make_cache()), len(drafter.target_layer_ids) * target.hidden_size
    changed = 0
    for rows, token in ((7, 17), (3, 42), (9, 5)):
        ctx = mx.array(rng.standard_normal((1, rows, F)).astype(np.float32))
        whole = np.array(drafter.propose(mx.array([token]), ctx, caches[0], B).logprobs)
        masked = np.full_like(whole, -np.inf)
        masked[:, ids] = whole[:, ids]
        drafts = reduced.draft(mx.array([token]), ctx, caches[1], B).tolist()
        assert drafts == masked.argmax(axis=-1).tolist()
        changed += drafts != whole.argmax(axis=-1).tolist()
    assert changed  # the restriction changed some drafts
    again = save_drafter(reduced, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["draft_vocab_size"] == 32
    assert (load_file(str(again / "model.safetensors"))["d2t"] == ids - np.arange(32)).all()
    # the map dropped (as `dflash train --init` does to train over the whole vocabulary): saved as the whole
    # vocabulary, so its checkpoints load
    set_draft_vocab(reduced, None)
    whole = save_drafter(reduced, tmp_path / "whole")
    assert json.loads((whole / "config.json").read_text())["draft_vocab_size"] == cfg["vocab_size"]
    assert "d2t" not in load_file(str(whole / "model.safetensors"))
    assert load_drafter(whole).args.draft_vocab_size is None


def test_a_reduced_vocabulary_applies_after_the_logit_softcap(target):
    """DFlash2's softcap maps -inf to -cap: the draft vocabulary is placed after it, so q is 0 outside it."""
    drafter = format_drafter(target, "dflash2", bind=False)
    assert drafter.args.final_logit_softcapping
    set_draft_vocab(drafter, mx.arange(0, target.vocab_size, 2))
    bind_drafter(drafter, target)
    F = len(drafter.target_layer_ids) * target.hidden_size
    context = mx.array(np.random.default_rng(1).standard_normal((1, 4, F)).astype(np.float32))
    proposal = drafter.propose(mx.array([3]), context, drafter.make_cache(), B)
    assert np.isneginf(np.array(proposal.logprobs)[:, 1::2]).all()
    assert all(t % 2 == 0 for t in proposal.tokens.tolist())


def test_separate_mask_embedding_is_used_for_masked_rows(target, tmp_path):
    drafter, folder, cfg = _saved(target, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    mask_row = np.array(target.embed(mx.array([drafter.args.mask_token_id]))[0])
    save_file({**weights, "mask_embedding": mask_row}, str(folder / "model.safetensors"))
    loaded = _load(folder, cfg, target)
    assert loaded.args.mask_embedding
    assert _drafts(loaded, target) == _drafts(drafter, target)  # the same row: the same drafts
    save_file({**weights, "mask_embedding": mask_row + 3.0}, str(folder / "model.safetensors"))
    assert _drafts(_load(folder, cfg, target), target) != _drafts(drafter, target)  # another row: it is read
    save_drafter(loaded, tmp_path / "again")
    assert "mask_embedding" in load_file(str(tmp_path / "again" / "model.safetensors"))
    assert "mask_embedding" not in (tmp_path / "again" / "config.json").read_text()


def test_each_format_owns_its_keys():
    assert V1.keys == () and {k.name for k in DFLASH2.keys} >= {"conv_kernel_size", "selector_top_k"}
    base = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                vocab_size=256, dflash_config={"target_layer_ids": [1], "mask_token_id": 5,
                                               "conv_kernel_size": 3})
    args = DrafterArgs.from_config(base)  # v1 reads no DFlash2 key (its stray key is kept, not parsed)
    assert args.conv_kernel_size == 0 and args.to_config()["dflash_config"]["conv_kernel_size"] == 3
    with pytest.raises(ConfigError, match="missing key 'dflash_config.conv_group_size' .needed by DFlash2DraftModel"):
        DrafterArgs.from_config(dict(base, architectures=["DFlash2DraftModel"]))


def test_a_reduced_vocabulary_on_a_capped_target_is_its_capped_head(monkeypatch):
    """A Gemma 4 target caps its logits (``final_logit_softcapping``): the reduced head is rows of its linear head,
    capped after (bind's ``logit_cap``), so the draft distribution over the mapped tokens is the whole drafter's,
    renormalized there (numpy)."""
    target = tiny_target("gemma4_text")[1]
    monkeypatch.setattr(target.text, "final_logit_softcapping", 0.5)  # small: the cap shapes every logit
    ids = np.sort(np.random.default_rng(3).choice(target.vocab_size, 32, replace=False))
    whole, reduced = format_drafter(target, "v1"), format_drafter(target, "v1", bind=False)
    set_draft_vocab(reduced, mx.array(ids))
    bind_drafter(reduced, target)
    F = len(whole.target_layer_ids) * target.hidden_size
    context = mx.array(np.random.default_rng(1).standard_normal((1, 5, F)).astype(np.float32))
    p, q = (np.array(d.propose(mx.array([3]), context, d.make_cache(), B).logprobs, dtype=np.float64)[:, ids]
            for d in (whole, reduced))
    assert np.ptp(p, axis=-1).max() < 1.0 + 1e-5  # capped: logits within +-0.5
    np.testing.assert_allclose(q, p - np.log(np.exp(p).sum(axis=-1, keepdims=True)), atol=1e-5)
