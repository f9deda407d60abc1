"""The Metal block-attention kernel body, compiled with g++ and run on the CPU against the reference.

tests/kernel_harness/ wraps ``SOURCE`` in the signature ``mx.fast.metal_kernel`` writes and
runs it over the real grid, one OS thread per GPU thread, with real barriers; simd_sum and
simd_max are barrier exchanges among the 32 lanes. Not bit-faithful to a GPU: the order of
simd_sum's additions and metal::exp's rounding differ, so results are compared with a
tolerance. Under AddressSanitizer out-of-bounds reads fail the run; under ThreadSanitizer a
missing barrier does. The last tests break the kernel on purpose to show the harness notices.
"""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.kernels import block_attention_metal as ba
from dflash_mlx.kernels.block_attention import block_attention_reference
from kernel_harness.emulator import GXX, Emulator, KernelSpec, array_arg, bfloat16_round
from test_block_attention import KERNEL_TOLERANCE

pytestmark = pytest.mark.skipif(
    GXX is None, reason="g++ not found: the CPU harness compiles the Metal kernel body with g++ (CI has it)")

KERNEL = KernelSpec("dflash_block_attention", tuple(ba.INPUT_NAMES), tuple(ba.OUTPUT_NAMES), ba.SOURCE)
NUMPY_DTYPES = {mx.float16: np.float16}


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values representable in ``dtype`` (NaN kept)."""
    if dtype == mx.float16:
        return x.astype(np.float16).astype(np.float32)
    if dtype == mx.bfloat16:
        return bfloat16_round(x)
    return x


class Case:
    """Inputs laid out as the drafter hands them over: queries transposed, context K/V a
    slice of a longer cache whose unused rows are NaN, block K/V the tail of a projection
    whose head rows are NaN (``strided=False``: compact contiguous arrays instead)."""

    def __init__(self, dtype, heads, kv_heads, block, head_dim, n_ctx, *, batch=1, window=None,
                 causal=False, gap=0, strided=True, seed=0):
        rng = np.random.default_rng(seed)
        self.dtype, self.window, self.causal = dtype, window, causal
        self.scale = head_dim ** -0.5
        self.delta = n_ctx + gap
        normal = lambda *shape: _round(rng.standard_normal(shape).astype(np.float32), dtype)
        if strided:
            q_base = normal(batch, block, heads, head_dim)
            q = q_base.transpose(0, 2, 1, 3)
            bases, views = [q_base], [q]
            for _ in range(2):  # context keys, values
                base = normal(batch, kv_heads, n_ctx + 9, head_dim)
                base[:, :, n_ctx:] = np.nan
                bases.append(base)
                views.append(base[:, :, :n_ctx])
            for _ in range(2):  # block keys, values
                base = normal(batch, kv_heads, block + 4, head_dim)
                base[:, :, :4] = np.nan
                bases.append(base)
                views.append(base[:, :, 4:])
        else:
            views = [normal(batch, heads, block, head_dim)] + [
                normal(batch, kv_heads, rows, head_dim) for rows in (n_ctx, n_ctx, block, block)]
            bases = views
        self.views = views
        self.args = [array_arg(v, b, dtype) for v, b in zip(views, bases)]
        self.launch = ba.kernel_launch(views[0].shape, kv_heads, dtype)

    def kernel_inputs(self):
        return ba.kernel_inputs(*self.args, self.views[1].shape[2], self.delta, self.window, self.causal, self.scale)

    def reference(self) -> np.ndarray:
        arrays = [mx.array(np.ascontiguousarray(v)).astype(self.dtype) for v in self.views]
        out = block_attention_reference(*arrays, scale=self.scale, window=self.window, causal=self.causal,
                                        q_start=self.delta, ctx_start=0)
        return np.array(out.astype(mx.float32))

    def run(self, emulator: Emulator, kernel: KernelSpec = KERNEL, seed: int = 0) -> np.ndarray:
        la = self.launch
        return emulator.run(kernel, self.kernel_inputs(), la.output_shape, self.dtype, la.template,
                            la.grid, la.threadgroup, seed=seed)


# A few of the reference test's shapes, small enough to emulate quickly: contexts that are not
# multiples of 32, the empty context, partial query tiles, every window edge, GQA 4 and 8.
CASES = {
    "f32_h8-2_c70_bidir": (mx.float32, 8, 2, 5, 64, 70, dict()),
    "f32_h16-2_d128_c100_cut_causal": (mx.float32, 16, 2, 3, 128, 100, dict(window=52, causal=True)),
    "f32_h8-8_d256_b2_c33_gap_edge": (mx.float32, 8, 8, 2, 256, 33, dict(batch=2, gap=6, window=40)),
    "f32_h4-4_c0_b1_compact": (mx.float32, 4, 4, 1, 64, 0, dict(strided=False)),
    "f16_h8-8_c0_b1": (mx.float16, 8, 8, 1, 64, 0, dict()),
    "f16_h16-2_d128_c33_edge_last_causal": (mx.float16, 16, 2, 16, 128, 33, dict(window=49, causal=True)),
    "f16_h4-1_c200_in_block": (mx.float16, 4, 1, 7, 64, 200, dict(window=3, causal=True)),
    "bf16_h8-2_c100_past": (mx.bfloat16, 8, 2, 7, 64, 100, dict(window=120)),
}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emu = Emulator(tmp_path_factory.mktemp("kernel_asan"), sanitizer="address")
    cases = {name: Case(*spec[:6], **spec[6]) for name, spec in CASES.items()}
    for case in cases.values():
        emu.add(KERNEL, case.kernel_inputs(), [case.dtype], case.launch.template)
    for mutant in (MUTANTS["unguarded_key_read"], MUTANTS["divergent_simd_sum"]):
        emu.add(mutant, MUTANT_CASE.kernel_inputs(), [MUTANT_CASE.dtype], MUTANT_CASE.launch.template)
    emu.compile()
    return emu, cases


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernel_matches_reference(emulator, name):
    emu, cases = emulator
    case = cases[name]
    got = case.run(emu, seed=len(name))
    want = case.reference()
    assert np.isfinite(got).all(), "the kernel wrote NaN (read an unused cache row?) or skipped an output"
    assert np.abs(got - want).max() / np.abs(want).max() < KERNEL_TOLERANCE[case.dtype]


# ---- The harness notices a broken kernel ----

def _mutant(name: str, old: str, new: str) -> KernelSpec:
    assert ba.SOURCE.count(old) == 1, f"mutation {name} no longer matches the kernel source"
    return KernelSpec(f"mutant_{name}", KERNEL.input_names, KERNEL.output_names, ba.SOURCE.replace(old, new))


MUTANTS = {
    "unguarded_key_read": _mutant(
        "unguarded_key_read", "if (valid) {\n        const device T* kp;", "{\n        const device T* kp;"),
    "divergent_simd_sum": _mutant(
        "divergent_simd_sum", "l_r[r] = l_r[r] * alpha + simd_sum(p);",
        "if (lane < 16) { l_r[r] = l_r[r] * alpha + simd_sum(p); }"),
    "no_barrier_after_queries": _mutant(
        "no_barrier_after_queries", "q_tg[idx] = qv;\n    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
        "q_tg[idx] = qv;\n    }"),
    "no_barrier_after_merge": _mutant(
        "no_barrier_after_merge", "      }\n      threadgroup_barrier(mem_flags::mem_threadgroup);\n    }\n",
        "      }\n    }\n"),
}
MUTANT_CASE = Case(mx.float32, 4, 2, 5, 64, 40, strided=False, window=30, causal=True)


def test_out_of_bounds_read_is_caught(emulator):
    emu, _ = emulator
    with pytest.raises(RuntimeError, match="AddressSanitizer: heap-buffer-overflow"):
        MUTANT_CASE.run(emu, MUTANTS["unguarded_key_read"])


def test_divergent_simd_function_is_caught(emulator):
    emu, _ = emulator
    with pytest.raises(RuntimeError, match="simd_(sum|max) reached divergently"):
        MUTANT_CASE.run(emu, MUTANTS["divergent_simd_sum"])


@pytest.fixture(scope="module")
def tsan(tmp_path_factory):
    emu = Emulator(tmp_path_factory.mktemp("kernel_tsan"), sanitizer="thread")
    for kernel in (KERNEL, MUTANTS["no_barrier_after_queries"], MUTANTS["no_barrier_after_merge"]):
        emu.add(kernel, MUTANT_CASE.kernel_inputs(), [MUTANT_CASE.dtype], MUTANT_CASE.launch.template)
    emu.compile()
    return emu


def test_kernel_has_no_data_race(tsan):
    got = MUTANT_CASE.run(tsan, seed=1)
    assert np.abs(got - MUTANT_CASE.reference()).max() < 1e-5


@pytest.mark.parametrize("mutant", ["no_barrier_after_queries", "no_barrier_after_merge"])
def test_missing_barrier_is_caught(tsan, mutant):
    with pytest.raises(RuntimeError, match="ThreadSanitizer: data race"):
        MUTANT_CASE.run(tsan, MUTANTS[mutant])
