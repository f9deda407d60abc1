"""`dflash convert --model FILE.gguf`: tiny GGUF files written here (the `gguf` library's writer, with
llama.cpp's tensor names, Q/K permutation and tokenizer keys) converted to mlx-lm folders, checked against
the models and tokenizers they were written from; bad files refused in one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_lm_load

from conftest import ROOT, assert_varied, dflash, mlx_lm_greedy, tiny_target
from dflash_mlx.pair.gguf import convert_gguf
from dflash_mlx.pair.gguf_tokenizer import merges_from_scores

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
TEXTS = ["Hello world! Once upon a time, 1234 apples.",
         "Emoji 🙂🚀 and CJK 世界你好, accents: café, naïve, Ærøskøbing, Zürich.",
         "def f(x):\n    return {'a': x ** 2}  # code\n\tif x != 0: print(f\"{x:>4}\")",
         "  leading spaces\n\nnew lines \r\n end"]


def gguf_name(name: str) -> str:
    """llama.cpp's tensor name for an mlx-lm one."""
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{index}.{LAYER_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of llama's Q/K rows: Hugging Face's half-split rotary order to interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab():
    """A byte-level BPE (tokens in GPT-2's byte alphabet, merges) trained on a little text, with the
    SmolLM split (digits alone, then GPT-2's regex), and the `tokenizers` tokenizer it came from."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    data = json.loads(tok.to_str())["model"]
    tokens = sorted(data["vocab"], key=data["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["merges"]]
    return tok, tokens, merges


def write_gguf(path: Path, model, tokens, *, arch: str = "llama", qtype: str = "F32", merges=None,
               scores=None, kind: str = "gpt2", pre: str = "smollm", extra=None) -> Path:
    """``model`` (a tiny mlx-lm llama/qwen3) as llama.cpp writes it: its tensors renamed, llama's Q and K
    permuted, 2-D weights in ``qtype``, norms in F32, and a tokenizer's metadata."""
    args = model.args
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(4096)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model(kind)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    types = [3 if t.startswith("<|") or t in ("<s>", "</s>", "<unk>") else 1 for t in tokens]
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        x = np.array(value.astype(mx.float32))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
            x = interleave(x, heads)
        kind_of = gguf.GGMLQuantizationType[qtype] if x.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind_of == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), x)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(x, kind_of), raw_dtype=kind_of)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_quantized_gguf_stays_quantized_or_dequantizes(tmp_path, qtype, bits):
    """Q8_0/Q4_0/Q4_1 stay MLX-quantized (group 32) and load in mlx-lm; --dtype float32 gives the same
    logits as the quantized folder."""
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=2, seed=3)
    path = write_gguf(tmp_path / "q.gguf", model, tokens, qtype=qtype, merges=merges)
    convert_gguf(path, tmp_path / "q")
    convert_gguf(path, tmp_path / "f", dtype="float32")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    quantized, _ = mlx_lm_load(str(tmp_path / "q"))
    dense, _ = mlx_lm_load(str(tmp_path / "f"))
    x = mx.array([[5, 17, 42, 99, 7]])
    a, b = quantized(x), dense(x)
    assert mx.allclose(a.astype(mx.float32), b, atol=2e-2, rtol=2e-2).item()


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


def test_merges_from_scores_rank_by_the_made_piece():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = merges_from_scores(tokens, [0, 0, 0, -1.0, -2.0, -0.5])
    assert merges == [("a", "bc"), ("ab", "c"), ("a", "b"), ("b", "c")]


def cut(path: Path, size: int, out: Path) -> Path:
    out.write_bytes(path.read_bytes()[:size])
    return out


def test_bad_gguf_files_one_line_nothing_written(llama_gguf, tmp_path):
    """Truncated, foreign, an unreadable tensor type, an unsupported architecture or tokenizer: one line
    naming the file and the reason, exit 1, no output folder."""
    _, path = llama_gguf
    _, tokens, merges = byte_level_vocab()
    model, _ = tiny_target("llama", vocab=len(tokens), hidden=64, layers=1, seed=3)
    size = path.stat().st_size
    k_quant = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(k_quant), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 144), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf")
    cases = {
        "truncated": (cut(path, size // 2, tmp_path / "half.gguf"), "truncated or corrupt"),
        "header cut": (cut(path, 200, tmp_path / "head.gguf"), "truncated or corrupt"),
        "foreign": (foreign, "not a GGUF file"),
        "K-quant": (k_quant, "'blk.0.attn_q.weight' is Q4_K, a GGUF type MLX cannot read"),
        "architecture": (write_gguf(tmp_path / "arch.gguf", model, tokens, arch="gpt2", merges=merges),
                         "general.architecture 'gpt2' is not supported"),
        "pre-tokenizer": (write_gguf(tmp_path / "pre.gguf", model, tokens, merges=merges, pre="mystery"),
                          "tokenizer.ggml.pre 'mystery' is not supported"),
        "tokenizer": (write_gguf(tmp_path / "bert.gguf", model, tokens, merges=merges, kind="bert"),
                      "tokenizer.ggml.model 'bert' is not supported"),
        "missing": (tmp_path / "absent.gguf", "GGUF file not found"),
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
