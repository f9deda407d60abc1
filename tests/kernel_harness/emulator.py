"""Run an ``mx.fast.metal_kernel`` body on a CPU: g++ + metal_emulation.h (test code).

The kernel source is wrapped in the same signature ``mx.fast.metal_kernel`` generates
(mirrored from MLX's ``write_signature``: inputs in order, ``const device T*`` arrays or
``const constant T&`` scalars, ``NAME_shape``/``NAME_strides``/``NAME_ndim`` when the body
mentions them, outputs, then the thread attributes the body mentions; template
parameters and the explicit instantiation as MLX writes them). One executable holds every
kernel variant of a test module; each run writes the inputs to files, runs the grid
(one OS thread per GPU thread) and reads the output back.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
GXX = shutil.which("g++")

TYPE_STRINGS = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t", mx.bool_: "bool",
}
# Thread attributes mx.fast.metal_kernel adds when the body mentions them, in its order.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
# Where the launcher's Attrs holds each attribute (aliases share a field).
_ATTR_FIELD = {
    "dispatch_quadgroups_per_threadgroup": "quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": "threads_per_threadgroup",
    "grid_size": "threads_per_grid",
    "thread_execution_width": "threads_per_simdgroup",
}
MAX_CONSTANT_ARRAY_SIZE = 8  # smaller inputs are passed in the constant address space


@dataclass
class ArrayArg:
    """An input array as the kernel sees it: a buffer, an element offset, shape and strides."""

    buffer: np.ndarray  # 1-d, storage dtype (float32, float16, or uint16 bits for bfloat16)
    dtype: mx.Dtype
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # in elements
    offset: int = 0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


Arg = Union[ArrayArg, int, float]


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bfloat16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 value."""
    return (to_bfloat16_bits(x).astype(np.uint32) << 16).view(np.float32)


def array_arg(view: np.ndarray, base: np.ndarray, dtype: mx.Dtype) -> ArrayArg:
    """Describe ``view`` (a view of the float32 array ``base``) as a kernel input of ``dtype``.

    The whole of ``base`` becomes the buffer, so rows outside the view (e.g. the unused
    tail of a preallocated cache) are there to be misread; fill them with NaN.
    """
    if base.dtype != np.float32 or view.dtype != np.float32 or not base.flags.c_contiguous:
        raise ValueError("base must be a C-contiguous float32 array and view a view of it")
    start = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    flat = base.reshape(-1)
    if dtype == mx.float32:
        buf = flat.copy()
    elif dtype == mx.float16:
        buf = flat.astype(np.float16)
    elif dtype == mx.bfloat16:
        buf = to_bfloat16_bits(flat)
    else:
        raise ValueError(f"unsupported dtype {dtype}")
    return ArrayArg(buf, dtype, tuple(view.shape), tuple(s // 4 for s in view.strides), start // 4)


def _scalar_dtype(x) -> mx.Dtype:
    if isinstance(x, bool):
        return mx.bool_
    return mx.int32 if isinstance(x, int) else mx.float32


def _template_def(template: Sequence[Tuple[str, object]]) -> str:
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append(str(int(value)))
        elif isinstance(value, int):
            parts.append(str(value))
        else:
            parts.append(TYPE_STRINGS[value])
    return "<" + ", ".join(parts) + ">"


def kernel_source(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                  inputs: Sequence[Arg], output_dtypes: Sequence[mx.Dtype],
                  template: Sequence[Tuple[str, object]], header: str = "") -> Tuple[str, str, List[str], List[Tuple[str, str]]]:
    """The kernel text ``mx.fast.metal_kernel`` would compile, and how to call it.

    Returns:
        (kernel name, source text, parameter names in order, attributes used as (name, type)).
    """
    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = _template_def(template)
        kernel_name += "_" + re.sub(r"<|>|(, )", "_", template_def)[:-1]
    for x in inputs:
        dtype = x.dtype if isinstance(x, ArrayArg) else _scalar_dtype(x)
        kernel_name += "_" + TYPE_STRINGS[dtype]
        if not isinstance(x, ArrayArg):
            kernel_name += "s"
        elif x.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for dtype in output_dtypes:
        kernel_name += "_" + TYPE_STRINGS[dtype]

    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    text = header
    if template:
        kinds = []
        for tname, value in template:
            kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"
            kinds.append(f"{kind} {tname}")
        text += "template <" + ", ".join(kinds) + ">\n"
    text += f"[[kernel]] void {kernel_name}(\n"
    params = []
    index = 0
    for pname, x in zip(input_names, inputs):
        if isinstance(x, ArrayArg):
            location = "constant" if x.size < MAX_CONSTANT_ARRAY_SIZE else "device"
            text += f"  const {location} {TYPE_STRINGS[x.dtype]}* {pname} [[buffer({index})]],\n"
        else:
            text += f"  const constant {TYPE_STRINGS[_scalar_dtype(x)]}& {pname} [[buffer({index})]],\n"
        params.append(pname)
        index += 1
        if isinstance(x, ArrayArg) and len(x.shape) > 0:
            for suffix, ctype in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
                if pname + suffix in source:
                    text += f"  const constant {ctype} {pname}{suffix} [[buffer({index})]],\n"
                    params.append(pname + suffix)
                    index += 1
    for k, (oname, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"  device {TYPE_STRINGS[dtype]}* {oname} [[buffer({index})]]"
        params.append(oname)
        last = k == len(output_names) - 1 and not attributes
        text += ") {\n" if last else ",\n"
        index += 1
    for k, (attr, atype) in enumerate(attributes):
        text += f"  {atype} {attr} [[{attr}]]"
        text += ") {\n" if k == len(attributes) - 1 else ",\n"
    text += source + "\n}\n"
    if template:
        full = kernel_name + template_def
        text += (f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({full}) {full};\n')
    return kernel_name, text, params, attributes


@dataclass
class _Variant:
    index: int
    kernel_name: str
    text: str
    call: str


def _call_expression(kernel_name, template, input_names, output_names, inputs, output_dtypes, params, attributes):
    args = []
    for k, (pname, x) in enumerate(zip(input_names, inputs)):
        if isinstance(x, ArrayArg):
            ctype = TYPE_STRINGS[x.dtype]
            args.append(f"in[{k}].ptr<{ctype}>()")
            if pname + "_shape" in params:
                args.append(f"in[{k}].shape.data()")
            if pname + "_strides" in params:
                args.append(f"in[{k}].strides.data()")
            if pname + "_ndim" in params:
                args.append(f"in[{k}].ndim")
        else:
            args.append(f"in[{k}].f32" if isinstance(x, float) else f"in[{k}].i32")
    for dtype in output_dtypes:
        args.append(f"job.out_ptr<{TYPE_STRINGS[dtype]}>()")
    for attr, _ in attributes:
        args.append("a." + _ATTR_FIELD.get(attr, attr))
    targs = _template_def(template) if template else ""
    return f"{kernel_name}{targs}(" + ", ".join(args) + ")"


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` is given: name, parameter names, body and header."""

    name: str
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    source: str
    header: str = ""


class Emulator:
    """Compile kernel variants with g++ into one program and run them on the CPU.

    Args:
        workdir: where the source, the executable and job files go.
        sanitizer: "address" (bounds, default), "thread" (races) or None.
    """

    def __init__(self, workdir: Path, sanitizer: Optional[str] = "address"):
        self.sanitizer = sanitizer
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.variants: Dict[str, _Variant] = {}
        self.binary: Optional[Path] = None
        self.compile_warnings = ""
        self._runs = 0

    def add(self, kernel: KernelSpec, inputs: Sequence[Arg], output_dtypes: Sequence[mx.Dtype],
            template: Sequence[Tuple[str, object]]) -> str:
        """Register the variant these inputs need; returns its kernel name."""
        kname, text, params, attributes = kernel_source(
            kernel.name, kernel.input_names, kernel.output_names, kernel.source, inputs, output_dtypes,
            template, kernel.header)
        if kname not in self.variants:
            call = _call_expression(kname, template, kernel.input_names, kernel.output_names, inputs,
                                    output_dtypes, params, attributes)
            self.variants[kname] = _Variant(len(self.variants), kname, text, call)
            self.binary = None
        return kname

    def program(self) -> str:
        """The whole C++ program: emulation header, every variant, launcher, main."""
        parts = ['#include "metal_emulation.h"\n']
        for v in self.variants.values():
            parts.append(f"// ---- {v.kernel_name}: the text mx.fast.metal_kernel compiles ----\n")
            parts.append(v.text)
        parts.append("#undef device\n#undef constant\n#undef thread\n#undef threadgroup\n")
        parts.append('#include "launcher.h"\n')
        names = []
        for v in self.variants.values():
            names.append(f"launch_{v.index}")
            parts.append(
                f"static void launch_{v.index}(metal_emu::Job& job) {{\n"
                f"  auto& in = job.inputs;\n"
                f"  metal_emu::run_grid(job, [&](const metal_emu::Attrs& a) {{ {v.call}; }});\n}}\n")
        parts.append("static void (*const VARIANTS[])(metal_emu::Job&) = {" + ", ".join(names) + "};\n")
        parts.append(
            "int main(int argc, char** argv) {\n"
            "  if (argc != 2) metal_emu::die(\"usage: kernel JOBFILE\");\n"
            "  metal_emu::Job job = metal_emu::read_job(argv[1]);\n"
            f"  if (job.config < 0 || job.config >= {len(names)}) metal_emu::die(\"bad config\");\n"
            "  VARIANTS[job.config](job);\n"
            "  metal_emu::write_output(job);\n"
            "  return 0;\n}\n")
        return "".join(parts)

    def compile(self) -> Path:
        """Build the executable for the registered variants (cached by source hash)."""
        if GXX is None:
            raise RuntimeError("g++ not found")
        program = self.program()
        flags = ["-std=c++20", "-O1", "-g", "-pthread", "-Wall", "-Wno-attributes", "-Wno-unknown-pragmas"]
        if self.sanitizer:
            flags += [f"-fsanitize={self.sanitizer}", "-fno-omit-frame-pointer"]
        headers = "".join((HERE / h).read_text() for h in ("metal_emulation.h", "launcher.h"))
        digest = hashlib.sha1((program + headers + " ".join(flags)).encode()).hexdigest()[:12]
        src = self.workdir / f"kernel_{digest}.cpp"
        exe = self.workdir / f"kernel_{digest}"
        if not exe.exists():
            src.write_text(program)
            proc = subprocess.run([GXX, *flags, "-I", str(HERE), str(src), "-o", str(exe)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"g++ failed on {src}:\n{proc.stderr[-6000:]}")
            self.compile_warnings = proc.stderr
        self.binary = exe
        return exe

    def run(self, kernel: KernelSpec, inputs: Sequence[Arg], output_shape: Sequence[int], output_dtype: mx.Dtype,
            template: Sequence[Tuple[str, object]], grid: Tuple[int, int, int],
            threadgroup: Tuple[int, int, int], seed: int = 0, timeout: float = 600) -> np.ndarray:
        """Run the kernel over ``grid``; returns the output as float32 numpy.

        Raises:
            RuntimeError: the executable failed (sanitizer report, divergent barrier, deadlock).
        """
        kname = self.add(kernel, inputs, [output_dtype], template)
        if self.binary is None:
            self.compile()
        self._runs += 1
        job_dir = self.workdir / f"job{self._runs}"
        job_dir.mkdir(exist_ok=True)
        lines = [f"config {self.variants[kname].index}", "grid %d %d %d" % tuple(grid),
                 "threadgroup %d %d %d" % tuple(threadgroup), f"seed {seed}"]
        for k, x in enumerate(inputs):
            if isinstance(x, ArrayArg):
                path = job_dir / f"in{k}.bin"
                x.buffer.tofile(path)
                lines.append(" ".join(str(v) for v in (
                    "array", path, x.buffer.nbytes, x.buffer.itemsize, x.offset, len(x.shape),
                    *x.shape, *x.strides)))
            elif isinstance(x, float):
                lines.append(f"float {x!r}")
            else:
                lines.append(f"int {int(x)}")
        n_out = int(np.prod(output_shape))
        itemsize = 4 if output_dtype == mx.float32 else 2
        out_path = job_dir / "out.bin"
        lines.append(f"output {out_path} {n_out * itemsize}")
        job = job_dir / "job.txt"
        job.write_text("\n".join(lines) + "\n")
        # A preloaded library (the suite preloads OpenBLAS) would come before the sanitizer runtime.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        proc = subprocess.run([str(self.binary), str(job)], capture_output=True, text=True,
                              timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"emulated kernel failed (exit {proc.returncode}):\n{proc.stderr[:4000]}")
        raw = np.fromfile(out_path, dtype={mx.float32: np.float32, mx.float16: np.float16,
                                           mx.bfloat16: np.uint16}[output_dtype])
        if output_dtype == mx.bfloat16:
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        shutil.rmtree(job_dir, ignore_errors=True)
        return raw.astype(np.float32).reshape(tuple(output_shape))
