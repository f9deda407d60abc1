"""The Metal kernel of the drafter's block attention (one pass, online softmax in float32).

One threadgroup per (batch row, KV head, tile of ``QT`` query rows): the query rows of a KV head are its ``n_heads /
n_kv_heads`` heads times the B block rows, so GQA shares one K/V read. ``NS`` simdgroups split the keys (context rows,
then block rows) in tiles of 32 and merge their partial (max, sum, output) at the end. Masked keys get weight 0 through
a flag, never through ``-inf``; inputs are read through their strides. ``tests/kernel_harness`` runs this ``SOURCE`` on
a CPU.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

SIMDGROUPS = 8  # simdgroups per threadgroup: 256 threads
INPUT_NAMES = ["queries", "ctx_keys", "ctx_values", "block_keys", "block_values",
               "n_ctx", "delta", "window", "causal", "scale"]
OUTPUT_NAMES = ["out"]

# Template: T (dtype), D (head_dim), QT (query rows per threadgroup), NS (simdgroups).
# Scalars: n_ctx (C), delta (q_start - ctx_start), window (0: none), causal (0/1), scale.
SOURCE = """
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
    float l_r[QT] = {0.0f};
    float o_r[QT * EPL] = {0.0f};
    for (int r = 0; r < QT; ++r) {
      m_r[r] = NEG;
    }

    for (int base = lo + sg * 32; base < end; base += NT) {
      const int u = base + lane;
      const bool valid = u < end;
      const int jb = u - n_ctx;
      float s[QT] = {0.0f};
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

KERNEL_AVAILABLE = mx.metal.is_available()
_KERNEL = mx.fast.metal_kernel(name="dflash_block_attention", input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
                               source=SOURCE, ensure_row_contiguous=False) if KERNEL_AVAILABLE else None


@dataclass(frozen=True)
class KernelLaunch:
    """Template ``[("T", dtype), ("D", head_dim), ("QT", rows), ("NS", simdgroups)]``, grid
    ``(tiles * NS * 32, n_kv_heads, batch)``, threadgroup ``(NS * 32, 1, 1)`` and output shape."""

    template: List[Tuple[str, object]]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shape: Tuple[int, int, int, int]


def kernel_launch(queries_shape: Tuple[int, ...], n_kv_heads: int, dtype: mx.Dtype) -> KernelLaunch:
    """The launch for queries of shape ``(batch, n_heads, B, head_dim)``; ``QT`` is at most 8 rows
    (4 when ``head_dim`` > 128)."""
    batch, n_heads, block, head_dim = (int(x) for x in queries_shape)
    rows = (n_heads // n_kv_heads) * block
    qt = min(rows, 8 if head_dim <= 128 else 4)
    threads = SIMDGROUPS * 32
    return KernelLaunch(template=[("T", dtype), ("D", head_dim), ("QT", qt), ("NS", SIMDGROUPS)],
                        grid=(-(-rows // qt) * threads, n_kv_heads, batch), threadgroup=(threads, 1, 1),
                        output_shape=(batch, n_heads, block, head_dim))


def kernel_inputs(queries, ctx_keys, ctx_values, block_keys, block_values, n_ctx: int, delta: int,
                  window: Optional[int], causal: bool, scale: float) -> list:
    """The inputs in ``INPUT_NAMES`` order; with no context rows the block K/V stand in for the
    (unread) context arrays, since an empty array cannot be bound."""
    if n_ctx == 0:
        ctx_keys, ctx_values = block_keys, block_values
    return [queries, ctx_keys, ctx_values, block_keys, block_values, int(n_ctx), int(delta),
            0 if window is None else int(window), int(bool(causal)), float(scale)]


def metal_block_attention(queries, ctx_keys, ctx_values, block_keys, block_values,
                          scale: float, window: Optional[int], causal: bool, delta: int) -> mx.array:
    """The kernel's result for checked inputs (as ``block_attention``'s; ``delta`` = q_start - ctx_start).
    Needs ``KERNEL_AVAILABLE``."""
    launch = kernel_launch(queries.shape, block_keys.shape[1], queries.dtype)
    inputs = kernel_inputs(queries, ctx_keys, ctx_values, block_keys, block_values,
                           ctx_keys.shape[2], delta, window, causal, scale)
    return _KERNEL(inputs=inputs, template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
                   output_shapes=[launch.output_shape], output_dtypes=[queries.dtype])[0]
