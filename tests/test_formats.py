"""Every drafter format against a plain NumPy reference, in its released key layout.

Each format's random drafter is written by ``save_drafter`` in the released layout
(key names checked against DFLASH_SPEC.md sections 2 and 9), loaded back, and run over
several calls that take the context past the sliding window; its logits must match
:class:`Reference` (float64 NumPy, every context row kept and masked by absolute
position) to 1e-4. DFlash2 also checks the selector's path, the convolution at the
block start (a 2-row block shorter than the 3 taps), the embedding scale and the
softcap; DSpark its anchor-first rows (row 0 drafts) and the Markov head's path. Then:
lossless greedy decoding with every format at every block size, the draft window, and
hand-written released DFlash2 and DSpark checkpoints' round trips.
"""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from dflash_mlx import CheckpointError, DrafterArgs, bind_drafter, generate_step, load_drafter, save_drafter
from dflash_mlx.pair.loading import is_drafter_config
from dflash_mlx.prompt_cache.drafter_context import ContextWindowCache
from dflash_mlx.bench.simulate import SimulatedDrafter
from conftest import FORMATS, assert_varied, format_drafter, mlx_lm_greedy, tiny_target

B = 8
CALLS = [(9, 17, B), (3, 42, B), (1, 7, 2), (2, 99, B)]  # (new context rows, t_last, block size)


# --- NumPy reference (float64) ---------------------------------------------------

def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta, rotated=1.0):
    """Non-traditional RoPE: rotate halves. x [n_heads, L, d], pos [L]; ``rotated`` < 1: proportional RoPE (the
    first ``rotated * d / 2`` frequencies, the others 0: transformers' _compute_proportional_rope_parameters)."""
    d = x.shape[-1]
    freq = theta ** (-2.0 * np.arange(d // 2) / d)
    ang = pos[:, None] * np.where(np.arange(d // 2) < int(rotated * d // 2), freq, 0.0)[None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], axis=-1)


def heads(x, n):
    return x.reshape(x.shape[0], n, -1).transpose(1, 0, 2)


def conv(z, base, dyn, g):
    """sum_o (base[o] + dyn[p, o, c // g]) * z[p - o], zero before the block start."""
    out = np.zeros_like(z)
    for p in range(z.shape[0]):
        for o in range(base.shape[0]):
            if p - o >= 0:
                out[p] += (base[o] + np.repeat(dyn[p, o], g)) * z[p - o]
    return out


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


class Reference:
    """Spec sections 4, 9 and 11, written out: every context row is kept; masks by position. Gemma 4 DSpark's layer
    from DeepSpec's gemma4/modeling.py: q/k norms, a scale-free v_norm of V (K's projection with attention_k_eq_v),
    global_head_dim heads, attention scale 1, proportional RoPE; each half's output normed, the layer's output
    times layer_scalar; GeGLU (gelu tanh); embeddings times sqrt(hidden); (``gemma``: False leaves that out)."""

    def __init__(self, drafter, model, draft_window=None):
        self.a = drafter.args
        self.p = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}
        self.embed = np.array(model.model.embed_tokens.weight, dtype=np.float64)
        self.head = np.array(model.lm_head.weight, dtype=np.float64) if hasattr(model, "lm_head") else self.embed
        self.ctx = np.zeros((0, self.a.hidden_size))
        self.window = draft_window
        self.gemma = drafter.args.format.gemma4

    def visible(self, layer, P):
        """Context rows a full layer's block sees with the draft window (sliding layers: all, masked)."""
        keep = np.ones(P, dtype=bool)
        if self.window is not None and not self.a.is_sliding(layer):
            sink, size = self.window
            pos = np.arange(P)
            keep = (pos < sink) | (pos >= P - size)
        return keep

    def sublayer(self, i, name, fn, x):
        if not self.a.conv_kernel_size:
            return fn(x)
        p, a = self.p, self.a
        K, g = a.conv_kernel_size, a.conv_group_size
        dyn = (x @ p[f"layers.{i}.{name}.kernel_projection.weight"].T).reshape(len(x), 2, K, -1)
        base = p[f"layers.{i}.{name}.base_kernel"]
        return conv(fn(conv(x, base[0], dyn[:, 0], g)), base[1], dyn[:, 1], g)

    def attention(self, i, x, P):
        a, p, eps = self.a, self.p, self.a.rms_norm_eps
        L = lambda name: p[f"layers.{i}.self_attn.{name}"]
        nq, nkv, theta, nb = a.num_attention_heads, a.num_key_value_heads, a.rope_theta, len(x)
        hd, rot, scale = a.head_dim, (a.rope_scaling or {}).get("partial_rotary_factor", 1.0), a.head_dim**-0.5
        if self.gemma:
            nkv, hd, scale = a.num_global_key_value_heads if a.attention_k_eq_v else nkv, a.global_head_dim, 1.0
        ctx_pos, blk_pos = np.arange(P, dtype=np.float64), np.arange(P, P + nb, dtype=np.float64)
        q = rope(rms(heads(x @ L("q_proj.weight").T, nq), L("q_norm.weight"), eps), blk_pos, theta, rot)
        kc = rope(rms(heads(self.ctx @ L("k_proj.weight").T, nkv), L("k_norm.weight"), eps), ctx_pos, theta, rot)
        kb = rope(rms(heads(x @ L("k_proj.weight").T, nkv), L("k_norm.weight"), eps), blk_pos, theta, rot)
        v = "k_proj.weight" if a.attention_k_eq_v else "v_proj.weight"
        vc, vb = heads(self.ctx @ L(v).T, nkv), heads(x @ L(v).T, nkv)
        if self.gemma:
            vc, vb = rms(vc, 1.0, eps), rms(vb, 1.0, eps)
        k, v = np.concatenate([kc, kb], axis=1), np.concatenate([vc, vb], axis=1)
        k_pos = np.concatenate([ctx_pos, blk_pos])
        allowed = np.concatenate([np.broadcast_to(self.visible(i, P), (nb, P)), np.ones((nb, nb), bool)], axis=1)
        if a.is_sliding(i):
            allowed &= blk_pos[:, None] - k_pos[None] < a.sliding_window
        if a.is_causal_layer(i):
            allowed &= k_pos[None] <= blk_pos[:, None]
        k, v = np.repeat(k, nq // nkv, axis=0), np.repeat(v, nq // nkv, axis=0)
        s = np.where(allowed, q @ k.transpose(0, 2, 1) * scale, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(nb, -1)
        return o @ L("o_proj.weight").T

    def __call__(self, block, context):
        """-> (logits [B-1, V], normed hidden [B-1, H])."""
        a, p, eps = self.a, self.p, self.a.rms_norm_eps
        self.ctx = np.concatenate([self.ctx, rms(context @ p["fc.weight"].T, p["hidden_norm.weight"], eps)])
        P = len(self.ctx)  # position of t_last
        h = self.embed[block] * a.input_embedding_scale * (a.hidden_size**0.5 if self.gemma else 1.0)
        for i in range(a.num_hidden_layers):
            L = lambda name: p[f"layers.{i}.{name}"]
            out = self.sublayer(i, "attention_conv", lambda x: self.attention(i, x, P),
                                rms(h, L("input_layernorm.weight"), eps))

            def mlp(x):
                g, up = x @ L("mlp.gate_proj.weight").T, x @ L("mlp.up_proj.weight").T
                return ((gelu_tanh(g) if self.gemma else g / (1 + np.exp(-g))) * up) @ L("mlp.down_proj.weight").T

            if self.gemma:
                h = h + rms(out, L("post_attention_layernorm.weight"), eps)
                h = h + rms(mlp(rms(h, L("pre_feedforward_layernorm.weight"), eps)),
                            L("post_feedforward_layernorm.weight"), eps)
                h = h * L("layer_scalar")
                continue
            h = h + out
            h = h + self.sublayer(i, "mlp_conv", mlp, rms(h, L("post_attention_layernorm.weight"), eps))
        hidden = rms(h[0 if a.format.anchor_first else 1:], p["norm.weight"], eps)
        logits = hidden @ self.head.T * a.output_multiplier
        if a.final_logit_softcapping:
            logits = a.final_logit_softcapping * np.tanh(logits / a.final_logit_softcapping)
        return logits, hidden

    def walk(self, hidden, logits, first):
        """The selector's argmax path (spec section 9, step 1-4 at T = 0)."""
        p, k = self.p, self.a.selector_top_k
        pred, succ = p["candidate_selector.predecessor_codebook"], p["candidate_selector.successor_codebook"]
        hr = hidden @ p["candidate_selector.hidden_projection.weight"].T
        prev, path = first, []
        for pos in range(len(logits)):
            cands = np.argsort(-logits[pos])[:k]
            score = logits[pos, cands] + (pred[prev] * hr[pos]) @ succ[cands].T
            prev = int(cands[np.argmax(score)])
            path.append(prev)
        return path

    def markov_walk(self, logits, first):
        """The Markov head's argmax path (spec section 11, step 4 at T = 0)."""
        w1, w2 = self.p["markov_head.markov_w1.weight"], self.p["markov_head.markov_w2.weight"]
        prev, path = first, []
        for row in logits:
            prev = int(np.argmax(row + w2 @ w1[prev]))
            path.append(prev)
        return path


# --- released key layout ----------------------------------------------------------

V1_LAYER_KEYS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


# Gemma 4 DSpark's (DeepSpec gemma4/modeling.py; attention_k_eq_v: no v_proj; v_norm has no weight)
GEMMA4_LAYER_KEYS = [
    "input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight", "layer_scalar", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


def released_keys(fmt, layers=2):
    """Weight names of a released checkpoint (spec sections 2, 9 and 11), written out by hand."""
    layer_keys = GEMMA4_LAYER_KEYS if fmt == "gemma4-dspark" else V1_LAYER_KEYS
    keys = {f"layers.{i}.{k}" for i in range(layers) for k in layer_keys} | {"norm.weight"}
    if fmt == "muse":
        return keys | {"encoder.fc.weight", "encoder.output_norm_enc.weight"}
    keys |= {"fc.weight", "hidden_norm.weight"}
    if fmt in ("dspark", "dflash-block7", "gemma4-dspark"):
        keys |= {"embed_tokens.weight", "lm_head.weight"}
    if fmt in ("dspark", "gemma4-dspark"):
        keys |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "confidence_head.proj.bias"}
    if fmt == "dflash2":
        keys |= {f"layers.{i}.{c}.{k}" for i in range(layers) for c in ("attention_conv", "mlp_conv")
                 for k in ("base_kernel", "kernel_projection.weight")}
        keys |= {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight"}
    return keys


_TARGETS = {}


def target_of(family):
    if family not in _TARGETS:
        _TARGETS[family] = tiny_target(family)
    return _TARGETS[family]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forward_matches_reference_in_released_layout(fmt, tmp_path):
    from safetensors.numpy import load_file

    model, target = target_of("gemma4_text" if fmt == "gemma4-dspark" else "qwen3")
    save_drafter(format_drafter(target, fmt, bind=False), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) == released_keys(fmt)
    drafter = bind_drafter(load_drafter(str(tmp_path)), target)
    a = drafter.args
    assert "embed_tokens" not in drafter and "lm_head" not in drafter  # copies equal to the target's: shared
    if fmt == "gemma4-dspark":  # global_head_dim 32, one K = V head
        assert weights["layers.0.self_attn.q_proj.weight"].shape == (4 * 32, a.hidden_size)
        assert weights["layers.0.self_attn.k_proj.weight"].shape == (32, a.hidden_size)
        assert weights["layers.1.self_attn.k_norm.weight"].shape == (32,) and weights["layers.1.layer_scalar"].shape == (1,)
    if a.markov_rank:
        H, V, r = a.hidden_size, a.vocab_size, 16
        assert weights["markov_head.markov_w1.weight"].shape == weights["markov_head.markov_w2.weight"].shape == (V, r)
        assert weights["confidence_head.proj.weight"].shape == (1, H + r)
        assert weights["confidence_head.proj.bias"].shape == (1,)
    if fmt == "dflash2":
        H, K, g, r = a.hidden_size, 3, 16, 8
        assert weights["layers.0.attention_conv.base_kernel"].shape == (2, K, H)
        assert weights["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * K * H // g, H)
        assert weights["candidate_selector.predecessor_codebook"].shape == (a.vocab_size, r)
        assert weights["candidate_selector.hidden_projection.weight"].shape == (r, H)
    ref = Reference(drafter, model)
    cache = drafter.make_cache()
    rng = np.random.default_rng(0)
    F = len(a.target_layer_ids) * a.hidden_size
    for S, t, nb in CALLS:
        ctx = rng.standard_normal((S, F)).astype(np.float32)
        block = mx.array([[t] + [a.mask_token_id] * (nb - 1)], dtype=mx.int32)
        hidden = drafter.hidden(block, mx.array(ctx)[None], cache)
        logits = drafter.logits(hidden)[0]
        want, want_hidden = ref(np.array(block[0]), ctx.astype(np.float64))
        np.testing.assert_allclose(np.array(logits), want, atol=1e-4, rtol=1e-4)
        assert all(c.offset == len(ref.ctx) for c in cache)
        if fmt == "dflash2":
            tokens, _ = drafter.candidate_selector.walk(hidden[0], logits, block[0, :1])
            assert tokens.tolist() == ref.walk(want_hidden, want, t)
        if a.markov_rank:  # the Markov bias changes the path: the check has power
            assert drafter.drafts(hidden[0], logits, block[0, 0])[0].tolist() == ref.markov_walk(want, t)
            assert ref.markov_walk(want, t) != want.argmax(-1).tolist()
    if a.sliding_window:  # the context went past the window: the sliding caches dropped rows
        assert len(ref.ctx) > a.sliding_window
        assert all(c.fetch()[0].shape[2] == a.sliding_window - 1
                   for c, layer in zip(cache, drafter.layers) if layer.self_attn.window)


def test_reference_masks_have_power():
    # The sliding window, causality and the embedding scale change the logits: the
    # parity above would catch a drafter that ignored any of them.
    model, target = target_of("qwen3")
    drafter = format_drafter(target, "dflash2")
    rng = np.random.default_rng(1)
    F = 2 * drafter.args.hidden_size
    ctx = rng.standard_normal((9, F))
    block = np.array([5] + [drafter.args.mask_token_id] * (B - 1))
    base = Reference(drafter, model)(block, ctx)[0]
    for change in [dict(sliding_window=50), dict(is_causal=True), dict(input_embedding_scale=1.0),
                   dict(final_logit_softcapping=None), dict(conv_kernel_size=1)]:
        other = Reference(drafter, model)
        other.a = dataclasses.replace(drafter.args, **change)
        if "conv_kernel_size" in change:  # keep only tap 0 of the weights
            other.p = {k: (v[:, :1] if k.endswith("base_kernel") else v) for k, v in other.p.items()}
            for k in [k for k in other.p if k.endswith("kernel_projection.weight")]:
                w = other.p[k].reshape(2, 3, -1, other.p[k].shape[-1])
                other.p[k] = w[:, :1].reshape(-1, w.shape[-1])
        assert not np.allclose(other(block, ctx)[0], base, atol=1e-3), change


def _each_layer(fn):
    return lambda d, target, mp: [fn(layer) for layer in d.layers]


# A Gemma 4 DSpark drafter with one piece done another way (the Qwen3 layer's, or left out).
GEMMA4_MISTAKES = {
    "attention scaled by head_dim**-0.5": _each_layer(lambda l: setattr(l.self_attn, "scale", 32**-0.5)),
    "no v_norm": _each_layer(lambda l: l.self_attn.pop("v_norm")),
    "RoPE over the whole head": _each_layer(lambda l: setattr(l.self_attn, "rope", nn.RoPE(32, base=1_000_000.0))),
    "no post_attention_layernorm": _each_layer(lambda l: setattr(l, "post_attention_layernorm", nn.Identity())),
    "no post_feedforward_layernorm": _each_layer(lambda l: setattr(l, "post_feedforward_layernorm", nn.Identity())),
    "layer_scalar left out": _each_layer(lambda l: setattr(l, "layer_scalar", mx.ones((1,)))),
    "SwiGLU instead of GeGLU": lambda d, target, mp: mp.setattr(gemma4_text, "geglu", lambda g, x: nn.silu(g) * x),
    "embeddings not scaled": lambda d, target, mp: setattr(d, "_embed", target.inner.embed_tokens),
    "logits not capped": lambda d, target, mp: setattr(d, "args", dataclasses.replace(d.args,
                                                                                      final_logit_softcapping=None)),
}


@pytest.mark.parametrize("mistake", sorted(GEMMA4_MISTAKES))
def test_gemma4_dspark_reference_catches_each_mistake(mistake, monkeypatch):
    """The Gemma 4 DSpark parity above has power: with any one piece of its layer, embedding or head done another
    way, the drafter's logits leave the NumPy reference."""
    model, target = target_of("gemma4_text")
    drafter = format_drafter(target, "gemma4-dspark")
    ref = Reference(drafter, model)
    GEMMA4_MISTAKES[mistake](drafter, target, monkeypatch)
    ctx = np.random.default_rng(4).standard_normal((9, 2 * drafter.args.hidden_size)).astype(np.float32)
    block = mx.array([[17] + [drafter.args.mask_token_id] * (B - 2)], dtype=mx.int32)
    got = np.array(drafter(block, mx.array(ctx)[None], drafter.make_cache())[0])
    want = ref(np.array(block[0]), ctx.astype(np.float64))[0]
    assert not np.allclose(got, want, atol=1e-4, rtol=1e-4), mistake  # the parity's tolerance


def test_config_written_back_unchanged(tmp_path):
    # A DFlash2 config as released (Qwen3.8 drafter layout: dflash_config holds the
    # conv/selector keys, rope_parameters instead of rope_theta) is saved with the same keys.
    _, target = target_of("qwen3")
    save_drafter(format_drafter(target, "dflash2"), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == dict(conv_kernel_size=3, conv_group_size=16,
                                                                            selector_rank=8, selector_top_k=4)
    assert cfg["dflash_config"]["output_multiplier"] == 0.5 and cfg["dflash_config"]["final_logit_softcapping"] == 3.0
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    cfg["custom_key"] = [1, 2]
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    loaded = load_drafter(str(tmp_path / "a"))
    assert loaded.args.rope_theta == cfg["rope_parameters"]["rope_theta"]
    save_drafter(loaded, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == cfg


def test_muse_glimmer_config_keeps_ids_at_top(tmp_path):
    _, target = target_of("llama")
    drafter = format_drafter(target, "muse")
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["MuseGlimmerAssistantModel"] and "dflash_config" not in cfg
    assert cfg["target_layer_ids"] == drafter.args.target_layer_ids
    assert cfg["mask_token_id"] == drafter.args.mask_token_id
    args = DrafterArgs.from_config(cfg)
    assert args.architecture == "MuseGlimmerAssistantModel" and not args.is_causal_layer(0)


# --- lossless with every format ----------------------------------------------------

PROMPT = [1, 17, 33, 2, 9, 100, 42, 7, 64, 3, 11]
N = 40
_REFS = {}


def reference_tokens(family):
    if family not in _REFS:
        model, target = target_of(family)
        _REFS[family] = mlx_lm_greedy(model, PROMPT, N + B)
        assert_varied(_REFS[family][:N], at_least=15)
    return _REFS[family]


def _run(target, drafter, block_size, n=N):
    prompt = mx.array(PROMPT, dtype=mx.int32)
    return [t for s in generate_step(prompt, target, drafter, max_tokens=n, block_size=block_size) for t in s.tokens]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_greedy_is_lossless_at_every_block_size(family, fmt):
    _, target = target_of(family)
    ref = reference_tokens(family)
    drafter = format_drafter(target, fmt)
    for block_size in range(2, B + 1):
        assert _run(target, drafter, block_size) == ref[:N], block_size
    # Drafts accepted too: the real drafter runs (caches, windows), proposals half right.
    mostly_right = SimulatedDrafter(drafter, PROMPT + ref, accept=3, vocab_size=target.vocab_size)
    assert _run(target, mostly_right, B) == ref[:N]


def test_draft_window_keeps_sink_and_window_rows():
    model, target = target_of("qwen3")
    drafter = format_drafter(target, "v1")
    drafter.set_draft_window((2, 4))
    cache = drafter.make_cache()
    assert all(isinstance(c, ContextWindowCache) for c in cache)
    ref = Reference(drafter, model, draft_window=(2, 4))
    free = Reference(drafter, model)  # no window: the window must matter
    rng = np.random.default_rng(3)
    F = 2 * drafter.args.hidden_size
    for S, t, nb in CALLS:
        ctx = rng.standard_normal((S, F)).astype(np.float32)
        block = mx.array([[t] + [drafter.args.mask_token_id] * (nb - 1)], dtype=mx.int32)
        logits = drafter(block, mx.array(ctx)[None], cache)[0]
        want = ref(np.array(block[0]), ctx.astype(np.float64))[0]
        np.testing.assert_allclose(np.array(logits), want, atol=1e-4, rtol=1e-4)
        other = free(np.array(block[0]), ctx.astype(np.float64))[0]
        # Absolute offsets, sink + window rows visible (the 9-row prefill skipped 3).
        assert all(c.offset == len(ref.ctx) for c in cache)
        assert all(c.fetch()[0].shape[2] == min(len(ref.ctx), 2 + 4) for c in cache)
    assert not np.allclose(want, other, atol=1e-3)


def test_draft_window_is_lossless_and_bounds_the_cache():
    _, target = target_of("llama")
    ref = reference_tokens("llama")
    drafter = format_drafter(target, "v1")
    drafter.set_draft_window((2, 6))
    cache = drafter.make_cache()
    prompt = mx.array(PROMPT, dtype=mx.int32)
    out = [t for s in generate_step(prompt, target, drafter, max_tokens=N, block_size=4, draft_cache=cache)
           for t in s.tokens]
    assert out == ref[:N]
    assert all(c.offset == len(PROMPT) + N - 1 for c in cache)  # positions stay absolute
    assert all(c.fetch()[0].shape[2] == 8 for c in cache)
    assert all(c.held <= 8 + ContextWindowCache.step for c in cache)


# --- a released DFlash2 checkpoint, written by hand --------------------------------

def test_released_dflash2_checkpoint_round_trip(tmp_path):
    """Keys and config written here from the spec, not by save_drafter: it loads,
    decodes losslessly, and is saved back byte for byte."""
    from safetensors.numpy import save_file

    model, target = target_of("qwen3")
    H, V, L, K, g, r = 64, 256, 2, 2, 16, 8
    rng = np.random.default_rng(5)

    def w(*shape, norm=False):
        v = 1.0 + 0.1 * rng.standard_normal(shape) if norm else rng.standard_normal(shape) / np.sqrt(shape[-1])
        return v.astype(np.float32)

    weights = {"fc.weight": w(H, 2 * H), "hidden_norm.weight": w(H, norm=True), "norm.weight": w(H, norm=True),
               "candidate_selector.predecessor_codebook": w(V, r), "candidate_selector.successor_codebook": w(V, r),
               "candidate_selector.hidden_projection.weight": w(r, H)}
    for i in range(L):
        p = f"layers.{i}."
        weights.update({p + "input_layernorm.weight": w(H, norm=True), p + "post_attention_layernorm.weight": w(H, norm=True),
                        p + "self_attn.q_proj.weight": w(64, H), p + "self_attn.k_proj.weight": w(32, H),
                        p + "self_attn.v_proj.weight": w(32, H), p + "self_attn.o_proj.weight": w(H, 64),
                        p + "self_attn.q_norm.weight": w(16, norm=True), p + "self_attn.k_norm.weight": w(16, norm=True),
                        p + "mlp.gate_proj.weight": w(128, H), p + "mlp.up_proj.weight": w(128, H),
                        p + "mlp.down_proj.weight": w(H, 128)})
        for c in ("attention_conv", "mlp_conv"):
            weights[p + c + ".base_kernel"] = w(2, K, H)
            weights[p + c + ".kernel_projection.weight"] = w(2 * K * H // g, H)
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "layer_types": ["sliding_attention"] * L, "sliding_window": 6, "is_causal": False,
        "num_target_layers": 4, "torch_dtype": "float32",
        "dflash_config": {"block_size": 8, "conv_group_size": g, "conv_kernel_size": K, "mask_token_id": 255,
                          "selector_rank": r, "selector_top_k": 4, "target_layer_ids": [1, 3]},
    }
    src = tmp_path / "released"
    src.mkdir()
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})  # as the hub's files are written
    (src / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    drafter = bind_drafter(load_drafter(str(src)), target)
    assert drafter.drafter_format == "DFlash2DraftModel" and drafter.block_size == 8
    ref = reference_tokens("qwen3")
    for block_size in (2, 8):
        assert _run(target, drafter, block_size) == ref[:N]
    save_drafter(drafter, tmp_path / "saved")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "saved" / name).read_bytes() == (src / name).read_bytes(), name


# --- released DSpark checkpoints (DeepSeek's DeepSpec schema), written by hand ----------

@pytest.mark.parametrize("markov_rank", [16, 0], ids=["dspark", "dflash-block7"])
def test_released_dspark_checkpoint_round_trip(tmp_path, markov_rank):
    """A Qwen3DSparkModel checkpoint as DeepSpec writes one (markov_rank 0: DeepSeek's DFlash block7; both with
    a confidence head) loads,
    drafts verifies of one more token than its block (row 0 drafts), shares the target's embedding and head
    (its copies are equal), decodes losslessly, and is saved back byte for byte."""
    from hf_checkpoints import write_dspark

    _, target = target_of("qwen3")
    src = write_dspark(tmp_path / "released", target, markov_rank=markov_rank, dtype=mx.float32)
    assert is_drafter_config(json.loads((src / "config.json").read_text()))  # refused as a target
    loaded = load_drafter(str(src))
    assert loaded.drafter_format == "Qwen3DSparkModel" and loaded.block_size == 8 and loaded.args.block_size == 7
    assert ("markov_head" in loaded) == bool(markov_rank)
    assert loaded.confidence_head["proj"].weight.shape == (1, 64 + markov_rank)  # reading the Markov embedding or not
    save_drafter(loaded, tmp_path / "saved")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "saved" / name).read_bytes() == (src / name).read_bytes(), name
    drafter = bind_drafter(loaded, target)
    assert "embed_tokens" not in drafter and "lm_head" not in drafter
    assert drafter.samples_drafts == bool(markov_rank)
    ref = reference_tokens("qwen3")
    for block_size in (2, 5, 8):
        assert _run(target, drafter, block_size) == ref[:N]
    save_drafter(drafter, tmp_path / "bound")  # the copies bind set aside are saved too
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "bound" / name).read_bytes() == (src / name).read_bytes(), name


def test_dspark_keeps_its_own_embedding_or_head_where_they_differ():
    """Copies that differ from the target's (here the embedding) are kept and used; equal ones are shared."""
    model, target = target_of("qwen3")
    drafter = format_drafter(target, "dspark", bind=False)
    drafter.embed_tokens.weight = drafter.embed_tokens.weight + 0.5
    own = np.array(drafter.embed_tokens.weight, dtype=np.float64)
    bind_drafter(drafter, target)
    assert "embed_tokens" in drafter and "lm_head" not in drafter
    ref = Reference(drafter, model)
    ref.embed = own
    block = mx.array([[5] + [drafter.args.mask_token_id] * (B - 2)], dtype=mx.int32)
    ctx = np.random.default_rng(2).standard_normal((1, 9, 2 * drafter.args.hidden_size)).astype(np.float32)
    logits = drafter(block, mx.array(ctx), drafter.make_cache())[0]
    np.testing.assert_allclose(np.array(logits), ref(np.array(block[0]), ctx[0].astype(np.float64))[0],
                               atol=1e-4, rtol=1e-4)
    assert _run(target, drafter, B) == reference_tokens("qwen3")[:N]


def test_dspark_keeps_a_head_that_differs_in_one_row():
    """The head's copy is compared through its logits of random vectors: one vocabulary row off by a little
    is found, and the drafter keeps its own head."""
    _, target = target_of("qwen3")
    drafter = format_drafter(target, "dspark", bind=False)
    w = drafter.lm_head.weight
    drafter.lm_head.weight = mx.concatenate([w[:7], w[7:8] * 1.01, w[8:]])
    bind_drafter(drafter, target)
    assert "lm_head" in drafter and "embed_tokens" not in drafter


def test_stats_name_format_and_rule():
    from dflash_mlx import stream_generate
    from dflash_mlx.sampling import Sampling
    from conftest import ByteTokenizer

    _, target = target_of("qwen3")
    wrapper = ByteTokenizer()
    for fmt, sampler, rule in [("dflash2", None, "greedy"), ("dflash2", Sampling(0.8), "speculative"),
                               ("v1", Sampling(0.8), "sample-and-match"), ("dspark", Sampling(0.8), "speculative"),
                               ("dflash-block7", Sampling(0.8), "sample-and-match")]:
        drafter = format_drafter(target, fmt)
        *_, last = stream_generate(target, wrapper, PROMPT, drafter, max_tokens=8, sampler=sampler)
        d = last.stats.to_dict()
        assert (d["drafter_format"], d["acceptance_rule"], d["block_size"]) == (drafter.drafter_format, rule, B)


@pytest.mark.parametrize("fmt", ["dflash2", "v1-sliding"])
def test_training_refuses_formats_it_cannot_train(fmt):
    """DFlash2's selector and sliding-window layers are not trained (v1 and DSpark drafters are)."""
    from dflash_mlx import ConfigError

    _, target = target_of("qwen3")
    with pytest.raises(ConfigError, match="v1"):
        format_drafter(target, fmt).block_logits(None, None, None, None)


# --- DSpark through `dflash generate` ------------------------------------------------

@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    """A tiny bf16 qwen3 target in Hugging Face format and its adapter (the same weights, float32)."""
    from hf_checkpoints import write_hf_target

    return write_hf_target(tmp_path_factory.mktemp("qwen3") / "target", "qwen3"), tiny_target("qwen3")[1]


@pytest.mark.parametrize("markov_rank", [16, 0], ids=["dspark", "dflash-block7"])
def test_generate_json_names_the_dspark_format(hf_qwen3, tmp_path, markov_rank):
    from conftest import dflash
    from hf_checkpoints import write_dspark

    folder, target = hf_qwen3
    drafter = write_dspark(tmp_path / "dspark", target, markov_rank=markov_rank)
    args = ["generate", "--model", str(folder), "-p", "hello there", "-m", "24", "--json", "--quiet"]
    plain = json.loads(dflash(*args, text=True).stdout)
    for extra, rule in ((), "greedy"), (("--temp", "0.8", "--seed", "3"), "speculative" if markov_rank else
                                       "sample-and-match"):
        r = dflash(*args, "--draft-model", str(drafter), *extra, text=True)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert (out["drafter_format"], out["acceptance_rule"], out["block_size"]) == ("Qwen3DSparkModel", rule, 8)
        if not extra:
            assert out["token_ids"] == plain["token_ids"] and len(set(out["token_ids"])) > 5


def test_a_gated_markov_head_is_refused_in_one_line(hf_qwen3, tmp_path):
    from conftest import dflash
    from hf_checkpoints import write_dspark

    folder, target = hf_qwen3
    drafter = write_dspark(tmp_path / "gated", target, markov_head_type="gated")
    r = dflash("generate", "--model", str(folder), "--draft-model", str(drafter), "-p", "hi", text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "'markov_head_type' 'gated'" in r.stderr
    assert "Qwen3DSparkModel" in r.stderr and str(drafter / "config.json") in r.stderr


# --- Gemma 4 DSpark through `dflash generate` and `dflash convert` ---------------------

@pytest.fixture(scope="module")
def hf_gemma4(tmp_path_factory):
    """A tiny float32 gemma4_text target folder, its adapter and a Gemma4DSparkModel drafter for it in DeepSpec's
    released schema (bf16)."""
    from hf_checkpoints import write_gemma4_dspark, write_hf_gemma4_target

    root = tmp_path_factory.mktemp("gemma4")
    target = tiny_target("gemma4_text")[1]
    return write_hf_gemma4_target(root / "target"), target, write_gemma4_dspark(root / "drafter", target)


def test_generate_json_names_the_gemma4_dspark_format(hf_gemma4):
    from conftest import dflash

    folder, _, drafter = hf_gemma4
    args = ["generate", "--model", str(folder), "-p", "hello there", "-m", "24", "--json", "--quiet"]
    plain = json.loads(dflash(*args, text=True).stdout)
    r = dflash(*args, "--draft-model", str(drafter), text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["drafter_format"], out["acceptance_rule"], out["block_size"]) == ("Gemma4DSparkModel", "greedy", 8)
    assert out["token_ids"] == plain["token_ids"] and len(set(out["token_ids"])) > 5


def test_gemma4_dspark_converts_with_an_8_bit_drafter(hf_gemma4, tmp_path):
    """convert --draft-q-bits 8: the layers quantized, the embedding and head copies float, the config in
    DeepSpec's schema (nested rope_parameters kept as they were); the pair decodes as the target alone."""
    from dflash_mlx import load
    from dflash_mlx.pair.convert import convert

    folder, _, drafter = hf_gemma4
    convert(str(folder), str(drafter), tmp_path / "pair", dtype="float32", draft_q_bits=8)
    config = json.loads((tmp_path / "pair" / "drafter" / "config.json").read_text())
    source = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"] and config["quantization"]["bits"] == 8
    assert {k: v for k, v in config.items() if k not in ("quantization", "torch_dtype")} == \
        {k: v for k, v in source.items() if k != "torch_dtype"}
    weights = mx.load(str(tmp_path / "pair" / "drafter" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.scales" in weights and "layers.1.mlp.down_proj.scales" in weights
    assert all(mx.issubdtype(weights[k].dtype, mx.floating) for k in ("embed_tokens.weight", "lm_head.weight",
                                                                        "layers.0.layer_scalar"))
    pair = load(str(tmp_path / "pair"))
    assert pair.drafter.drafter_format == "Gemma4DSparkModel"
    ids = mx.array(PROMPT, dtype=mx.int32)
    got = [t for s in generate_step(ids, pair.target, pair.drafter, max_tokens=N, block_size=B) for t in s.tokens]
    assert got == mlx_lm_greedy(pair.model, PROMPT, N)


@pytest.mark.parametrize("key,value", [("enable_moe_block", True), ("hidden_size_per_layer_input", 256),
                                       ("hidden_activation", "silu"), ("markov_head_type", "rnn")])
def test_unsupported_gemma4_dspark_variants_are_refused_in_one_line(hf_gemma4, tmp_path, key, value):
    from conftest import dflash
    from hf_checkpoints import edit_config, write_gemma4_dspark

    folder, target, _ = hf_gemma4
    drafter = write_gemma4_dspark(tmp_path / key, target)
    edit_config(drafter, **{key: value})
    r = dflash("generate", "--model", str(folder), "--draft-model", str(drafter), "-p", "hi", text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and f"'{key}' {value!r}" in r.stderr
    assert "Gemma4DSparkModel" in r.stderr and str(drafter / "config.json") in r.stderr
