"""Bad input fails with a clear error naming the file, key or flag, and loses nothing."""

import json

import mlx.core as mx
import pytest

from dflash_mlx import (
    CheckpointError, ConfigError, DFlashDrafter, InputError, MismatchError,
    bind_drafter, check_pair, generate_step, load_drafter, load_target, save_drafter,
)
from conftest import tiny_drafter, tiny_drafter_args, tiny_target

PROMPT = mx.array([3, 14, 15, 92], dtype=mx.int32)


@pytest.fixture(scope="module")
def pair():
    _, target = tiny_target("qwen3")
    return target, tiny_drafter(target, block_size=8)


@pytest.fixture
def saved(pair, tmp_path):
    """A valid drafter folder on disk."""
    return save_drafter(pair[1], tmp_path / "drafter")


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def edit_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


# --- missing or corrupt checkpoints ---------------------------------------------

def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match="nope"):
        load_drafter(str(missing))
    with pytest.raises(CheckpointError) as e:
        load_target(str(missing))
    assert str(missing) in str(e.value)
    assert not missing.exists()


def test_target_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_target(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value)


def test_plain_qwen3_config_is_not_a_drafter(saved):
    def plain(cfg):
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        del cfg["dflash_config"]
    edit_config(saved, plain)
    with pytest.raises(ConfigError) as e:
        load_drafter(str(saved))
    msg = str(e.value)
    assert str(saved / "config.json") in msg and "dflash_config" in msg


def test_invalid_json(saved):
    (saved / "config.json").write_text('{"hidden_size": 64,')
    before = snapshot(saved)
    with pytest.raises(ConfigError) as e:
        load_drafter(str(saved))
    assert str(saved / "config.json") in str(e.value) and "JSON" in str(e.value)
    assert snapshot(saved) == before


def test_truncated_safetensors_loses_nothing(saved):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    before = snapshot(saved)
    with pytest.raises(CheckpointError) as e:
        load_drafter(str(saved))
    assert str(f) in str(e.value)
    # The failed load wrote nothing and removed nothing.
    assert snapshot(saved) == before


def test_missing_weight_key(saved):
    f = saved / "model.safetensors"
    weights = mx.load(str(f))
    del weights["norm.weight"]
    mx.save_safetensors(str(f), weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_drafter(str(saved))
    assert str(saved) in str(e.value) and "norm.weight" in str(e.value)


def test_no_weight_files(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        load_drafter(str(saved))
    assert str(saved) in str(e.value) and "safetensors" in str(e.value)


# --- config values --------------------------------------------------------------

def test_mask_token_outside_vocab(saved, pair):
    vocab = pair[0].vocab_size
    edit_config(saved, lambda cfg: cfg["dflash_config"].update(mask_token_id=vocab))
    with pytest.raises(ConfigError) as e:
        load_drafter(str(saved))
    assert "dflash_config.mask_token_id" in str(e.value) and str(saved / "config.json") in str(e.value)


@pytest.mark.parametrize("edit, needle", [
    (lambda cfg: cfg.update(hidden_size="wide"), "'hidden_size' must be an integer, got 'wide'"),
    (lambda cfg: cfg.update(rms_norm_eps="small"), "'rms_norm_eps' must be a number"),
    (lambda cfg: cfg["dflash_config"].update(mask_token_id=1.5), "'dflash_config.mask_token_id' must be an integer"),
    (lambda cfg: cfg["dflash_config"].update(target_layer_ids="1,2"),
     "'dflash_config.target_layer_ids' must be a list"),
    (lambda cfg: cfg.update(dflash_config=[1]), "'dflash_config' must be an object"),
])
def test_config_values_of_the_wrong_type(saved, edit, needle):
    edit_config(saved, edit)
    with pytest.raises(ConfigError) as e:
        load_drafter(str(saved))
    assert str(saved / "config.json") in str(e.value) and needle in str(e.value)


def test_config_that_is_not_an_object(saved):
    (saved / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object, found list"):
        load_drafter(str(saved))


def test_missing_required_key(saved):
    edit_config(saved, lambda cfg: cfg.pop("vocab_size"))
    with pytest.raises(ConfigError, match="'vocab_size'"):
        load_drafter(str(saved))


# --- drafter vs target ----------------------------------------------------------

@pytest.mark.parametrize("key,value", [("vocab_size", 512), ("hidden_size", 32)])
def test_drafter_target_mismatch(pair, key, value):
    target = pair[0]
    args = tiny_drafter_args(target)
    setattr(args, key, value)
    drafter = DFlashDrafter(args)
    with pytest.raises(MismatchError) as e:
        check_pair(drafter, target, "some/drafter")
    assert key in str(e.value) and "some/drafter" in str(e.value)
    with pytest.raises(MismatchError, match=key):
        bind_drafter(drafter, target)
    assert drafter._embed is None  # not bound


def test_target_layer_ids_beyond_target(pair):
    target = pair[0]
    drafter = DFlashDrafter(tiny_drafter_args(target, layer_ids=[1, target.num_layers]))
    with pytest.raises(MismatchError, match="target_layer_ids"):
        bind_drafter(drafter, target)


def test_num_target_layers_mismatch(pair):
    target = pair[0]
    args = tiny_drafter_args(target)
    args.num_target_layers = target.num_layers + 1
    with pytest.raises(MismatchError, match="num_target_layers"):
        check_pair(DFlashDrafter(args), target)


# --- generation arguments -------------------------------------------------------

@pytest.mark.parametrize("block_size", [0, 1, 9])
def test_bad_block_size(pair, block_size):
    target, drafter = pair
    cache, dcache = target.make_cache(), drafter.make_cache()
    with pytest.raises(InputError) as e:
        next(generate_step(PROMPT, target, drafter, block_size=block_size,
                           prompt_cache=cache, draft_cache=dcache))
    assert "--block-size" in str(e.value) and "2..8" in str(e.value)
    # Nothing ran: both caches are still empty.
    assert all(c.offset == 0 for c in cache) and all(c.offset == 0 for c in dcache)


def test_empty_prompt(pair):
    target, drafter = pair
    with pytest.raises(InputError, match="prompt is empty"):
        next(generate_step(mx.array([], dtype=mx.int32), target, drafter))
    with pytest.raises(InputError, match="prompt is empty"):
        next(generate_step(mx.array([], dtype=mx.int32), target, None))


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_bad_max_tokens(pair, max_tokens):
    target, drafter = pair
    with pytest.raises(InputError, match="--max-tokens"):
        next(generate_step(PROMPT, target, drafter, max_tokens=max_tokens))


def test_zero_kv_heads_is_a_config_error():
    from dflash_mlx import DrafterArgs
    from dflash_mlx.errors import ConfigError as _ConfigError

    config = {"architectures": ["DFlashDraftModel"], "hidden_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 0, "intermediate_size": 128,
              "vocab_size": 256, "dflash_config": {"target_layer_ids": [1], "mask_token_id": 3}}
    with pytest.raises(_ConfigError, match="num_key_value_heads"):
        DrafterArgs.from_config(config, source="cfg.json")
