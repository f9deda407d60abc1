"""The drafter network against a NumPy reference, and the released checkpoint format."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import DFlashDrafter, DrafterArgs, bind_drafter, load_drafter, save_drafter
from conftest import randomize, tiny_drafter, tiny_target

B = 8


def make_pair(family, layers=2):
    model, target = tiny_target(family)
    drafter = randomize(tiny_drafter(target, layers=layers))
    return model, target, drafter


def block_of(t, mask_id, n=B):
    return mx.array([[t] + [mask_id] * (n - 1)], dtype=mx.int32)


# --- NumPy reference (float64) ---------------------------------------------------

def np_params(drafter, target):
    """Drafter weights, the target's input embedding rows (with the family's embedding
    scale) and its head matrix, float64."""
    p = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}
    embed = np.array(target.embed(mx.arange(target.vocab_size)[None])[0], dtype=np.float64)
    text = target.text
    head = text.lm_head.weight if hasattr(text, "lm_head") else target.inner.embed_tokens.weight
    return p, embed, np.array(head, dtype=np.float64)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """Non-traditional RoPE: rotate halves. x [n_heads, L, d], pos [L]."""
    d = x.shape[-1]
    freq = theta ** (-2.0 * np.arange(d // 2) / d)
    ang = pos[:, None] * freq[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def heads(x, n):
    return x.reshape(x.shape[0], n, -1).transpose(1, 0, 2)


class NumpyDrafter:
    """Plain re-implementation of spec section 4 with its own context cache."""

    def __init__(self, drafter, target):
        self.a = drafter.args
        self.p, self.embed, self.head = np_params(drafter, target)
        self.softcap = getattr(target.text, "final_logit_softcapping", None)  # gemma4
        n = self.a.num_hidden_layers
        self.k_cache = [np.zeros((self.a.num_key_value_heads, 0, self.a.head_dim))] * n
        self.v_cache = [np.zeros((self.a.num_key_value_heads, 0, self.a.head_dim))] * n
        self.offset = 0

    def __call__(self, block, context):
        a, p, eps = self.a, self.p, self.a.rms_norm_eps
        nq, nkv, theta = a.num_attention_heads, a.num_key_value_heads, a.rope_theta
        S, nb = context.shape[0], block.shape[0]
        ctx_pos = np.arange(self.offset, self.offset + S, dtype=np.float64)
        blk_pos = np.arange(self.offset + S, self.offset + S + nb, dtype=np.float64)
        h = self.embed[block]
        c = rms(context @ p["fc.weight"].T, p["hidden_norm.weight"], eps)
        for i in range(a.num_hidden_layers):
            L = lambda name: p[f"layers.{i}.{name}"]
            x = rms(h, L("input_layernorm.weight"), eps)
            q = rms(heads(x @ L("self_attn.q_proj.weight").T, nq), L("self_attn.q_norm.weight"), eps)
            kb = rms(heads(x @ L("self_attn.k_proj.weight").T, nkv), L("self_attn.k_norm.weight"), eps)
            vb = heads(x @ L("self_attn.v_proj.weight").T, nkv)
            kc = rms(heads(c @ L("self_attn.k_proj.weight").T, nkv), L("self_attn.k_norm.weight"), eps)
            vc = heads(c @ L("self_attn.v_proj.weight").T, nkv)
            self.k_cache[i] = np.concatenate([self.k_cache[i], rope(kc, ctx_pos, theta)], axis=1)
            self.v_cache[i] = np.concatenate([self.v_cache[i], vc], axis=1)
            k = np.concatenate([self.k_cache[i], rope(kb, blk_pos, theta)], axis=1)
            v = np.concatenate([self.v_cache[i], vb], axis=1)
            q = rope(q, blk_pos, theta)
            # GQA: query head j reads kv head j // (nq // nkv); no mask.
            k, v = np.repeat(k, nq // nkv, axis=0), np.repeat(v, nq // nkv, axis=0)
            s = q @ k.transpose(0, 2, 1) * a.head_dim**-0.5
            s = np.exp(s - s.max(-1, keepdims=True))
            o = (s / s.sum(-1, keepdims=True)) @ v
            o = o.transpose(1, 0, 2).reshape(nb, -1)
            h = h + o @ L("self_attn.o_proj.weight").T
            x = rms(h, L("post_attention_layernorm.weight"), eps)
            g = x @ L("mlp.gate_proj.weight").T
            up = x @ L("mlp.up_proj.weight").T
            h = h + (g / (1 + np.exp(-g)) * up) @ L("mlp.down_proj.weight").T
        self.offset += S
        logits = rms(h[1:], p["norm.weight"], eps) @ self.head.T
        return logits if self.softcap is None else self.softcap * np.tanh(logits / self.softcap)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_forward_matches_numpy_over_several_calls(family, compiled, monkeypatch):
    # The compiled step (context rows padded to the block) and the plain one agree with
    # the reference, for fewer new context rows than the block, as many, and more.
    monkeypatch.setenv("DFLASH_COMPILE", compiled)
    model, target, drafter = make_pair(family)
    args = drafter.args
    assert args.num_hidden_layers == 2 and (args.num_attention_heads, args.num_key_value_heads) == (4, 2)
    ref = NumpyDrafter(drafter, target)
    cache = drafter.make_cache()
    rng = np.random.default_rng(0)
    F = len(args.target_layer_ids) * args.hidden_size
    for S, t in [(5, 17), (3, 42), (8, 9), (11, 3), (1, 5)]:
        ctx = rng.standard_normal((S, F)).astype(np.float32)
        block = block_of(t, args.mask_token_id)
        logits = drafter(block, mx.array(ctx)[None], cache)
        assert logits.shape == (1, B - 1, args.vocab_size)
        expected = ref(np.array(block[0]), ctx.astype(np.float64))
        np.testing.assert_allclose(np.array(logits[0]), expected, atol=1e-4, rtol=1e-4)
        # Only context rows are cached.
        assert all(c.offset == ref.offset for c in cache)
    assert ref.offset == 28


def test_second_call_depends_on_cached_context(family):
    # Same block and new rows, with and without a first call: the cache matters.
    _, target, drafter = make_pair(family)
    F = len(drafter.target_layer_ids) * drafter.args.hidden_size
    c1, c2 = mx.random.normal((1, 4, F), key=mx.random.key(1)), mx.random.normal((1, 2, F), key=mx.random.key(2))
    block = block_of(7, drafter.args.mask_token_id)
    cache = drafter.make_cache()
    drafter(block, c1, cache)
    warm = drafter(block, c2, cache)
    cold = drafter(block, c2, drafter.make_cache())
    assert not np.allclose(np.array(warm), np.array(cold), atol=1e-3)


# --- checkpoint format ----------------------------------------------------------

def expected_keys(n_layers):
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    keys |= {f"layers.{i}.{k}" for i in range(n_layers) for k in per_layer}
    return keys


def test_save_load_round_trip(tmp_path):
    _, target, drafter = make_pair("qwen3")
    save_drafter(drafter, tmp_path)
    loaded = bind_drafter(load_drafter(str(tmp_path)), target)
    a, b = dict(tree_flatten(drafter.parameters())), dict(tree_flatten(loaded.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), k
    assert loaded.args.target_layer_ids == drafter.args.target_layer_ids
    assert loaded.args.mask_token_id == drafter.args.mask_token_id
    assert loaded.block_size == drafter.block_size
    F = len(drafter.target_layer_ids) * drafter.args.hidden_size
    ctx = mx.random.normal((1, 6, F), key=mx.random.key(3))
    block = block_of(9, drafter.args.mask_token_id)
    assert mx.array_equal(drafter(block, ctx, drafter.make_cache()), loaded(block, ctx, loaded.make_cache()))


def test_saved_files_are_released_format(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    _, target, drafter = make_pair("llama")
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    args = drafter.args
    for key in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
                "block_size", "num_target_layers"]:
        assert cfg[key] == getattr(args, key), key
    assert "max_position_embeddings" in cfg and "rope_scaling" in cfg
    assert cfg["dflash_config"] == {"target_layer_ids": args.target_layer_ids, "mask_token_id": args.mask_token_id}
    assert cfg["layer_types"] == ["full_attention"] * args.num_hidden_layers

    # Unprefixed keys, no embedding or head; readable by plain safetensors (PyTorch side).
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == expected_keys(args.num_hidden_layers)
    assert weights["fc.weight"].shape == (args.hidden_size, 2 * args.hidden_size)
    params = dict(tree_flatten(drafter.parameters()))
    for k, v in weights.items():
        np.testing.assert_array_equal(v, np.array(params[k]))
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert f.metadata().get("format") == "pt"


def test_transformers_reads_config(tmp_path):
    from transformers import Qwen3Config

    _, target, drafter = make_pair("qwen3")
    save_drafter(drafter, tmp_path)
    cfg = Qwen3Config.from_pretrained(str(tmp_path))
    a = drafter.args
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (a.hidden_size, 2, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, a.head_dim, a.intermediate_size)
    assert cfg.vocab_size == a.vocab_size
    assert cfg.architectures == ["DFlashDraftModel"]
    assert cfg.dflash_config == {"target_layer_ids": a.target_layer_ids, "mask_token_id": a.mask_token_id}
    assert cfg.block_size == a.block_size and cfg.num_target_layers == a.num_target_layers


# --- config parsing -------------------------------------------------------------

def base_config(**over):
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256, "block_size": 16, "num_target_layers": 36,
        "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 255},
    }
    cfg.update(over)
    return cfg


def test_rope_parameters_theta():
    cfg = base_config(rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    assert "rope_theta" not in cfg
    args = DrafterArgs.from_config(cfg)
    assert args.rope_theta == 12345.0
    rope = DFlashDrafter(args).layers[0].self_attn.rope
    assert rope.base == 12345.0 and not rope.traditional


def test_default_target_layer_ids():
    cfg = base_config(dflash_config={"mask_token_id": 255})
    args = DrafterArgs.from_config(cfg)
    assert args.target_layer_ids == [1, 9, 17, 25, 33]
    assert args.block_size == 16 and args.mask_token_id == 255


def test_bfloat16_checkpoint_cast_to_target_dtype(tmp_path):
    _, target, drafter = make_pair("qwen3")
    assert target.dtype == mx.float32
    drafter.set_dtype(mx.bfloat16)
    save_drafter(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_drafter(str(tmp_path))
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(loaded.parameters()))
    bind_drafter(loaded, target)
    want = dict(tree_flatten(drafter.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        assert v.dtype == mx.float32, k
        assert mx.array_equal(v, want[k].astype(mx.float32)), k  # bf16 -> f32 is exact
    F = len(loaded.target_layer_ids) * loaded.args.hidden_size
    ctx = mx.random.normal((1, 3, F), key=mx.random.key(4))
    logits = loaded(block_of(5, loaded.args.mask_token_id), ctx, loaded.make_cache())
    assert logits.dtype == mx.float32 and bool(mx.all(mx.isfinite(logits)))
