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


# --- newer drafter formats: every kind of mismatch names the file and the key --------

@pytest.fixture
def saved_dflash2(pair, tmp_path):
    from conftest import format_drafter

    return save_drafter(format_drafter(pair[0], "dflash2"), tmp_path / "dflash2")


def edit_weights(folder, fn):
    f = folder / "model.safetensors"
    weights = mx.load(str(f))
    fn(weights)
    mx.save_safetensors(str(f), weights, metadata={"format": "pt"})
    return f


def one_line_error(kind, folder):
    with pytest.raises(kind) as e:
        load_drafter(str(folder))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_architecture(saved_dflash2):
    def other(cfg):
        cfg["architectures"] = ["DFlash3DraftModel"]
        del cfg["dflash_config"]
    edit_config(saved_dflash2, other)
    msg = one_line_error(ConfigError, saved_dflash2)
    assert str(saved_dflash2 / "config.json") in msg and "DFlash3DraftModel" in msg and "DFlash2DraftModel" in msg


def test_missing_selector_codebook(saved_dflash2):
    # Stored the way torch modules name embeddings (".weight"): the released name is missing.
    def rename(w):
        w["candidate_selector.predecessor_codebook.weight"] = w.pop("candidate_selector.predecessor_codebook")
    edit_weights(saved_dflash2, rename)
    msg = one_line_error(CheckpointError, saved_dflash2)
    assert str(saved_dflash2) in msg and "missing weight 'candidate_selector.predecessor_codebook'" in msg


def test_unexpected_weight(saved_dflash2):
    f = edit_weights(saved_dflash2, lambda w: w.update({"lm_head.weight": mx.zeros((4, 4))}))
    msg = one_line_error(CheckpointError, saved_dflash2)
    assert str(f) in msg and "unexpected weight 'lm_head.weight'" in msg


def test_misshapen_conv_kernel(saved_dflash2):
    key = "layers.1.attention_conv.base_kernel"
    f = edit_weights(saved_dflash2, lambda w: w.update({key: mx.zeros((2, 4, 64))}))
    msg = one_line_error(CheckpointError, saved_dflash2)
    assert str(f) in msg and key in msg and "[2, 4, 64]" in msg and "[2, 3, 64]" in msg


def test_weight_in_two_shards(saved_dflash2):
    mx.save_safetensors(str(saved_dflash2 / "extra.safetensors"), {"norm.weight": mx.ones((64,))})
    msg = one_line_error(CheckpointError, saved_dflash2)
    assert "norm.weight" in msg and "extra.safetensors" in msg and "model.safetensors" in msg


def test_muse_glimmer_weights_under_v1_names(pair, tmp_path):
    from conftest import format_drafter

    folder = save_drafter(format_drafter(pair[0], "muse"), tmp_path / "muse")
    edit_weights(folder, lambda w: w.update({"fc.weight": w.pop("encoder.fc.weight")}))
    assert "missing weight 'encoder.fc.weight'" in one_line_error(CheckpointError, folder)


@pytest.mark.parametrize("edit,key", [
    (lambda c: c["dflash_config"].pop("conv_group_size"), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "dflash_config.conv_group_size"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=0), "dflash_config.conv_kernel_size"),
    (lambda c: c["dflash_config"].update(selector_top_k=1000), "dflash_config.selector_top_k"),
    (lambda c: c["dflash_config"].update(selector_rank=8.5), "dflash_config.selector_rank"),
    (lambda c: c["dflash_config"].update(output_multiplier="high"), "dflash_config.output_multiplier"),
    (lambda c: c["dflash_config"].update(final_logit_softcapping=-1.0), "dflash_config.final_logit_softcapping"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types"),
    (lambda c: c.update(layer_types=["sliding_attention", "local_attention"]), "layer_types[1]"),
    (lambda c: c.pop("sliding_window"), "sliding_window"),
    (lambda c: c.update(is_causal="no"), "is_causal"),
], ids=["missing-group", "group-not-dividing", "zero-taps", "top-k-over-vocab", "fractional-rank",
        "multiplier-text", "negative-softcap", "layer-types-length", "layer-type-unknown",
        "window-missing", "is-causal-text"])
def test_bad_format_config_value(saved_dflash2, edit, key):
    edit_config(saved_dflash2, edit)
    msg = one_line_error(ConfigError, saved_dflash2)
    assert str(saved_dflash2 / "config.json") in msg and f"'{key}'" in msg


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.pop("markov_rank"), "markov_rank"),
    (lambda c: c.update(markov_rank=-1), "markov_rank"),
    (lambda c: c.update(markov_head_type="rnn"), "markov_head_type"),
    (lambda c: c.update(enable_confidence_head="yes"), "enable_confidence_head"),
    (lambda c: c.update(block_size=1), "block_size"),
], ids=["missing-rank", "negative-rank", "rnn-head", "confidence-text", "block-1"])
def test_bad_dspark_config_value(pair, tmp_path, edit, key):
    """DSpark's keys sit at the top level, and errors name them there."""
    from hf_checkpoints import write_dspark

    folder = write_dspark(tmp_path / "dspark", pair[0])
    edit_config(folder, edit)
    msg = one_line_error(ConfigError, folder)
    assert str(folder / "config.json") in msg and f"'{key}'" in msg and "dflash_config" not in msg


def test_dspark_weights_are_checked(pair, tmp_path):
    from hf_checkpoints import write_dspark

    folder = write_dspark(tmp_path / "no-head", pair[0])
    edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    assert "missing weight 'lm_head.weight'" in one_line_error(CheckpointError, folder)
    folder = write_dspark(tmp_path / "rank-8", pair[0])
    edit_config(folder, lambda c: c.update(markov_rank=8))
    msg = one_line_error(CheckpointError, folder)
    assert "'confidence_head.proj.weight' has shape [1, 80], but config.json implies [1, 72]" in msg


def test_bad_draft_window():
    from dflash_mlx.cli.common import parse_draft_window
    from dflash_mlx import load

    for value in ["64", "a,b", "-1,10", "64,0", "1,2,3"]:
        with pytest.raises(InputError, match="--draft-window"):
            parse_draft_window(value)
    assert parse_draft_window("64,1024") == (64, 1024)
    with pytest.raises(InputError, match="--draft-window needs --draft-model"):
        load("unused", None, draft_window=(64, 1024))
