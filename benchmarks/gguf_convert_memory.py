"""Peak memory of ``dflash convert --model FILE.gguf`` on a Q4_K_M-like file of about 260 MB.

The file: a llama (hidden 1024, 24 layers, MLP 3072, 16 query / 8 KV heads of 64, vocabulary 49,152,
untied ``output.weight``) written by ``tests/gguf_files.py``: 2-D weights random Q4_K blocks, except Q6_K
for ``token_embd``, ``output`` and the ``attn_v``/``ffn_down`` of the layers llama.cpp's Q4_K_M widens
(its ``use_more_bits``), norms F32, and a working byte-level tokenizer padded to the vocabulary.

    python benchmarks/gguf_convert_memory.py --work /tmp/gguf-mem

converts it twice, each in a fresh child process, ``python -m dflash_mlx.cli.main convert --model FILE
--out OUT --no-validate --force`` (quantized again at 4 bits, Q6_K at 8) and the same with ``--dtype
float16``, and takes each child's peak RSS (GNU time's ``%M``, Linux only: the GGUF file's pages that the
reader's memory map touched count in it), and that of a child that only imports mlx and dflash_mlx
(the baseline). Prints one JSON object (MB: 10^6 bytes); the requirement checked: peak under twice the
output folder's size. ``--file FILE`` measures a file of your own instead (a real Q4_K_M download).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_files import byte_level_vocab, gguf_name, write_gguf  # noqa: E402

MB = 1e6


def widened(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def build(path: Path, layers: int, vocab: int) -> Path:
    """The GGUF file: an mlx-lm llama's names and shapes, no float weights held (every tensor a broadcast
    1.0; the K-quant blocks are random bytes, :func:`gguf_files.blocks`)."""
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=1024, num_hidden_layers=layers, intermediate_size=3072,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                     vocab_size=vocab, tie_word_embeddings=False)
    shapes = Model(args).parameters()  # lazy: nothing is initialized
    params = tree_map(lambda p: mx.broadcast_to(mx.array(1.0), p.shape), shapes)
    _, tokens, merges = byte_level_vocab()
    tokens += [f"<pad{i}>" for i in range(vocab - len(tokens))]
    types = {gguf_name(n): "Q4_K" for n, _ in tree_flatten(params)}
    types.update({"token_embd.weight": "Q6_K", "output.weight": "Q6_K"})
    types.update({f"blk.{i}.{m}.weight": "Q6_K" for i in range(layers) if widened(i, layers)
                  for m in ("attn_v", "ffn_down")})
    model = SimpleNamespace(args=args, parameters=lambda: params)
    return write_gguf(path, model, tokens, merges=merges, tensor_types=types)


def peak_rss(*args: str) -> int:
    """Peak RSS in bytes of ``python ARGS`` (its stdout sent to stderr), run by GNU time: a child forked from
    this process would start with this process's high-water mark (Linux keeps it across exec)."""
    with tempfile.NamedTemporaryFile("r") as report:
        subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report.name, sys.executable, *args],
                       stdout=sys.stderr, check=True)
        return int(report.read().split()[-1]) * 1024  # kilobytes


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/gguf-mem"),
                        help="Where the file and the outputs go.")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--file", type=Path, help="Measure this GGUF file instead of writing the Q4_K_M-like one.")
    a = parser.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    path = a.file or build(a.work / f"llama-{a.layers}l-q4_k_m.gguf", a.layers, a.vocab)
    from gguf import GGUFReader

    kinds = [t.tensor_type.name for t in GGUFReader(str(path)).tensors]
    baseline = peak_rss("-c", "import mlx.core, dflash_mlx")
    result = {"file_mb": round(path.stat().st_size / MB, 1),
              "tensor_types": {k: kinds.count(k) for k in sorted(set(kinds))},
              "baseline_rss_mb": round(baseline / MB, 1), "runs": {}}
    for name, extra in (("4-bit", []), ("float16", ["--dtype", "float16"])):
        out = a.work / f"out-{name}"
        peak = peak_rss("-m", "dflash_mlx.cli.main", "convert", "--model", str(path), "--out", str(out),
                        "--no-validate", "--force", *extra)
        size = folder_bytes(out)
        result["runs"][name] = {"output_mb": round(size / MB, 1), "peak_rss_mb": round(peak / MB, 1),
                                "peak_minus_baseline_mb": round((peak - baseline) / MB, 1),
                                "peak_over_output": round(peak / size, 2),
                                "peak_minus_baseline_over_output": round((peak - baseline) / size, 2)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
