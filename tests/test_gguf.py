"""`dflash convert --model FILE.gguf`: tiny GGUF files written here (the `gguf` library's writer, with
llama.cpp's tensor names, Q/K permutation and tokenizer keys) converted to mlx-lm folders, checked against
the models and tokenizers they were written from; bad files refused in one line with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_lm_load

from dflash_mlx import make_adapter
from conftest import ROOT, assert_varied, dflash, mlx_lm_greedy, tiny_target
from gguf_files import TEXTS, byte_level_vocab, gguf_name, write_gguf
from dflash_mlx.pair.gguf import convert_gguf, parse_gguf
from dflash_mlx.pair.gguf_tokenizer import merges_from_scores

@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A tiny random llama (Hugging Face rotary order) and its GGUF file (float32, byte-level vocabulary)."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=2, seed=3)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tokens, merges=merges)
    return model, path


def test_llama_gguf_converts_to_the_same_model(llama_gguf, tmp_path):
    """Greedy output of the converted folder equals the model the file was written from, token for
    token: names, the rotary order (rope_traditional) and the tied/untied head are read right."""
    model, path = llama_gguf
    convert_gguf(path, tmp_path / "out")
    converted, tokenizer = mlx_lm_load(str(tmp_path / "out"))
    prompt = [5, 17, 42, 99, 7]
    want = mlx_lm_greedy(model, prompt, 40)
    assert_varied(want, 10)
    assert mlx_lm_greedy(converted, prompt, 40) == want
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is False
    assert "quantization" not in config


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    """A Llama 3.1-style file (no scaling keys; llama.cpp's ``rope_freqs`` tensor, computed here by hand): the
    folder's config holds mlx-lm's llama3 ``rope_scaling`` and its logits are the model's, far from the same model
    without the scaling (factors no llama3 scaling gives: test_bad_gguf_files_one_line_nothing_written)."""
    import mlx_lm.models.llama as llama

    _, tokens, merges = byte_level_vocab()
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=len(tokens), rope_theta=500000.0)
    mx.random.seed(6)
    model = llama.Model(llama.ModelArgs.from_dict({**args, "rope_scaling": scaling}))
    plain = llama.Model(llama.ModelArgs.from_dict(args))
    plain.update(model.parameters())
    path = write_gguf(tmp_path / "l3.gguf", model, tokens, merges=merges, pre="llama-bpe")
    convert_gguf(path, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"] == scaling
    converted, _ = mlx_lm_load(str(tmp_path / "out"))
    x = mx.array([list(range(3, 300))])
    want = model(x)
    assert mx.abs(converted(x) - want).max().item() < 1e-4 < mx.abs(plain(x) - want).max().item()


def test_qwen3_gguf_keeps_the_rotary_order(tmp_path):
    """qwen3 files are not permuted by llama.cpp: converted with rope_traditional false, same output."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("qwen3", vocab=len(tokens), hidden=64, layers=2, seed=4)
    path = write_gguf(tmp_path / "q.gguf", model, tokens, arch="qwen3", merges=merges, pre="qwen2")
    convert_gguf(path, tmp_path / "out")
    converted, _ = mlx_lm_load(str(tmp_path / "out"))
    prompt = [9, 8, 70, 11]
    want = mlx_lm_greedy(model, prompt, 30)
    assert_varied(want, 8)
    assert mlx_lm_greedy(converted, prompt, 30) == want


def test_phi3_gguf_converts_to_the_same_model(tmp_path):
    """A Phi-3 file as llama.cpp writes it (fused attn_qkv and ffn_up, not permuted, untied): same greedy output
    as the model it came from; the folder is a phi3 target this project decodes."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("phi3", vocab=len(tokens), hidden=64, layers=2, seed=4)
    path = write_gguf(tmp_path / "p.gguf", model, tokens, arch="phi3", merges=merges)
    convert_gguf(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "phi3" and config["architectures"] == ["Phi3ForCausalLM"]
    converted, _ = mlx_lm_load(str(tmp_path / "out"))
    assert make_adapter(converted).num_layers == 2  # a target family here
    prompt = [9, 8, 70, 11]
    want = mlx_lm_greedy(model, prompt, 30)
    assert_varied(want, 8)
    assert mlx_lm_greedy(converted, prompt, 30) == want


def test_gemma3_gguf_converts_to_the_same_model(tmp_path):
    """A Gemma 3 file as llama.cpp writes it (its norm names, norms stored as 1 + w, tied embeddings, every 6th
    layer global, linear RoPE scaling as in the 4B and larger): same greedy output as the model it came from,
    past the sliding window."""
    from mlx_lm.models import gemma3_text
    from mlx.utils import tree_flatten, tree_unflatten

    _, tokens, merges = byte_level_vocab()
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokens),
                                 query_pre_attn_scalar=16, sliding_window=8, rope_scaling={"type": "linear",
                                                                                          "factor": 8.0})
    mx.random.seed(5)
    model = gemma3_text.Model(args)
    scale = {"norm": 0.3, "embed": 0.02}  # a small embedding, or a tied random Gemma echoes its input token
    model.update(tree_unflatten([(n, mx.random.normal(p.shape) * next((v for k, v in scale.items() if k in n), 1.5))
                                 for n, p in tree_flatten(model.parameters())]))
    model.sanitize({})  # tied, as Gemma is: mlx-lm drops lm_head where a checkpoint has none
    path = write_gguf(tmp_path / "g.gguf", model, tokens, arch="gemma3", merges=merges, tied=True)
    convert_gguf(path, tmp_path / "out")
    converted, _ = mlx_lm_load(str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window_pattern"] == 6
    assert config["rope_scaling"] == {"type": "linear", "factor": 8.0} and config["rope_traditional"] is False
    prompt = [9, 8, 70, 11, 30, 41]
    want = mlx_lm_greedy(model, prompt, 30)
    assert_varied(want, 8)
    assert mlx_lm_greedy(converted, prompt, 30) == want


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_quantized_gguf_stays_quantized_or_dequantizes(tmp_path, qtype, bits):
    """Q8_0/Q4_0/Q4_1 stay MLX-quantized (group 32), load in mlx-lm and compute in float16 (the norms'
    F32 weights cast); --dtype float16 gives the same logits as the quantized folder."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=2, seed=3)
    path = write_gguf(tmp_path / "q.gguf", model, tokens, qtype=qtype, merges=merges)
    convert_gguf(path, tmp_path / "q")
    convert_gguf(path, tmp_path / "f", dtype="float16")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    quantized, _ = mlx_lm_load(str(tmp_path / "q"))
    dense, _ = mlx_lm_load(str(tmp_path / "f"))
    x = mx.array([[5, 17, 42, 99, 7]])
    a, b = quantized(x), dense(x)
    assert a.dtype == b.dtype == mx.float16
    assert (mx.linalg.norm((a - b).astype(mx.float32)) / mx.linalg.norm(b.astype(mx.float32))).item() < 1e-2


def test_large_matrices_are_read_a_few_rows_at_a_time(tmp_path, monkeypatch):
    """Matrices dequantized (and quantized again) in parts of 7 rows give what one part gives: every
    tensor exactly gguf.quants.dequantize's with --dtype float32, and the same quantized folder."""
    from gguf.quants import dequantize

    import dflash_mlx.pair.gguf as reader

    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=256, layers=1, seed=6)
    path = write_gguf(tmp_path / "k.gguf", model, tokens, qtype="Q4_K", merges=merges,
                      tensor_types={"output.weight": "Q6_K"})
    convert_gguf(path, tmp_path / "whole")
    monkeypatch.setattr(reader, "CHUNK_ROWS", 7)
    convert_gguf(path, tmp_path / "parts")
    convert_gguf(path, tmp_path / "f", dtype="float32")
    got = mx.load(str(tmp_path / "f" / "model.safetensors"))
    names = {gguf_name(n): n for n in got}
    for t in gguf.GGUFReader(str(path)).tensors:
        assert np.array_equal(np.array(got[names[t.name]]), dequantize(t.data, t.tensor_type)), t.name
    whole, parts = (mx.load(str(tmp_path / d / "model.safetensors")) for d in ("whole", "parts"))
    assert whole.keys() == parts.keys() and any(n.endswith(".scales") for n in whole)
    assert all(mx.array_equal(whole[n], parts[n]).item() for n in whole)


@pytest.mark.parametrize("qtype,tied", [("Q4_K", False), ("Q6_K", True), ("Q5_0", False), ("Q2_K", True),
                                        ("Q3_K", False), ("Q5_K", False), ("Q5_1", True), ("IQ4_NL", False),
                                        ("BF16", False)])
def test_every_type_reads_as_the_gguf_package_dequantizes_it(tmp_path, qtype, tied):
    """Matrices of K-quants, 5-bit, I-quant or BF16, beside a Q6_K output matrix and a Q8_0 one as
    llama-quantize mixes them, embeddings tied or not: converted with --dtype float32, each tensor is
    exactly what gguf.quants.dequantize makes of it (BF16 widened by hand); kept quantized, the types whose
    groups of 32 are affine keep their weights (up to float16 scales: 2**-9 of the largest, where quantizing
    again at 4 bits errs by some 2**-5), the others are quantized again by MLX (8 bits for Q6_K), and the
    folder computes in float16, near the float folder."""
    from gguf.quants import dequantize
    from mlx_lm.models.cache import make_prompt_cache

    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=256, layers=1, seed=5)
    types = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q8_0"}
    path = write_gguf(tmp_path / "k.gguf", model, tokens, qtype=qtype, merges=merges, tied=tied, tensor_types=types)
    convert_gguf(path, tmp_path / "f", dtype="float32")
    got = mx.load(str(tmp_path / "f" / "model.safetensors"))
    names = {gguf_name(n): n for n in got}
    for t in gguf.GGUFReader(str(path)).tensors:
        want = ((t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32) if qtype == "BF16"
                and t.tensor_type.name == "BF16" else dequantize(t.data, t.tensor_type))
        assert np.array_equal(np.array(got[names[t.name]]), want), t.name
    info = convert_gguf(path, tmp_path / "q")
    exact = qtype in ("Q4_K", "Q5_K", "Q5_0", "Q5_1")
    assert info["gguf_types"][qtype] >= 5 and info["requantized"] == (0 if exact or qtype == "BF16" else 7) + (not tied)
    quant = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert quant.get("model.layers.0.self_attn.v_proj", quant)["bits"] == 8
    assert quant.get("lm_head", {"bits": 8})["bits"] == 8 and "lm_head" not in quant or not tied
    assert 4 < info["bits_per_weight"] < (17 if qtype == "BF16" else 9) and info["dtype"] == "float16"
    kept = mx.load(str(tmp_path / "q" / "model.safetensors"))
    for name, want in got.items():
        if f"{name[:-7]}.scales" in kept:
            q = quant.get(name[:-7]) or {"group_size": quant["group_size"], "bits": quant["bits"]}
            w = mx.dequantize(kept[name], kept[f"{name[:-7]}.scales"], kept[f"{name[:-7]}.biases"], **q)
            assert (mx.linalg.norm(w - want) / mx.linalg.norm(want)).item() < (0.01 if q["bits"] == 8 else 0.1)
            if q["group_size"] == 32:  # carried over, not quantized again: Q8_0 and the exact types
                assert mx.abs(w - want).max().item() <= 2 ** -9 * mx.abs(want).max().item(), name
    quantized, _ = mlx_lm_load(str(tmp_path / "q"))
    cache = make_prompt_cache(quantized)
    logits = quantized(mx.array([[5, 17, 42, 99, 7]]), cache=cache)
    assert logits.dtype == cache[0].keys.dtype == mx.float16 and mx.all(mx.isfinite(logits)).item()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_types_carried_over_match_mlx_own_reader(tmp_path, qtype):
    """Q4_0, Q4_1 and Q8_0 matrices in a file MLX cannot read (a Q5_0 output matrix beside them), carried over
    through the gguf package, hold exactly the codes, scales and biases MLX's own reader makes of them."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=1, seed=7)
    for name, types in (("mlx", {}), ("package", {"output.weight": "Q5_0"})):
        write_gguf(tmp_path / f"{name}.gguf", model, tokens, qtype=qtype, merges=merges, tensor_types=types)
        info = convert_gguf(tmp_path / f"{name}.gguf", tmp_path / name)
        assert info["requantized"] == 0 and (name == "mlx") == (info["method"] == "GGUF read by MLX")
    mlx, package = (mx.load(str(tmp_path / d / "model.safetensors")) for d in ("mlx", "package"))
    carried = [n for n in mlx if n.endswith((".weight", ".scales", ".biases")) and "lm_head" not in n]
    assert sum(n.endswith(".scales") for n in carried) == 8 and all(
        mx.array_equal(mlx[n], package[n]).item() for n in carried)


def test_end_of_turn_and_message_ids_stop_generation(tmp_path):
    """tokenizer.ggml.eot_token_id and eom_token_id (Llama 3's <|eot_id|>, <|eom_id|>) join the EOS id as
    stop tokens; a file with only an EOS id keeps it alone."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=1, seed=3)
    ends = {"tokenizer.ggml.eot_token_id": 1, "tokenizer.ggml.eom_token_id": 0}
    convert_gguf(write_gguf(tmp_path / "e.gguf", model, tokens, merges=merges, extra=ends), tmp_path / "e")
    convert_gguf(write_gguf(tmp_path / "o.gguf", model, tokens, merges=merges), tmp_path / "o")
    assert set(mlx_lm_load(str(tmp_path / "e"))[1].eos_token_ids) == {2, 1, 0}
    assert set(mlx_lm_load(str(tmp_path / "o"))[1].eos_token_ids) == {2}


def test_byte_level_tokenizer_matches_its_vocabulary(llama_gguf, tmp_path):
    """The converted tokenizer encodes and decodes as the tokenizer the vocabulary came from, on text with
    emoji, CJK, accents and code; control tokens stay whole; the chat template is kept."""
    from transformers import AutoTokenizer

    tok, _, _ = byte_level_vocab()
    _, path = llama_gguf
    convert_gguf(path, tmp_path / "out")
    converted = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in TEXTS:
        ids = converted.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text).ids
        assert converted.decode(ids) == text
    assert converted.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert converted.eos_token == "<|im_end|>" and converted.bos_token == "<|im_start|>"
    chat = converted.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("pre, add_bos, added", [("llama-bpe", None, True), ("llama3", False, False),
                                                 ("smollm", None, False), ("qwen2", True, True)])
def test_bos_is_added_where_llama_cpp_adds_it(tmp_path, pre, add_bos, added):
    """llama.cpp (llama-vocab.cpp) adds BOS to a byte-level vocabulary's encodings by default for the
    Llama 3 pre-tokenizers (llama-bpe, llama3, llama-v3, falcon3), not for the others;
    tokenizer.ggml.add_bos_token, where the file has it, decides."""
    from transformers import AutoTokenizer

    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=32, layers=1)
    extra = {} if add_bos is None else {"tokenizer.ggml.add_bos_token": add_bos}
    convert_gguf(write_gguf(tmp_path / "t.gguf", model, tokens, merges=merges, pre=pre, extra=extra), tmp_path / "o")
    ids = AutoTokenizer.from_pretrained(str(tmp_path / "o")).encode("hello world")
    assert (ids[0] == 1) is added and ids.count(1) == int(added), ids  # BOS is id 1 (write_gguf)


def test_sentencepiece_tokenizer_matches_sentencepiece(tmp_path):
    """A SentencePiece vocabulary as llama.cpp stores it (pieces, scores, types; no merges), here the
    shipped stories260K tokenizer: the same ids as the sentencepiece library, BOS added, text decoded back."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(ROOT / "examples" / "stories260K" / "tok512.model"))
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=1, seed=3)
    path = write_gguf(tmp_path / "sp.gguf", model, tokens, kind="llama", pre=None, scores=scores)
    convert_gguf(path, tmp_path / "out")
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    # This model collapses runs of spaces (SentencePiece's remove_extra_whitespaces), which llama.cpp does
    # not do and a GGUF cannot say: texts with single spaces only.
    for text in TEXTS[:2] + ["def f(x):\n return {'a': x ** 2} # code", "Once upon a time, there was Lily."]:
        ids = converted.encode(text)
        assert ids == [1] + sp.encode(text), text
        assert converted.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizers_match_transformers_gguf_converter(llama_gguf, tmp_path, kind):
    """The converted tokenizer gives the ids of transformers' own GGUF tokenizer converter (which imports
    without PyTorch) on text with emoji, CJK, runs of spaces and code: a byte-level vocabulary and a
    SentencePiece one (the shipped stories260K pieces and scores, no merges). One difference, where
    llama.cpp is followed: a SentencePiece text that starts with spaces still gets the prefix space
    (llama-vocab.cpp adds it to every text after a special token or at the start, as SentencePiece's
    add_dummy_prefix does); transformers' Metaspace adds none there."""
    import sentencepiece as spm
    from gguf import GGUFReader
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")  # where it imports

    path = llama_gguf[1]
    if kind == "llama":
        sp = spm.SentencePieceProcessor(model_file=str(ROOT / "examples" / "stories260K" / "tok512.model"))
        tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        model, _ = tiny_target("llama", vocab=len(tokens), hidden=32, layers=1)
        path = write_gguf(tmp_path / "sp.gguf", model, tokens, kind="llama", pre=None,
                          scores=[sp.get_score(i) for i in range(len(tokens))])
    meta = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items()}
    fields = {name: meta[f"tokenizer.{key}"] for key, name in mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    reference = PreTrainedTokenizerFast(tokenizer_object=mapping.convert_gguf_tokenizer("llama", fields)[0])
    convert_gguf(path, tmp_path / "out")
    converted = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in TEXTS + ["a    b        c", "  two leading spaces"]:
        want = " " + text if kind == "llama" and text.startswith(" ") else text  # llama.cpp's prefix space
        assert converted.encode(text, add_special_tokens=False) == reference.encode(want, add_special_tokens=False)


def test_merges_from_scores_rank_by_the_made_piece():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = merges_from_scores(tokens, [0, 0, 0, -1.0, -2.0, -0.5])
    assert merges == [("a", "bc"), ("ab", "c"), ("a", "b"), ("b", "c")]


@pytest.mark.parametrize("alignment", [None, 64])
def test_parse_gguf_reads_what_gguf_reader_reads(tmp_path, alignment):
    """parse_gguf, the reader of the conversion, against the gguf package's GGUFReader on a file its GGUFWriter
    wrote: every key-value (each scalar type, strings, arrays of numbers, booleans and strings; as ``contents()``
    gives them) and every tensor (name, type, shape, bytes: float, quantized, 1-D to 3-D) the same."""
    import mmap

    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for i, kind in enumerate(("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")):
        getattr(w, f"add_{kind}")(f"test.{kind}", i if kind.startswith("u") else -i - 1)
    w.add_float32("test.float32", 0.1), w.add_float64("test.float64", 0.1), w.add_bool("test.bool", True)
    w.add_string("test.string", "café ▁ 世界"), w.add_string("test.empty", "")
    w.add_array("test.ints", [3, -1, 7]), w.add_array("test.floats", [0.5, -2.25]), w.add_array("test.none", [])
    w.add_array("test.bools", [True, False]), w.add_token_list(["<s>", "▁a", "", "🙂"] * 50)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.normal(size=(4, 8)).astype(np.float32))
    w.add_tensor("b.weight", rng.normal(size=(3,)).astype(np.float16))
    w.add_tensor("c.weight", rng.normal(size=(2, 3, 32)).astype(np.float32))
    q8, q4k = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K
    w.add_tensor("d.weight", gguf.quants.quantize(rng.normal(size=(5, 64)).astype(np.float32), q8), raw_dtype=q8)
    w.add_tensor("e.weight", rng.integers(0, 256, (2, 144), dtype=np.uint8), raw_dtype=q4k)  # 2 x 256 weights
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    reader = gguf.GGUFReader(str(path))
    with open(path, "rb") as f:
        metadata, tensors = parse_gguf(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    assert metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert metadata["test.string"] == "café ▁ 世界" and metadata["test.ints"] == [3, -1, 7]
    assert [(t.name, t.tensor_type, list(t.shape)) for t in tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.data.dtype == np.uint8 and ours.data.tobytes() == theirs.data.tobytes(), ours.name
        assert ours.data.shape[:-1] == theirs.data.shape[:-1], ours.name  # rows as the package dequantizes them


def cut(path: Path, size: int, out: Path) -> Path:
    out.write_bytes(path.read_bytes()[:size])
    return out


def test_bad_gguf_files_one_line_nothing_written(llama_gguf, tmp_path):
    """Truncated, foreign, an unreadable tensor type, an unsupported architecture, tokenizer or RoPE: one line
    naming the file and the reason, exit 1, no output folder."""
    _, path = llama_gguf
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=1, seed=3)
    size = path.stat().st_size
    k_quant = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(k_quant), "llama")
    w.add_tokenizer_model("gpt2"), w.add_token_list(tokens), w.add_token_merges(merges)  # read before the tensors
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 40), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf")
    cases = {
        "truncated": (cut(path, size // 2, tmp_path / "half.gguf"), "truncated or corrupt"),
        "header cut": (cut(path, 200, tmp_path / "head.gguf"), "truncated or corrupt"),
        "foreign": (foreign, "not a GGUF file"),
        "Q8_1": (k_quant, "'blk.0.attn_q.weight' is Q8_1, a GGUF type the gguf package cannot read"),
        "architecture": (write_gguf(tmp_path / "arch.gguf", model, tokens, arch="gpt2", merges=merges),
                         "general.architecture 'gpt2' is not supported"),
        "pre-tokenizer": (write_gguf(tmp_path / "pre.gguf", model, tokens, merges=merges, pre="mystery"),
                          "tokenizer.ggml.pre 'mystery' is not supported"),
        "tokenizer": (write_gguf(tmp_path / "bert.gguf", model, tokens, merges=merges, kind="bert"),
                      "tokenizer.ggml.model 'bert' is not supported"),
        "missing": (tmp_path / "absent.gguf", "GGUF file not found"),
        "rope_freqs": (write_gguf(tmp_path / "rope.gguf", model, tokens, merges=merges, extra_tensors={
            "rope_freqs.weight": np.linspace(1, 8, 8, dtype=np.float32)}),
            "tensor 'rope_freqs.weight' is not Llama 3's RoPE scaling"),
        "Phi-3 128K": (write_gguf(tmp_path / "phi.gguf", tiny_target("phi3", vocab=len(tokens), hidden=64, layers=1)[0],
                                  tokens, arch="phi3", merges=merges, extra_tensors={
                                      "rope_factors_long.weight": np.ones(8, dtype=np.float32)}),
                       "tensor 'rope_factors_long.weight' is not one of a"),
    }
    for name, (bad, reason) in cases.items():
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        r = dflash("convert", "--model", str(bad), "--out", str(out), text=True)
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 1, (name, r.stderr)
        assert len(lines) == 1 and str(bad) in lines[0] and reason in lines[0], (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert not out.exists() and not any(p.name.startswith(f".{out.name}") for p in tmp_path.iterdir()), name


def test_convert_cli_target_alone(llama_gguf, tmp_path):
    """`dflash convert --model FILE.gguf --out DIR` (no drafter) writes an mlx-lm folder that `dflash
    generate` runs; -q on a GGUF and --draft-q-bits without a drafter are refused."""
    model, path = llama_gguf
    out = tmp_path / "smol"
    r = dflash("convert", "--model", str(path), "--out", str(out), "--dtype", "float32", text=True)
    assert r.returncode == 0, r.stderr
    assert "an mlx-lm llama model, float32" in r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    r = dflash("generate", "--model", str(out), "-p", "hello", "-m", "8", "--json", text=True)
    assert r.returncode == 0, r.stderr
    for args, flag in ((["-q"], "-q/--quantize"), (["--draft-q-bits", "8"], "--draft-q-bits")):
        r = dflash("convert", "--model", str(path), "--out", str(tmp_path / "x"), *args, text=True)
        assert r.returncode == 1 and flag in r.stderr and not (tmp_path / "x").exists()


def test_a_conversion_cached_by_an_older_version_is_converted_anew(llama_gguf, tmp_path, monkeypatch, capsys):
    """The cache folder names the conversion's version: a folder an older conversion left is not reused but
    removed once the new one is written; other files' conversions and names not of that pattern stay."""
    import dflash_mlx.pair.gguf as reader

    _, path = llama_gguf
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    older = reader.gguf_folder(str(path))
    others = [older.with_name(older.name.replace("-v", "-vx")), older.with_name("other" + older.name)]
    for folder in others:
        shutil.copytree(older, folder)
    monkeypatch.setattr(reader, "CONVERSION", reader.CONVERSION + 1)
    newer = reader.gguf_folder(str(path))
    assert newer != older and (newer / "config.json").is_file() and not older.exists()
    assert all((folder / "config.json").is_file() for folder in others)
    err = capsys.readouterr().err
    assert err.count("converting once into") == 2 and f"removed {older}, an older version's conversion" in err


def test_an_older_conversion_that_cannot_be_removed_is_a_warning(llama_gguf, tmp_path, monkeypatch, capsys):
    """Removing an older version's folder fails (permissions): a warning, the new conversion is used."""
    import dflash_mlx.pair.gguf as reader

    _, path = llama_gguf
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    older = reader.gguf_folder(str(path))
    monkeypatch.setattr(reader, "CONVERSION", reader.CONVERSION + 1)

    def refuse(folder, *a, **k):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(reader.shutil, "rmtree", refuse)
    newer = reader.gguf_folder(str(path))
    assert (newer / "config.json").is_file() and (older / "config.json").is_file()
    assert f"warning: cannot remove {older}, an older version's conversion" in capsys.readouterr().err


def test_generate_takes_a_gguf_file_or_an_ollama_name_and_converts_once(llama_gguf, tmp_path):
    """`--model FILE.GGUF` (any case) converts once into the cache and reuses it after (a cache that cannot
    be written: a warning, converted for the run); `ollama:NAME:TAG` finds the GGUF blob through a store's
    manifest (OLLAMA_MODELS), same text; a missing model, a folder named .gguf and a missing file are one
    line each, exit 1."""
    import hashlib
    import os
    import shutil

    _, path = llama_gguf
    upper = shutil.copy(path, tmp_path / "Tiny.GGUF")
    store = tmp_path / "ollama"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    shutil.copy(path, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q4"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache"), "OLLAMA_MODELS": str(store)}
    runs = [dflash("generate", "--model", model, "-p", "hello", "-m", "12", "--quiet", env=env, text=True)
            for model in (str(upper), str(upper), "ollama:tiny:q4")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert "converting once into" in runs[0].stderr and "converted earlier into" in runs[1].stderr
    assert "converting once into" in runs[2].stderr and runs[0].stdout == runs[1].stdout == runs[2].stdout
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
    (tmp_path / "a-file").write_text("not a folder")  # a cache that cannot be written: this run only
    r = dflash("generate", "--model", str(upper), "-p", "hello", "-m", "12", "--quiet", text=True,
               env={**env, "DFLASH_CACHE_DIR": str(tmp_path / "a-file")})
    assert r.returncode == 0 and r.stdout == runs[0].stdout and "warning: cannot keep the conversion" in r.stderr
    (tmp_path / "dir.gguf").mkdir()
    for model, reason in (("ollama:absent", "`ollama pull absent` first"), (str(tmp_path / "dir.gguf"), "a folder"),
                          (str(tmp_path / "gone.gguf"), "GGUF file not found")):
        r = dflash("generate", "--model", model, "-p", "hello", env=env, text=True)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and reason in r.stderr, r.stderr


def test_force_replaces_a_converted_model_folder_and_nobody_elses(llama_gguf, tmp_path):
    """--force replaces a folder an earlier convert wrote, but not a model folder of someone else's (a
    config.json, as every Hugging Face download has, and the user's own notes): refused, nothing lost."""
    _, path = llama_gguf
    theirs = tmp_path / "hfmodel"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"model_type": "llama"}')
    (theirs / "my_notes.txt").write_text("precious")
    r = dflash("convert", "--model", str(path), "--out", str(theirs), "--force", text=True)
    assert r.returncode == 1 and str(theirs) in r.stderr and "did not write" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and (theirs / "my_notes.txt").read_text() == "precious"
    ours = tmp_path / "smol"
    for _ in range(2):  # the second run replaces the first's folder
        r = dflash("convert", "--model", str(path), "--out", str(ours), "--dtype", "float32", "--force", text=True)
        assert r.returncode == 0, r.stderr
    assert (ours / "config.json").is_file()


def test_chat_self_prompts_are_user_turns_in_the_template(llama_gguf, tmp_path):
    """`dflash data --self-prompt-style chat` on a model with a chat template: the target writes user turns
    where its template starts one; each prompt is that turn in the template, ready for the reply, and each
    finished response ends with the template's end-of-turn token."""
    import numpy as np

    _, path = llama_gguf
    convert_gguf(path, tmp_path / "model")
    data = tmp_path / "data"
    r = dflash("data", "--model", str(tmp_path / "model"), "--self-prompts", "6", "--self-prompt-style", "chat",
               "--self-prompt-tokens", "24", "--max-tokens", "8", "--out", str(data), text=True)
    assert r.returncode == 0, r.stderr
    shard = np.load(data / "shard_00000.npz")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    starts, lengths = shard["response_starts"], shard["lengths"]
    assert len(starts) >= 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i, start in enumerate(starts):
        prompt = tok.decode(shard["tokens"][offsets[i]:offsets[i] + start].tolist())
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert len(prompt[len("<|im_start|>user\n"):-len("<|im_end|>\n<|im_start|>assistant\n")].split()) >= 3


def test_gguf_target_with_a_drafter_converts_and_validates(llama_gguf, tmp_path):
    """`dflash convert --model FILE.gguf --draft-model D`: target/ from the GGUF file, drafter/, dflash.json,
    and the validation table (the drafter checked against the converted target)."""
    from conftest import tiny_drafter_args
    from dflash_mlx import DFlashDrafter, make_adapter, save_drafter
    from dflash_mlx.pair.convert import convert

    model, path = llama_gguf
    mx.random.seed(1)
    drafter = DFlashDrafter(tiny_drafter_args(make_adapter(model), block_size=4))
    mx.eval(drafter.parameters())
    save_drafter(drafter, tmp_path / "drafter")
    result = convert(str(path), str(tmp_path / "drafter"), tmp_path / "pair", dtype="float32")
    assert {"target", "drafter", "dflash.json"} <= {p.name for p in (tmp_path / "pair").iterdir()}
    assert result.manifest["target"]["method"] == "GGUF dequantized by the gguf package"
    assert all(c.ok is not False for c in result.checks) and len(result.checks) >= 5


def test_a_drafter_on_a_gguf_target_is_lossless_as_on_its_folder(stories, tmp_path):
    """stories260K written by the `gguf` package as llama.cpp stores it (F32, its SentencePiece vocabulary)
    and the shipped drafter: `dflash generate --model FILE.gguf` gives the greedy text of mlx-lm on the
    folder the file was written from, with the same acceptance as on that folder; a drafter made for
    another target is refused in one line."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(ROOT / "examples" / "stories260K" / "tok512.model"))
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    model, _ = mlx_lm_load(str(stories))
    path = write_gguf(tmp_path / "stories.gguf", model, tokens, kind="llama", pre=None, scores=scores, tied=True)
    drafter = str(ROOT / "examples" / "stories260K" / "drafter")
    flags = ("--draft-model", drafter, "-p", "Once upon a time", "-m", "64", "--block-size", "8",
             "--ignore-chat-template", "--prompt-lookup", "off", "--json")
    done = [dflash("generate", "--model", m, *flags, text=True) for m in (str(stories), str(path))]
    assert all(r.returncode == 0 for r in done), [r.stderr for r in done]
    runs = [json.loads(r.stdout) for r in done]
    want = mlx_lm_greedy(model, [1] + sp.encode("Once upon a time"), 64)
    assert_varied(want, 20)
    assert runs[0]["token_ids"] == runs[1]["token_ids"] == want
    assert runs[0]["acceptance_histogram"] == runs[1]["acceptance_histogram"] and runs[1]["tau"] > 3
    other = write_gguf(tmp_path / "other.gguf", tiny_target("llama", vocab=len(tokens), hidden=32, layers=2)[0],
                       tokens, kind="llama", pre=None, scores=scores)
    r = dflash("generate", "--model", str(other), *flags, text=True)
    last = r.stderr.strip().splitlines()[-1]  # after the line saying where the file converts
    assert r.returncode == 1 and "Traceback" not in r.stderr and last.startswith("error: "), r.stderr
    assert drafter in last and "trained for another target" in last, r.stderr


def test_a_qwen3_pair_is_lossless_from_its_folder_and_from_its_gguf(tmp_path):
    """A tiny qwen3 target saved as a folder and as a GGUF (by the `gguf` package), one drafter: the same
    greedy tokens as mlx-lm on the model both came from, and the same acceptance, from either. The drafter
    runs as it is (its own drafts read the target's context features) and scripted half right (rollback
    every step)."""
    from dflash_mlx import generate_step
    from dflash_mlx.bench.simulate import SimulatedDrafter
    from dflash_mlx.stats import GenerationStats
    from conftest import tiny_drafter

    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("qwen3", vocab=len(tokens), hidden=64, layers=4, seed=7)
    path = write_gguf(tmp_path / "q.gguf", model, tokens, arch="qwen3", merges=merges, pre="qwen2")
    convert_gguf(path, tmp_path / "out")
    targets = [make_adapter(model), make_adapter(mlx_lm_load(str(tmp_path / "out"))[0])]
    prompt = [9, 8, 70, 11, 30]
    want = mlx_lm_greedy(model, prompt, 80)
    assert_varied(want, 20)
    drafter = tiny_drafter(targets[0], block_size=8)

    def run(target, draft):
        stats = GenerationStats(block_size=8)
        out = [t for s in generate_step(mx.array(prompt), target, draft, max_tokens=80, block_size=8,
                                        stats=stats) for t in s.tokens]
        return out, stats.histogram

    for draft in (drafter, SimulatedDrafter(drafter, prompt + want, accept=3, vocab_size=len(tokens))):
        (folder, seen), (from_gguf, seen_gguf) = (run(t, draft) for t in targets)
        assert folder == from_gguf == want and seen == seen_gguf, (seen, seen_gguf)
    assert max(seen) == 4  # the scripted drafter: 3 drafts and the bonus token per step


def test_a_cut_file_is_one_line_at_any_offset(tmp_path):
    """A K-quant file (read tensor by tensor by the gguf package) cut anywhere, header, metadata or tensor
    data: one line naming the file, exit 1, nothing written."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=256, layers=1, seed=5)
    path = write_gguf(tmp_path / "k.gguf", model, tokens, qtype="Q4_K", merges=merges)
    size = path.stat().st_size
    for at in (3, 24, size // 10, size // 3, size - 1000, size - 1):
        bad = cut(path, at, tmp_path / f"cut{at}.gguf")
        out = tmp_path / f"out{at}"
        r = dflash("convert", "--model", str(bad), "--out", str(out), text=True)
        lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode == 1 and len(lines) == 1 and str(bad) in lines[0], (at, r.stderr)
        assert "Traceback" not in r.stderr and not out.exists(), at
