"""Fused RMSNorm and RoPE (dflash_mlx.targets.fused) compute the same bits as mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.targets import fused
from dflash_mlx.targets.fused import FusedLinear, FusedRMSNorm, FusedRoPE, fuse_layers, unfused

from conftest import FAMILIES, FORMATS, format_drafter, tiny_target

DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def logits_by_step(model, prompt, widths):
    """Logits of a prefill then of one forward per width, each fed the last greedy
    token repeated (a verify block), through mlx-lm's own forward and cache."""
    cache = make_prompt_cache(model)
    out = [model(prompt[None], cache=cache)]
    for w in widths:
        token = mx.argmax(out[-1][0, -1])
        out.append(model(mx.broadcast_to(token, (1, w)), cache=cache))
    mx.eval(out)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_fused_target_gives_the_same_logits_bit_for_bit(family, monkeypatch):
    monkeypatch.setenv(fused.COMPILE_ENV, "0")
    plain, _ = tiny_target(family)
    monkeypatch.delenv(fused.COMPILE_ENV)
    model, _ = tiny_target(family)
    kinds = {type(m) for m in model.modules()}
    assert not kinds & {nn.RMSNorm, nn.RoPE, nn.Linear}, "make_adapter leaves no unfused RMSNorm/RoPE/Linear"
    assert not {type(m) for m in plain.modules()} & {FusedRMSNorm, FusedRoPE, FusedLinear}
    prompt = mx.array([(7 * i + 3) % 200 for i in range(70)], dtype=mx.int32)  # past the fused RoPE limit
    widths = [1, 3, 16, 1, 8]
    # MLX's CPU gather matmul (mixture-of-experts layers) runs in float32 only.
    moe = any(type(m).__name__ == "SwitchGLU" for m in model.modules())
    for dtype in DTYPES[:1] if moe else DTYPES:
        plain.set_dtype(dtype)
        model.set_dtype(dtype)
        fuse_layers(model)  # the linears' transposes kept again, of the new weights
        linears = [m for m in model.modules() if type(m) is FusedLinear]
        assert linears and all(m._transposed[0] is m.weight for m in linears)
        for a, b in zip(logits_by_step(plain, prompt, widths), logits_by_step(model, prompt, widths)):
            assert a.dtype == b.dtype == dtype
            assert mx.array_equal(a, b).item(), f"{family} {dtype}: fused logits differ"


def adapter_outputs(target, prompt, widths, monkeypatch, compile_setting):
    """Hidden states and captured features of the adapter's own forward (its masks
    included): a prefill, then one forward per width, with ``DFLASH_COMPILE`` set as
    given while it runs."""
    monkeypatch.setenv(fused.COMPILE_ENV, compile_setting)
    cache = target.make_cache(16)
    capture = [1, target.num_layers - 1]
    out = [target(prompt[None], cache, capture)]
    for w in widths:
        token = mx.argmax(target.lm_head(out[-1][0])[0, -1])
        out.append(target(mx.broadcast_to(token, (1, w)), cache, capture))
    mx.eval(out)
    monkeypatch.delenv(fused.COMPILE_ENV)
    return [a for pair in out for a in pair]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_adapter_forward_with_fused_layers_and_mask_arrays_gives_the_same_bits(family, monkeypatch):
    """The adapter's masks are arrays for short fused inputs (built once per forward)
    and mlx-lm's "causal" otherwise; hidden states and features are the same bits."""
    monkeypatch.setenv(fused.COMPILE_ENV, "0")
    _, plain = tiny_target(family)
    monkeypatch.delenv(fused.COMPILE_ENV)
    _, target = tiny_target(family)
    prompt = mx.array([(5 * i + 1) % 200 for i in range(70)], dtype=mx.int32)
    h = target.embed(prompt[None, :16])
    assert isinstance(fused.attention_mask(h, None), mx.array)
    assert fused.attention_mask(h[:, :1], None) is None
    assert fused.attention_mask(target.embed(prompt[None]), None) == "causal"  # past the fused length
    moe = any(type(m).__name__ == "SwitchGLU" for m in target.model.modules())
    for dtype in DTYPES[:1] if moe else DTYPES:
        plain.model.set_dtype(dtype)
        target.model.set_dtype(dtype)
        want = adapter_outputs(plain, prompt, [1, 3, 16, 1, 8, 64], monkeypatch, "0")
        got = adapter_outputs(target, prompt, [1, 3, 16, 1, 8, 64], monkeypatch, "1")
        for a, b in zip(want, got):
            assert mx.array_equal(a, b).item(), f"{family} {dtype}: the fused forward differs"


def drafter_logits(drafter, steps, dtype):
    """The drafter's block logits over several steps (context rows fewer than, as
    many as and more than the block), one cache."""
    cache = drafter.make_cache()
    F = len(drafter.target_layer_ids) * drafter.args.hidden_size
    out = []
    for i, (rows, token) in enumerate(steps):
        context = mx.random.normal((1, rows, F), key=mx.random.key(i)).astype(dtype)
        block = mx.array([[token] + [drafter.args.mask_token_id] * (drafter.block_size - 1)], dtype=mx.int32)
        out.append(drafter(block, context, cache))
    mx.eval(out)
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_drafter_step_with_rope_tables_gives_the_same_bits(fmt, monkeypatch):
    """The drafter's compiled step rotates by shared RoPE tables on the CPU; its logits
    equal those of the same compiled step with RoPE itself, bit for bit."""
    from dflash_mlx.drafter import network

    _, target = tiny_target("llama")
    steps = [(5, 17), (3, 42), (8, 9), (11, 3), (1, 5), (300, 7), (2, 8)]  # the table grows past 256
    for dtype in DTYPES:
        drafter = format_drafter(target, fmt)
        drafter.set_dtype(dtype)
        calls = []
        monkeypatch.setattr(network, "rope_rows", lambda *a: calls.append(a) or fused.rope_rows(*a))
        got = drafter_logits(drafter, steps, dtype)
        compiled = "attention_conv" not in drafter.layers[0]  # DFlash2's convolutions run uncompiled
        assert bool(calls) == compiled, "the compiled step takes RoPE tables on the CPU"
        monkeypatch.setattr(network, "rope_rows", lambda *a: None)
        want = drafter_logits(drafter, steps, dtype)
        for a, b in zip(want, got):
            assert mx.array_equal(a, b).item(), f"{fmt} {dtype}: drafter logits differ"


def test_families_with_mlx_norms_and_rope_get_them_fused():
    llama, _ = tiny_target("llama")
    qwen3, _ = tiny_target("qwen3")
    assert sum(isinstance(m, FusedRMSNorm) for m in llama.modules()) == 2 * 4 + 1
    assert sum(isinstance(m, FusedRoPE) for m in llama.modules()) == 4
    assert sum(isinstance(m, FusedRMSNorm) for m in qwen3.modules()) == 4 * 4 + 1  # q_norm and k_norm too


def test_other_norms_and_scaled_rope_are_left_alone():
    gemma, _ = tiny_target("gemma3_text")
    llama31, _ = tiny_target("llama3.1")
    assert not any(isinstance(m, FusedRMSNorm) for m in gemma.modules())  # Gemma's norm scales by 1 + w
    assert not any(isinstance(m, FusedRoPE) for m in llama31.modules())  # Llama3RoPE


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_equals_rope_at_int_and_per_sequence_offsets(traditional, dtype):
    rope = nn.RoPE(16, traditional=traditional, base=10000.0)
    fast = nn.RoPE(16, traditional=traditional, base=10000.0)
    fast.__class__ = FusedRoPE
    mx.random.seed(0)
    # positions within the shared table, past it (its growth), beyond its cap and negative
    for shape, offset in [((1, 4, 16, 16), 0), ((1, 2, 1, 16), 517), ((1, 4, 7, 16), 33),
                          ((3, 4, 5, 16), mx.array([0, 9, 300])), ((1, 4, 100, 16), 12), ((1, 4, 3, 16), 4000),
                          ((1, 2, 2, 16), fused.MAX_TABLE_POSITIONS - 1),
                          ((1, 2, 16), fused.MAX_TABLE_POSITIONS + 3), ((1, 2, 4, 16), -3),
                          ((2, 1, 2, 3, 16), mx.array([5, fused.MAX_TABLE_POSITIONS + 9])),
                          ((1, 2, 3, 24), 7)]:  # RoPE over part of the head: nn.RoPE's own
        x = (3 * mx.random.normal(shape)).astype(dtype)
        assert mx.array_equal(rope(x, offset), fast(x, offset)).item(), (shape, offset)
    assert mx.array_equal(rope(x), fast(x)).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_equals_rms_norm(dtype):
    norm = nn.RMSNorm(32, eps=1e-6)
    mx.random.seed(1)
    norm.weight = mx.random.normal((32,))
    norm.set_dtype(dtype)
    fast = nn.RMSNorm(32, eps=1e-6)
    fast.update(norm.parameters())
    fast.__class__ = FusedRMSNorm
    for shape in [(1, 1, 32), (1, 16, 32), (2, 4, 9, 32)]:
        x = (2 * mx.random.normal(shape)).astype(dtype)
        assert mx.array_equal(norm(x), fast(x)).item(), shape


def graph_nodes(tmp_path, y) -> int:
    mx.export_to_dot(str(tmp_path / "g.dot"), y)
    return (tmp_path / "g.dot").read_text().count("label =")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_equals_linear_with_three_nodes_fewer_for_one_sequence(bias, dtype, tmp_path):
    """One sequence's rows [1, T, in] multiply the kept [1, in, out] view: three graph nodes fewer than
    nn.Linear's (its transpose, flatten and unflatten), the same bits; a batch's rows too."""
    mx.random.seed(2)
    linear = nn.Linear(32, 48, bias=bias)
    linear.set_dtype(dtype)
    fast = nn.Linear(32, 48, bias=bias)
    fast.update(linear.parameters())
    fast.__class__ = FusedLinear
    fast.keep_transpose()
    for shape in [(1, 1, 32), (1, 16, 32), (3, 5, 32), (7, 32)]:
        x = mx.random.normal(shape).astype(dtype)
        assert mx.array_equal(linear(x), fast(x)).item(), shape
    x = mx.random.normal((1, 16, 32)).astype(dtype)
    mx.eval(x, linear.parameters())
    assert graph_nodes(tmp_path, linear(x)) - graph_nodes(tmp_path, fast(x)) == 3


def test_swapping_keeps_the_parameter_tree(monkeypatch):
    monkeypatch.setenv(fused.COMPILE_ENV, "0")
    plain, _ = tiny_target("qwen3")
    monkeypatch.delenv(fused.COMPILE_ENV)
    model, _ = tiny_target("qwen3")
    keys = [k for k, _ in tree_flatten(model.parameters())]
    assert keys == [k for k, _ in tree_flatten(plain.parameters())]
    assert "model.layers.0.input_layernorm.weight" in keys


@pytest.mark.parametrize("setting", ["0", "off"])
def test_the_environment_variable_turns_fusing_off(setting, monkeypatch):
    monkeypatch.setenv(fused.COMPILE_ENV, setting)
    model, _ = tiny_target("llama")
    assert not any(isinstance(m, (FusedRMSNorm, FusedRoPE)) for m in model.modules())
    assert fuse_layers(model) == 0


def test_nothing_is_swapped_on_a_gpu_default_device(monkeypatch):
    monkeypatch.setattr(fused.mx, "default_device", lambda: mx.gpu)
    norm = nn.RMSNorm(8)
    assert fuse_layers(norm) == 0 and type(norm) is nn.RMSNorm


def test_unfused_gives_mlx_lm_its_own_modules_for_a_while():
    model, _ = tiny_target("llama")
    fused_modules = [m for m in model.modules() if isinstance(m, (FusedRMSNorm, FusedRoPE))]
    with unfused(model):
        assert not any(isinstance(m, (FusedRMSNorm, FusedRoPE)) for m in model.modules())
        assert sum(type(m) in (nn.RMSNorm, nn.RoPE) for m in model.modules()) == len(fused_modules)
    assert all(isinstance(m, (FusedRMSNorm, FusedRoPE)) for m in fused_modules)
