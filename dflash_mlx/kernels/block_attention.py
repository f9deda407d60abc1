# Over 400 lines: one kernel per file: its Metal source (180 lines), launch, fallback choice and the ops reference
"""Block attention of the drafter: B block queries over context K/V plus the block's own K/V.

The drafter's attention (DFLASH_SPEC.md section 4) lets the B block queries look at
the cached context rows and at the block's own rows. :func:`block_attention` computes
it without concatenating the context cache with the block every round: the Metal
kernel reads the two K/V sources separately, and the reference does two matmuls.

Kernel design (one pass, online softmax in float32):

- One threadgroup per (batch row, KV head, tile of ``QT`` query rows). The query rows
  of a KV head are its ``group = n_heads / n_kv_heads`` query heads times the B block
  rows, so GQA shares one K/V read among the heads of a group.
- ``NS`` simdgroups split the keys (context rows then block rows) in tiles of 32: lane
  ``l`` scores key ``base + l`` against the tile's queries (kept in threadgroup memory),
  the simdgroup updates a running max and sum per query with ``simd_max``/``simd_sum``,
  and each lane accumulates the output dimensions ``d = lane + 32 e`` of every query.
- Masked keys (sliding window, causal block) get weight exactly 0 through a flag, never
  through ``-inf`` arithmetic; a finite sentinel stands for "no key yet", so a simdgroup
  that sees no key contributes nothing.
- The simdgroups merge their partial (max, sum, output) through threadgroup memory.
- Inputs are read through their strides, so slices of a preallocated KV cache need no copy.

Covered: float16, bfloat16 and float32 inputs of one dtype, ``head_dim`` a multiple of
32 up to 256, any batch, heads, block size and context length (0 included). Everything
else, a machine without Metal, a CPU default device, and ``DFLASH_BLOCK_KERNEL=0`` use
:func:`block_attention_reference`; :func:`attention_path` says which ran and why.

Testing: ``tests/kernel_harness`` compiles this very ``_SOURCE`` with g++ and runs it over
the real grid on a CPU; ``scripts/bench_kernel.py`` checks it on a Mac.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

from ..errors import InputError

ENV_VAR = "DFLASH_BLOCK_KERNEL"
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes", "auto")

SIMDGROUPS = 8  # simdgroups per threadgroup: 256 threads
_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

INPUT_NAMES = [
    "queries", "ctx_keys", "ctx_values", "block_keys", "block_values",
    "n_ctx", "delta", "window", "causal", "scale",
]
OUTPUT_NAMES = ["out"]

# Template: T (input and output type), D (head_dim, multiple of 32, <= 256),
# QT (query rows per threadgroup), NS (simdgroups per threadgroup).
# Scalars: n_ctx (context rows C), delta (q_start - ctx_start), window (W, 0 = none),
# causal (0/1, in-block), scale.
_SOURCE = """
    constexpr int EPL = D / 32;
    constexpr int NT = NS * 32;
    constexpr float NEG = -1.0e30f;

    threadgroup float q_tg[QT * D];
    threadgroup float p_tg[NS * QT * 32];
    threadgroup float m_tg[NS * QT];
    threadgroup float l_tg[NS * QT];
    threadgroup float o_tg[NS * D];

    const int tid = int(thread_index_in_threadgroup);
    const int lane = int(thread_index_in_simdgroup);
    const int sg = int(simdgroup_index_in_threadgroup);
    const int tile = int(threadgroup_position_in_grid.x);
    const int kvh = int(threadgroup_position_in_grid.y);
    const int n = int(threadgroup_position_in_grid.z);

    const int n_heads = queries_shape[1];
    const int n_block = queries_shape[2];
    const int group = n_heads / block_keys_shape[1];
    const int rows = group * n_block;
    const int row0 = tile * QT;

    // Block row of each tile row; rows past the end are clamped and never written.
    int ri[QT];
    int i_min = n_block;
    int i_max = 0;
    for (int r = 0; r < QT; ++r) {
      const int row = metal::min(row0 + r, rows - 1);
      ri[r] = row % n_block;
      i_min = metal::min(i_min, ri[r]);
      i_max = metal::max(i_max, ri[r]);
    }

    // Scaled queries of the tile, float32, in threadgroup memory.
    for (int idx = tid; idx < QT * D; idx += NT) {
      const int r = idx / D;
      const int d = idx - r * D;
      const int row = row0 + r;
      float qv = 0.0f;
      if (row < rows) {
        const int qh = kvh * group + row / n_block;
        const int i = row % n_block;
        qv = static_cast<float>(queries[n * queries_strides[0] + qh * queries_strides[1] +
                                        i * queries_strides[2] + d * queries_strides[3]]) * scale;
      }
      q_tg[idx] = qv;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Keys u in [lo, end): u < n_ctx is context row u, else block row u - n_ctx.
    int lo = 0;
    if (window > 0) {
      lo = metal::max(0, metal::min(n_ctx, i_min + delta - window + 1));
    }
    const int end = n_ctx + (causal != 0 ? i_max + 1 : n_block);

    float m_r[QT];
    float l_r[QT];
    float o_r[QT * EPL];
    for (int r = 0; r < QT; ++r) {
      m_r[r] = NEG;
      l_r[r] = 0.0f;
      for (int e = 0; e < EPL; ++e) {
        o_r[r * EPL + e] = 0.0f;
      }
    }

    for (int base = lo + sg * 32; base < end; base += NT) {
      const int u = base + lane;
      const bool valid = u < end;
      const int jb = u - n_ctx;
      float s[QT];
      for (int r = 0; r < QT; ++r) {
        s[r] = 0.0f;
      }
      if (valid) {
        const device T* kp;
        int64_t ks;
        if (u < n_ctx) {
          kp = ctx_keys + (n * ctx_keys_strides[0] + kvh * ctx_keys_strides[1] +
                           u * ctx_keys_strides[2]);
          ks = ctx_keys_strides[3];
        } else {
          kp = block_keys + (n * block_keys_strides[0] + kvh * block_keys_strides[1] +
                             jb * block_keys_strides[2]);
          ks = block_keys_strides[3];
        }
        for (int d = 0; d < D; ++d) {
          const float kd = static_cast<float>(kp[d * ks]);
          for (int r = 0; r < QT; ++r) {
            s[r] += q_tg[r * D + d] * kd;
          }
        }
      }
      for (int r = 0; r < QT; ++r) {
        bool vis = valid;
        if (u < n_ctx) {
          vis = vis && (window <= 0 || ri[r] + delta - u < window);
        } else {
          vis = vis && (causal == 0 || jb <= ri[r]) && (window <= 0 || ri[r] - jb < window);
        }
        const float tile_max = simd_max(vis ? s[r] : NEG);
        const float m_new = metal::max(m_r[r], tile_max);
        const float p = vis ? metal::exp(s[r] - m_new) : 0.0f;
        const float alpha = metal::exp(m_r[r] - m_new);
        l_r[r] = l_r[r] * alpha + simd_sum(p);
        m_r[r] = m_new;
        for (int e = 0; e < EPL; ++e) {
          o_r[r * EPL + e] *= alpha;
        }
        p_tg[(sg * QT + r) * 32 + lane] = p;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      const int nk = metal::min(32, end - base);
      for (int j = 0; j < nk; ++j) {
        const int uj = base + j;
        const device T* vp;
        int64_t vs;
        if (uj < n_ctx) {
          vp = ctx_values + (n * ctx_values_strides[0] + kvh * ctx_values_strides[1] +
                             uj * ctx_values_strides[2]);
          vs = ctx_values_strides[3];
        } else {
          vp = block_values + (n * block_values_strides[0] + kvh * block_values_strides[1] +
                               (uj - n_ctx) * block_values_strides[2]);
          vs = block_values_strides[3];
        }
        float vv[EPL];
        for (int e = 0; e < EPL; ++e) {
          vv[e] = static_cast<float>(vp[(lane + 32 * e) * vs]);
        }
        for (int r = 0; r < QT; ++r) {
          const float pj = p_tg[(sg * QT + r) * 32 + j];
          for (int e = 0; e < EPL; ++e) {
            o_r[r * EPL + e] += pj * vv[e];
          }
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    // Merge the simdgroups' partial results, one query row at a time.
    if (lane == 0) {
      for (int r = 0; r < QT; ++r) {
        m_tg[sg * QT + r] = m_r[r];
        l_tg[sg * QT + r] = l_r[r];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int r = 0; r < QT; ++r) {
      float m_all = NEG;
      for (int g = 0; g < NS; ++g) {
        m_all = metal::max(m_all, m_tg[g * QT + r]);
      }
      float l_all = 0.0f;
      for (int g = 0; g < NS; ++g) {
        l_all += l_tg[g * QT + r] * metal::exp(m_tg[g * QT + r] - m_all);
      }
      const float f = metal::exp(m_r[r] - m_all);
      for (int e = 0; e < EPL; ++e) {
        o_tg[sg * D + lane + 32 * e] = o_r[r * EPL + e] * f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const int row = row0 + r;
      if (row < rows) {
        const int qh = kvh * group + row / n_block;
        const int i = row % n_block;
        const int64_t ob = ((int64_t(n) * n_heads + qh) * n_block + i) * D;
        for (int d = tid; d < D; d += NT) {
          float acc = 0.0f;
          for (int g = 0; g < NS; ++g) {
            acc += o_tg[g * D + d];
          }
          out[ob + d] = static_cast<T>(acc / l_all);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
"""


def _make_kernel():
    # Built once, and only where Metal exists (as mlx-lm's gated_delta guards its kernels).
    if not mx.metal.is_available():
        return None
    return mx.fast.metal_kernel(
        name="dflash_block_attention",
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=_SOURCE,
        ensure_row_contiguous=False,
    )


_KERNEL = _make_kernel()


@dataclass(frozen=True)
class KernelLaunch:
    """How the kernel is launched for one shape (also used by the CPU test harness).

    Attributes:
        template: ``[("T", dtype), ("D", head_dim), ("QT", rows), ("NS", simdgroups)]``.
        grid: threads per dimension ``(tiles * NS * 32, n_kv_heads, batch)``.
        threadgroup: ``(NS * 32, 1, 1)``.
        output_shape: ``[batch, n_heads, B, head_dim]``.
    """

    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shape: Tuple[int, int, int, int]


def kernel_launch(queries_shape: Tuple[int, ...], n_kv_heads: int, dtype: mx.Dtype) -> KernelLaunch:
    """Template arguments, grid and threadgroup for queries of ``queries_shape``.

    Args:
        queries_shape: ``(batch, n_heads, B, head_dim)``.
        n_kv_heads: KV heads; divides ``n_heads``.
        dtype: the inputs' dtype (float16, bfloat16 or float32).

    Returns:
        The :class:`KernelLaunch`; ``QT`` is at most 8 rows (4 when ``head_dim`` > 128)
        so that per-thread registers stay small.
    """
    batch, n_heads, block, head_dim = (int(x) for x in queries_shape)
    rows = (n_heads // n_kv_heads) * block
    qt = min(rows, 8 if head_dim <= 128 else 4)
    tiles = -(-rows // qt)
    threads = SIMDGROUPS * 32
    return KernelLaunch(
        template=[("T", dtype), ("D", head_dim), ("QT", qt), ("NS", SIMDGROUPS)],
        grid=(tiles * threads, n_kv_heads, batch),
        threadgroup=(threads, 1, 1),
        output_shape=(batch, n_heads, block, head_dim),
    )


def _relative_start(n_ctx: int, q_start: Optional[int], ctx_start: Optional[int]) -> int:
    """``delta = q_start - ctx_start``: how far the first query is from the first context row."""
    if q_start is None:
        return n_ctx
    if ctx_start is None:
        ctx_start = q_start - n_ctx
    delta = q_start - ctx_start
    if delta < n_ctx:
        raise InputError(
            f"block_attention: context rows [{ctx_start}, {ctx_start + n_ctx}) overlap the block "
            f"starting at q_start={q_start}; the context must come before the block"
        )
    return delta


def _check(queries, ctx_keys, ctx_values, block_keys, block_values, window) -> None:
    """Raise InputError naming the argument whose shape does not fit."""
    named = dict(queries=queries, ctx_keys=ctx_keys, ctx_values=ctx_values,
                 block_keys=block_keys, block_values=block_values)
    for name, x in named.items():
        if x.ndim != 4:
            raise InputError(f"block_attention: {name} must be [batch, heads, rows, head_dim], got shape {x.shape}")
    batch, n_heads, block, head_dim = queries.shape
    n_kv = block_keys.shape[1]
    want = (batch, n_kv, block, head_dim)
    for name in ("block_keys", "block_values"):
        if tuple(named[name].shape) != want:
            raise InputError(f"block_attention: {name} has shape {named[name].shape}, expected {list(want)}")
    n_ctx = ctx_keys.shape[2]
    for name in ("ctx_keys", "ctx_values"):
        if tuple(named[name].shape) != (batch, n_kv, n_ctx, head_dim):
            raise InputError(
                f"block_attention: {name} has shape {named[name].shape}, "
                f"expected {[batch, n_kv, n_ctx, head_dim]}"
            )
    if n_heads % n_kv:
        raise InputError(f"block_attention: {n_heads} query heads are not a multiple of {n_kv} KV heads")
    if block < 1:
        raise InputError("block_attention: the block has no rows")
    if window is not None and window < 1:
        raise InputError(f"block_attention: window {window} must be at least 1")


def block_attention_reference(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    *,
    scale: float,
    window: Optional[int] = None,
    causal: bool = False,
    q_start: Optional[int] = None,
    ctx_start: Optional[int] = None,
) -> mx.array:
    """The result the kernel must match, in plain MLX ops (float32 math).

    Same arguments and result as :func:`block_attention`. The context and block K/V
    are concatenated (a copy of the context rows per call, which the kernel avoids),
    scored in one matmul and weighted by a softmax whose exponential is
    ``2 ** (x * log2(e))``: on MLX's x86-64 CPU backend ``mx.exp`` is about twice as
    slow as ``mx.power`` (docs/benchmarks.md), and the drafter's attention is most of
    a draft there. A mask is applied only where some key is hidden (a window, or a
    causal block).
    """
    _check(queries, ctx_keys, ctx_values, block_keys, block_values, window)
    batch, n_heads, block, head_dim = queries.shape
    n_kv = block_keys.shape[1]
    n_ctx = ctx_keys.shape[2]
    delta = _relative_start(n_ctx, q_start, ctx_start)
    group = n_heads // n_kv
    # Query heads of one KV head side by side: row g * B + i is head kv * group + g, block row i.
    q = (_f32(queries) * scale).reshape(batch, n_kv, group * block, head_dim)
    keys, values = _f32(block_keys), _f32(block_values)
    if n_ctx > 0:
        keys = mx.concatenate([_f32(ctx_keys), keys], axis=2)
        values = mx.concatenate([_f32(ctx_values), values], axis=2)
    scores = q @ keys.swapaxes(-1, -2)  # [batch, n_kv, group * B, C + B]
    visible = _visible(block, n_ctx, delta, window, causal)
    if visible is not None:
        scores = mx.where(mx.tile(visible, (group, 1)), scores, -mx.inf)
    out = softmax_exp2(scores) @ values
    return out.reshape(batch, n_heads, block, head_dim).astype(queries.dtype)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _visible(block: int, n_ctx: int, delta: int, window: Optional[int], causal: bool) -> Optional[mx.array]:
    """[B, C + B] bool, True where block row i may see key j (context keys first), or
    None when every key is visible. Context row k sits ``delta - k`` before the first
    query; every query sees itself, so no row is all hidden."""
    if window is None and not causal:
        return None
    i = mx.arange(block)[:, None]
    j = mx.arange(block)[None, :]
    in_block = (j <= i) if causal else mx.ones((block, block), dtype=mx.bool_)
    if window is not None:
        in_block = in_block & (i - j < window)
    if n_ctx == 0:
        return in_block
    k = mx.arange(n_ctx)[None, :]
    in_ctx = (i + delta - k < window) if window is not None else mx.ones((block, n_ctx), dtype=mx.bool_)
    return mx.concatenate([in_ctx, in_block], axis=1)


_LOG2E = 1.4426950408889634


def softmax_exp2(scores: mx.array) -> mx.array:
    """Softmax over the last axis of float32 ``scores`` (``-inf`` entries get weight 0),
    with ``2 ** (x * log2(e))`` for the exponential (see :func:`block_attention_reference`)."""
    weights = mx.power(2.0, (scores - scores.max(axis=-1, keepdims=True)) * _LOG2E)
    return weights / weights.sum(axis=-1, keepdims=True)


def kernel_inputs(queries, ctx_keys, ctx_values, block_keys, block_values, n_ctx: int, delta: int,
                  window: Optional[int], causal: bool, scale: float) -> list:
    """The kernel's inputs in ``INPUT_NAMES`` order (the CPU test harness passes its own arrays).

    With no context rows (``n_ctx`` 0) the block K/V stand in for the context arrays,
    since an empty array cannot be bound; the kernel never reads them then.
    """
    if n_ctx == 0:
        ctx_keys, ctx_values = block_keys, block_values
    return [queries, ctx_keys, ctx_values, block_keys, block_values, int(n_ctx), int(delta),
            0 if window is None else int(window), int(bool(causal)), float(scale)]


def _metal_block_attention(queries, ctx_keys, ctx_values, block_keys, block_values,
                           scale: float, window: Optional[int], causal: bool, delta: int) -> mx.array:
    launch = kernel_launch(queries.shape, block_keys.shape[1], queries.dtype)
    return _KERNEL(
        inputs=kernel_inputs(queries, ctx_keys, ctx_values, block_keys, block_values,
                             ctx_keys.shape[2], delta, window, causal, scale),
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[launch.output_shape],
        output_dtypes=[queries.dtype],
    )[0]


def _environment_reason() -> Optional[str]:
    """Why the kernel cannot run here whatever the shape, or None when it can.

    Raises:
        InputError: ``DFLASH_BLOCK_KERNEL`` holds a value other than 0/off or 1/on.
    """
    value = os.environ.get(ENV_VAR)
    if value is not None:
        key = value.strip().lower()
        if key in _OFF:
            return f"{ENV_VAR}={value}"
        if key not in _ON:
            raise InputError(f"{ENV_VAR}={value!r}: expected 0/off (reference) or 1/on (kernel when possible)")
    if not mx.metal.is_available() or _KERNEL is None:
        return "Metal is not available (CPU backend)"
    if mx.default_device() != mx.gpu:
        return "the default device is the CPU"
    return None


def _shape_reason(queries, ctx_keys, ctx_values, block_keys, block_values) -> Optional[str]:
    """Why the kernel does not cover these inputs, or None when it does."""
    dtypes = {x.dtype for x in (queries, ctx_keys, ctx_values, block_keys, block_values)}
    if len(dtypes) > 1:
        return f"mixed input dtypes {sorted(str(d) for d in dtypes)}"
    if queries.dtype not in _DTYPES:
        return f"dtype {queries.dtype} is not float16, bfloat16 or float32"
    head_dim = queries.shape[-1]
    if head_dim % 32 or not 32 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a multiple of 32 in [32, 256]"
    return None


_last_path = {}


def _decide(queries, ctx_keys, ctx_values, block_keys, block_values) -> Tuple[str, str]:
    reason = _environment_reason() or _shape_reason(queries, ctx_keys, ctx_values, block_keys, block_values)
    if reason:
        return "reference", reason
    return "metal", "Metal is available and the shape is covered"


def block_attention(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    *,
    scale: float,
    window: Optional[int] = None,
    causal: bool = False,
    q_start: Optional[int] = None,
    ctx_start: Optional[int] = None,
) -> mx.array:
    """Attention of the block queries over context K/V then the block's own K/V.

    Runs the Metal kernel when Metal is available, the default device is the GPU,
    the shape is covered and ``DFLASH_BLOCK_KERNEL`` is not 0/off; otherwise
    :func:`block_attention_reference`. :func:`attention_path` reports the choice.

    Args:
        queries: [batch, n_heads, B, head_dim], RoPE applied, at absolute positions
            ``q_start .. q_start + B - 1``.
        ctx_keys, ctx_values: [batch, n_kv_heads, C, head_dim] context rows at absolute
            positions ``ctx_start .. ctx_start + C - 1`` (C may be 0). Slices of a
            preallocated cache are read in place.
        block_keys, block_values: [batch, n_kv_heads, B, head_dim], the block's own rows
            at the queries' positions.
        scale: score multiplier, usually ``head_dim ** -0.5``.
        window: sliding window W (sliding drafter layers, spec section 9): a query at
            position p sees keys at positions k with ``p - k < W``. None (default): all.
        causal: in-block attention causal (sliding layers) instead of bidirectional
            (default, full layers). Context rows are always visible up to the window.
        q_start, ctx_start: absolute positions; only their difference matters. Default:
            the context ends right before the block (``q_start = ctx_start + C``).

    Returns:
        [batch, n_heads, B, head_dim] in the queries' dtype. Query head h uses KV head
        ``h // (n_heads // n_kv_heads)``. Softmax statistics are float32.

    Raises:
        InputError: shapes that do not fit together, ``window`` < 1, context rows that
            overlap the block, or an unknown ``DFLASH_BLOCK_KERNEL`` value.
    """
    _check(queries, ctx_keys, ctx_values, block_keys, block_values, window)
    delta = _relative_start(ctx_keys.shape[2], q_start, ctx_start)
    path, reason = _decide(queries, ctx_keys, ctx_values, block_keys, block_values)
    _last_path.update({"block_attention": path, "reason": reason})
    if path == "metal":
        return _metal_block_attention(queries, ctx_keys, ctx_values, block_keys, block_values,
                                      scale, window, causal, delta)
    return block_attention_reference(
        queries, ctx_keys, ctx_values, block_keys, block_values,
        scale=scale, window=window, causal=causal, q_start=delta, ctx_start=0,
    )


def attention_path() -> dict:
    """Which block-attention path ran last, and why (for ``--json`` stats and stderr).

    Returns:
        ``{"block_attention": "metal" | "reference", "reason": str}`` for the latest
        :func:`block_attention` call; before any call, the path the environment allows
        (reason e.g. "Metal is not available (CPU backend)" or "DFLASH_BLOCK_KERNEL=0").

    Raises:
        InputError: an unknown ``DFLASH_BLOCK_KERNEL`` value (before any call).
    """
    if _last_path:
        return dict(_last_path)
    reason = _environment_reason()
    if reason:
        return {"block_attention": "reference", "reason": reason}
    return {"block_attention": "metal", "reason": "Metal is available (shape not seen yet)"}
