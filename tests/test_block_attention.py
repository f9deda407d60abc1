"""Block attention: the MLX reference against float64 numpy, the chooser, and (on a Mac) the Metal kernel."""

import dataclasses
import itertools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import InputError, generate_step
from dflash_mlx.decode.batch import BatchDecoder
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.drafter.network import DFlashDrafter
from dflash_mlx.kernels import block_attention as ba
from dflash_mlx.kernels import block_attention_metal as bam
from dflash_mlx.kernels.block_attention import attention_path, block_attention, block_attention_reference
from dflash_mlx.pair.loading import bind_drafter
from conftest import tiny_drafter, tiny_drafter_args, tiny_target

needs_metal = pytest.mark.skipif(
    not mx.metal.is_available(),
    reason="needs Metal: mx.metal.is_available() is False on this machine (the kernel's logic "
    "runs here through the CPU harness in test_block_attention_kernel.py)",
)
HEADS = [(32, 8), (16, 2), (8, 8)]
# Relative error (max |a - b| / max |b|) of kernel against reference, by dtype: about
# one unit in the last place of the dtype, since both round a float32 result.
KERNEL_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def numpy_attention(q, ck, cv, bk, bv, scale, window, causal, delta):
    """Float64 attention over the concatenated K/V with an explicit position mask."""
    q, ck, cv, bk, bv = (np.asarray(x, dtype=np.float64) for x in (q, ck, cv, bk, bv))
    _, n_heads, block, _ = q.shape
    group = n_heads // bk.shape[1]
    n_ctx = ck.shape[2]
    k = np.repeat(np.concatenate([ck, bk], axis=2), group, axis=1)
    v = np.repeat(np.concatenate([cv, bv], axis=2), group, axis=1)
    q_pos = delta + np.arange(block)
    k_pos = np.concatenate([np.arange(n_ctx), delta + np.arange(block)])
    dist = q_pos[:, None] - k_pos[None, :]
    visible = np.ones_like(dist, dtype=bool)
    if window is not None:
        visible &= dist < window
    if causal:
        visible[:, n_ctx:] &= dist[:, n_ctx:] >= 0
    s = np.where(visible, q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def random_inputs(rng, batch, heads, kv_heads, block, head_dim, n_ctx):
    def normal(rows, h):
        return rng.standard_normal((batch, h, rows, head_dim)).astype(np.float32)

    return (normal(block, heads), normal(n_ctx, kv_heads), normal(n_ctx, kv_heads),
            normal(block, kv_heads), normal(block, kv_heads))


def window_for(mode, n_ctx, block, delta):
    """Windows around the edge: the first query's window starts at context row 0 for
    ``edge`` (W = delta + 1), the last query's for ``edge_last``; ``cut`` and ``in_block``
    cut deeper, ``past`` cuts nothing."""
    return {
        None: None,
        "cut": max(1, (delta + block) // 2),
        "edge": delta + 1,
        "edge_last": delta + block,
        "past": delta + block + 7,
        "in_block": max(1, block // 2),
    }[mode]


def _cases():
    rng = np.random.default_rng(12)
    contexts = [0, 1, 31, 33, 64, 100, 257, 511, 1000, 2047, 3001, 4096]
    modes = [None, "cut", "edge", "edge_last", "past", "in_block"]
    cases = []
    for k, (heads, mode) in enumerate(itertools.product(HEADS, modes)):
        cases.append(dict(
            heads=heads, mode=mode, causal=bool(k % 2), head_dim=(64, 128)[k % 3 % 2],
            n_ctx=contexts[k % len(contexts)] if k < len(contexts) else int(rng.integers(0, 4097)),
            block=[1, 16][k % 2] if k < 4 else int(rng.integers(1, 17)),
            gap=0 if k % 4 else int(rng.integers(1, 50)),
        ))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "h{heads[0]}-{heads[1]}_d{head_dim}_c{n_ctx}_b{block}_{mode}_{c}".format(
    c="causal" if c["causal"] else "bidir", **c))
def test_reference_matches_float64_attention(case):
    rng = np.random.default_rng(case["n_ctx"] * 31 + case["block"])
    heads, kv_heads = case["heads"]
    block, n_ctx, head_dim = case["block"], case["n_ctx"], case["head_dim"]
    arrays = random_inputs(rng, 1, heads, kv_heads, block, head_dim, n_ctx)
    ctx_start = 5
    delta = n_ctx + case["gap"]
    window = window_for(case["mode"], n_ctx, block, delta)
    scale = head_dim ** -0.5
    got = block_attention_reference(*(mx.array(x) for x in arrays), scale=scale, window=window,
                                    causal=case["causal"], ctx_start=ctx_start, q_start=ctx_start + delta)
    want = numpy_attention(*arrays, scale, window, case["causal"], delta)
    assert got.dtype == mx.float32 and got.shape == (1, heads, block, head_dim)
    err = np.abs(np.array(got, dtype=np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-5


def test_reference_batches_and_keeps_dtype():
    rng = np.random.default_rng(3)
    arrays = random_inputs(rng, 2, 4, 2, 3, 32, 9)
    got = block_attention_reference(*(mx.array(x).astype(mx.float16) for x in arrays), scale=0.2, causal=True)
    assert got.dtype == mx.float16 and got.shape == (2, 4, 3, 32)
    rounded = [np.array(mx.array(x).astype(mx.float16), dtype=np.float32) for x in arrays]
    want = numpy_attention(*rounded, 0.2, None, True, 9)
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() < 2e-3


def test_window_masks_what_it_should():
    # Values mark each key: the output is the mean of the visible keys' marks when scores tie.
    n_ctx, block = 6, 3
    q = mx.zeros((1, 1, block, 32))
    marks = lambda rows, first: mx.broadcast_to(mx.arange(first, first + rows, dtype=mx.float32)[:, None], (rows, 32))[None, None]
    ck, bk = mx.zeros((1, 1, n_ctx, 32)), mx.zeros((1, 1, block, 32))
    out = block_attention_reference(q, ck, marks(n_ctx, 0), bk, marks(block, n_ctx), scale=1.0,
                                    window=4, causal=True)[0, 0, :, 0]
    # Query i (position 6 + i) sees positions 3 + i .. 6 + i: i=0 -> 3..6, i=1 -> 4..7, i=2 -> 5..8.
    assert np.allclose(np.array(out), [4.5, 5.5, 6.5])


def _drafter_shaped(dtype=mx.float32, n_ctx=40, seed=0):
    rng = np.random.default_rng(seed)
    arrays = random_inputs(rng, 1, 8, 2, 16, 64, n_ctx)
    return [mx.array(x).astype(dtype) for x in arrays]


def test_chooser_falls_back_here_and_says_why(monkeypatch):
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    arrays = _drafter_shaped()
    out = block_attention(*arrays, scale=0.125)
    assert mx.array_equal(out, block_attention_reference(*arrays, scale=0.125))
    path = attention_path(*arrays)
    if mx.metal.is_available() and mx.default_device() == mx.gpu:
        assert path == {"block_attention": "metal", "reason": "Metal is available and the shape is covered"}
    else:
        assert path["block_attention"] == "reference"
        assert path["reason"] in ("Metal is not available (CPU backend)", "the default device is the CPU")


@pytest.mark.parametrize("value", ["0", "off", "OFF"])
def test_kill_switch_forces_reference(monkeypatch, value):
    monkeypatch.setenv(ba.ENV_VAR, value)
    arrays = _drafter_shaped()
    out = block_attention(*arrays, scale=0.125)
    assert mx.array_equal(out, block_attention_reference(*arrays, scale=0.125))
    assert attention_path(*arrays) == {"block_attention": "reference", "reason": f"DFLASH_BLOCK_KERNEL={value}"}


def test_bad_kill_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv(ba.ENV_VAR, "maybe")
    with pytest.raises(InputError, match="DFLASH_BLOCK_KERNEL='maybe'"):
        block_attention(*_drafter_shaped(), scale=0.125)


def test_attention_path_before_any_call():
    code = "from dflash_mlx.kernels.block_attention import attention_path; print(attention_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, ba.ENV_VAR: "0"}).stdout
    assert out.strip() == str({"block_attention": "reference", "reason": "DFLASH_BLOCK_KERNEL=0"})


def test_the_drafter_says_what_its_latest_draft_ran(monkeypatch):
    """Not a module global: one sequence drafts through block_attention (its path for the drafter's own
    arrays), a batch through padding-masked attention, each drafter saying its own."""
    _, target = tiny_target("qwen3")
    alone, together = tiny_drafter(target), tiny_drafter(target)
    monkeypatch.setenv(ba.ENV_VAR, "0")
    assert alone.attention_path() == attention_path()  # before any draft: what the environment allows
    list(generate_step(mx.array([1, 17, 33, 2], dtype=mx.int32), target, alone, max_tokens=12, block_size=8))
    monkeypatch.delenv(ba.ENV_VAR)
    block_attention(*_drafter_shaped(), scale=0.125)  # a call elsewhere changes nothing of the drafter's
    assert alone.attention_path() == {"block_attention": "reference", "reason": f"{ba.ENV_VAR}=0"}
    decoder = BatchDecoder(target, together, 8)
    for key, prompt in (("a", [1, 17, 33]), ("b", [5, 9])):
        assert decoder.start(key, prompt, None, StopCondition(12, (), ()), step_size=8).advance() is not None
    decoder.step()
    assert together.attention_path() == {"block_attention": "reference", "reason": "a batch drafts (masked attention)"}
    assert alone.attention_path()["reason"] == f"{ba.ENV_VAR}=0"


def test_uncovered_shapes_name_the_reason():
    """The kernel's shape rule, on any machine (on a CPU the device is the reason reported first)."""
    q, ck, cv, bk, bv = _drafter_shaped()
    assert ba._shape_reason(q, ck, cv, bk, bv) is None
    assert "head_dim 48" in ba._shape_reason(*(x[..., :48] for x in (q, ck, cv, bk, bv)))
    assert "head_dim 512" in ba._shape_reason(*(mx.concatenate([x] * 8, axis=-1) for x in (q, ck, cv, bk, bv)))
    assert "mixed input dtypes" in ba._shape_reason(q.astype(mx.float16), ck, cv, bk, bv)


@pytest.mark.parametrize("bad, match", [
    (dict(queries=mx.zeros((1, 8, 16))), "queries must be"),
    (dict(block_keys=mx.zeros((1, 2, 15, 64))), "block_keys has shape"),
    (dict(ctx_values=mx.zeros((1, 2, 39, 64))), "ctx_values has shape"),
    (dict(queries=mx.zeros((1, 7, 16, 64))), "7 query heads are not a multiple of 2 KV heads"),
    (dict(window=0), "window 0 must be at least 1"),
    (dict(q_start=10, ctx_start=0), "overlap the block"),
])
def test_bad_input_names_the_argument(bad, match):
    q, ck, cv, bk, bv = _drafter_shaped()
    args = dict(queries=q, ctx_keys=ck, ctx_values=cv, block_keys=bk, block_values=bv, scale=0.125)
    args.update(bad)
    with pytest.raises(InputError, match=match):
        block_attention(**args)


def test_kernel_launch_shapes():
    launch = bam.kernel_launch((1, 32, 16, 128), 8, mx.bfloat16)
    assert launch.template == [("T", mx.bfloat16), ("D", 128), ("QT", 8), ("NS", bam.SIMDGROUPS)]
    assert launch.grid == (8 * bam.SIMDGROUPS * 32, 8, 1) and launch.threadgroup == (bam.SIMDGROUPS * 32, 1, 1)
    assert bam.kernel_launch((2, 8, 1, 256), 8, mx.float16).template[2] == ("QT", 1)
    assert bam.kernel_launch((1, 16, 5, 256), 2, mx.float16).template[2] == ("QT", 4)


# ---- On a Mac: the Metal kernel itself ----

def _cache_slices(rng, arrays, dtype, spare=24):
    """Context K/V as slices of a longer preallocated cache (like KVCache), block K/V as the
    tail of one projection, queries transposed as the drafter makes them."""
    q, ck, cv, bk, bv = arrays
    n_ctx = ck.shape[2]

    def cache(x):
        full = mx.array(np.concatenate([x, np.full(x.shape[:2] + (spare,) + x.shape[3:], np.nan, np.float32)], axis=2))
        return full.astype(dtype)[:, :, :n_ctx]

    def tail(x):
        full = np.concatenate([np.full(x.shape[:2] + (3,) + x.shape[3:], np.nan, np.float32), x], axis=2)
        return mx.array(full).astype(dtype)[:, :, 3:]

    queries = mx.array(q.transpose(0, 2, 1, 3)).astype(dtype).transpose(0, 2, 1, 3)
    return [queries, cache(ck), cache(cv), tail(bk), tail(bv)]


@needs_metal
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("case", _cases()[::3], ids=lambda c: f"h{c['heads'][0]}_d{c['head_dim']}_c{c['n_ctx']}_{c['mode']}")
def test_metal_kernel_matches_reference(monkeypatch, dtype, case):
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    rng = np.random.default_rng(case["n_ctx"])
    heads, kv_heads = case["heads"]
    arrays = random_inputs(rng, 1, heads, kv_heads, case["block"], case["head_dim"], case["n_ctx"])
    delta = case["n_ctx"] + case["gap"]
    kw = dict(scale=case["head_dim"] ** -0.5, window=window_for(case["mode"], case["n_ctx"], case["block"], delta),
              causal=case["causal"], q_start=delta, ctx_start=0)
    inputs = _cache_slices(rng, arrays, dtype)
    got = block_attention(*inputs, **kw)
    assert attention_path(*inputs)["block_attention"] == "metal"
    want = block_attention_reference(*inputs, **kw)
    assert got.dtype == dtype and got.shape == want.shape
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() / np.abs(want).max() < KERNEL_TOLERANCE[dtype]


@needs_metal
def test_metal_kernel_on_and_off_agree_on_drafter_shapes(monkeypatch):
    # What the drafter passes each layer: Qwen3-8B drafter heads at a growing context.
    rng = np.random.default_rng(0)
    for n_ctx in (0, 17, 300):
        arrays = [mx.array(x).astype(mx.bfloat16) for x in random_inputs(rng, 1, 32, 8, 16, 128, n_ctx)]
        monkeypatch.setenv(ba.ENV_VAR, "1")
        on = block_attention(*arrays, scale=128 ** -0.5)
        assert attention_path(*arrays)["block_attention"] == "metal"
        monkeypatch.setenv(ba.ENV_VAR, "0")
        off = block_attention(*arrays, scale=128 ** -0.5)
        assert attention_path(*arrays)["block_attention"] == "reference"
        on, off = np.array(on.astype(mx.float32)), np.array(off.astype(mx.float32))
        assert np.abs(on - off).max() / np.abs(off).max() < KERNEL_TOLERANCE[mx.bfloat16]


@needs_metal
def test_greedy_engine_output_identical_with_kernel_on_and_off(monkeypatch):
    # A drafter whose head_dim (32) the kernel covers; the engine's output and every
    # step's acceptance must not change with the kernel on or off.
    model, target = tiny_target("qwen3")
    mx.random.seed(1)
    args = dataclasses.replace(tiny_drafter_args(target), head_dim=32)
    drafter = DFlashDrafter(args)
    mx.eval(drafter.parameters())
    drafter = bind_drafter(drafter, target)
    prompt = mx.array([1, 17, 33, 2, 9, 100, 42], dtype=mx.int32)

    def run(value):
        monkeypatch.setenv(ba.ENV_VAR, "0" if value == "1" else "1")  # the other path first
        block_attention(*_drafter_shaped(), scale=0.125)
        monkeypatch.setenv(ba.ENV_VAR, value)
        steps = list(generate_step(prompt, target, drafter, max_tokens=120, block_size=8))
        return [s.tokens for s in steps], [s.accepted for s in steps], drafter.attention_path()["block_attention"]

    on, off = run("1"), run("0")
    assert (on[2], off[2]) == ("metal", "reference")
    assert on[:2] == off[:2]
