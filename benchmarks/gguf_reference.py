#!/usr/bin/env python3
"""A real GGUF file converted by ``dflash convert --dtype float32`` against a reference conversion made here
without the project's code: every tensor dequantized whole by ``gguf.quants.dequantize``, renamed by the table
below (llama.cpp's ``gguf-py`` tensor names), Gemma's norms taken back from llama.cpp's stored ``1 + w``, and
an mlx-lm ``config.json`` written from the metadata by hand. Both folders decode the same prompt ids greedily
with mlx-lm's own ``generate_step``; the token ids must be equal. Then the folder ``dflash convert`` keeps
quantized (no ``--dtype``) is loaded and its logits' and KV cache's dtypes reported with its text, and its
weights compared with the reference's (relative error). The
tokenizer is checked against transformers' GGUF tokenizer converter (it imports without PyTorch) on
:data:`TEXTS`.

    python benchmarks/gguf_reference.py --file gemma-3-270m-q4_k_m.gguf --work /tmp/gguf-ref

Architectures: ``gemma3`` (the file this was written for: Gemma 3 270M, Q4_K_M) and ``qwen2``/``qwen3``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
NORMS = {"gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"},
         "qwen2": {"ffn_norm": "post_attention_layernorm"}, "qwen3": {"ffn_norm": "post_attention_layernorm"}}
PROMPT = "The capital of France is"
TEXTS = [PROMPT, "Hello world! Once upon a time, 1234 apples.",
         "Emoji \U0001f642\U0001f680 and CJK \u4e16\u754c\u4f60\u597d, accents: caf\u00e9, na\u00efve, Z\u00fcrich.",
         "def f(x):\n    return {'a': x ** 2}  # code\n\tif x != 0: print(f\"{x:>4}\")",
         "  leading spaces\n\nnew lines \r\n end", "a    b        c", "internationalization and tokenization"]


def reference(path: Path, out: Path) -> None:
    """``out``: the file as a float32 mlx-lm folder, by the `gguf` package alone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    names = {**LAYER, **NORMS[arch]}
    weights = {}
    for t in reader.tensors:
        x = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape([int(d) for d in t.shape[::-1]])
        base, suffix = t.name.rsplit(".", 1)
        if arch == "gemma3" and base.endswith("norm"):
            x = x - 1  # convert_hf_to_gguf.py stores Gemma3RMSNorm's weight w as 1 + w
        parts = base.split(".")
        name = (f"model.layers.{parts[1]}.{names[parts[2]]}" if parts[0] == "blk" else
                {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[base])
        weights[f"{name}.{suffix}"] = mx.array(x)
    k = lambda key: meta[f"{arch}.{key}"]  # noqa: E731
    config = {"model_type": "gemma3_text" if arch == "gemma3" else arch, "hidden_size": k("embedding_length"),
              "num_hidden_layers": k("block_count"), "intermediate_size": k("feed_forward_length"),
              "num_attention_heads": k("attention.head_count"), "num_key_value_heads": k("attention.head_count_kv"),
              "head_dim": k("attention.key_length"), "rms_norm_eps": k("attention.layer_norm_rms_epsilon"),
              "rope_theta": k("rope.freq_base"), "vocab_size": weights["model.embed_tokens.weight"].shape[0],
              "max_position_embeddings": k("context_length"), "tie_word_embeddings": "lm_head.weight" not in weights}
    if arch == "gemma3":  # llama.cpp's llama-model.cpp for LLM_ARCH_GEMMA3 (not the 27B)
        config.update(sliding_window=k("attention.sliding_window"), sliding_window_pattern=6,
                      rope_local_base_freq=10000.0, query_pre_attn_scalar=k("attention.key_length"))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def tokenizer_check(path: Path, folder: Path) -> dict:
    """Texts of :data:`TEXTS` whose ids (no special tokens) equal transformers' converter's for ``path``."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items()}
    fields = {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    ref = PreTrainedTokenizerFast(tokenizer_object=convert_gguf_tokenizer(meta["general.architecture"], fields)[0])
    ours = AutoTokenizer.from_pretrained(str(folder))
    same = [ref.encode(t, add_special_tokens=False) == ours.encode(t, add_special_tokens=False) for t in TEXTS]
    return {"texts": len(TEXTS), "equal": sum(same)}


def greedy(folder: Path, ids: list, n: int):
    """(``n`` greedy token ids, the dtype of the logits, the dtype of the first layer's KV cache)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    cache = make_prompt_cache(model)
    out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, prompt_cache=cache)]
    logits = model(mx.array([ids]))
    return out, str(logits.dtype), str(cache[0].state[0].dtype)


def weights_error(kept: Path, reference: Path) -> dict:
    """Each quantized matrix of ``kept`` dequantized by MLX against the reference's: the relative error
    (Frobenius) over all of them, the worst matrix's, and the bits of each."""
    weights, ref = mx.load(str(kept / "model.safetensors")), mx.load(str(reference / "model.safetensors"))
    quant = json.loads((kept / "config.json").read_text())["quantization"]
    err = total = worst = 0.0
    bits = {}
    for name in (n[: -len(".scales")] for n in weights if n.endswith(".scales")):
        q = quant.get(name, quant)
        w = mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], weights[f"{name}.biases"],
                          group_size=q["group_size"], bits=q["bits"]).astype(mx.float32)
        want = ref[f"{name}.weight"].astype(mx.float32)
        e, t = mx.sum((w - want) ** 2).item(), mx.sum(want ** 2).item()
        err, total, worst = err + e, total + t, max(worst, (e / t) ** 0.5)
        bits[q["bits"]] = bits.get(q["bits"], 0) + 1
    return {"relative_error": round((err / total) ** 0.5, 5), "worst_matrix": round(worst, 5), "matrices_by_bits": bits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, required=True, help="The GGUF file.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gguf-ref"), help="Where the folders go.")
    parser.add_argument("-n", type=int, default=32, help="Greedy tokens compared.")
    a = parser.parse_args()
    dflash = [sys.executable, "-m", "dflash_mlx.cli.main", "convert", "--model", str(a.file), "--no-validate",
              "--force"]
    subprocess.run(dflash + ["--out", str(a.work / "float32"), "--dtype", "float32"], check=True, stdout=sys.stderr)
    subprocess.run(dflash + ["--out", str(a.work / "kept")], check=True, stdout=sys.stderr)
    shutil.rmtree(a.work / "reference", ignore_errors=True)
    reference(a.file, a.work / "reference")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(a.work / "float32"))
    ids = tokenizer.encode(PROMPT)
    want, _, _ = greedy(a.work / "reference", ids, a.n)
    got, _, _ = greedy(a.work / "float32", ids, a.n)
    kept, logits, kv = greedy(a.work / "kept", ids, a.n)
    print(json.dumps({"file": a.file.name, "tokenizer_vs_transformers": tokenizer_check(a.file, a.work / "float32"),
                      "prompt": PROMPT, "prompt_ids": ids, "reference": want,
                      "float32_equal": got == want, "float32_first_difference": next(
                          (i for i, (x, y) in enumerate(zip(got, want)) if x != y), None),
                      "reference_text": tokenizer.decode(want), "kept_quantized_text": tokenizer.decode(kept),
                      "kept_quantized_logits_dtype": logits, "kept_quantized_kv_dtype": kv,
                      "kept_quantized_weights_vs_reference": weights_error(a.work / "kept", a.work / "reference")},
                     indent=2))


if __name__ == "__main__":
    main()
