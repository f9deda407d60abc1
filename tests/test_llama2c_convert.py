"""Tests for scripts/convert/llama2c.py on the real stories260K checkpoint."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "convert" / "llama2c.py"
MODEL_DIR = REPO.parent / "shared" / "models" / "stories260K"
CHECKPOINT = MODEL_DIR / "stories260K.bin"
TOKENIZER = MODEL_DIR / "tok512.model"
PROMPT = "Once upon a time"
EXPECTED = (
    ", there was a little girl named Lily. She loved to play outside in the park."
    " One day, she saw a big, red ball."
)
# stories260K's header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len.
HEADER = (64, 172, 5, 8, 4, 512, 512)

needs_model = pytest.mark.skipif(
    not (CHECKPOINT.is_file() and TOKENIZER.is_file()),
    reason=f"stories260K not found under {MODEL_DIR} (shared data absent)",
)


def _load_script():
    """Imports the converter script as a module from its file path."""
    spec = importlib.util.spec_from_file_location("llama2c_convert", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llama2c = _load_script()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Converts stories260K once and loads it with mlx-lm."""
    mlx_lm = pytest.importorskip("mlx_lm")
    out = tmp_path_factory.mktemp("stories260K-mlx")
    llama2c.convert_llama2c(CHECKPOINT, TOKENIZER, out)
    model, tokenizer = mlx_lm.load(str(out))
    return out, model, tokenizer


@needs_model
def test_writes_llama_config(converted):
    out, _, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 512
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()


@needs_model
def test_greedy_decoding_matches_llama2c(converted):
    from mlx_lm import generate

    _, model, tokenizer = converted
    text = generate(model, tokenizer, PROMPT, max_tokens=40)
    assert text.startswith(EXPECTED), text


@needs_model
def test_tokenizer_specials_and_no_chat_template(converted):
    _, _, tokenizer = converted
    assert tokenizer.encode(PROMPT)[0] == 1
    assert 2 in tokenizer.eos_token_ids
    assert not tokenizer.has_chat_template


@needs_model
def test_streaming_detokenizer_round_trips(converted):
    _, _, tokenizer = converted
    # Generated ids never include BOS, which the detokenizer would print as "<s>".
    text = PROMPT + EXPECTED + "\n  Two  spaces, é 🙂 42."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer
    detok.reset()
    for token in ids:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == tokenizer.decode(ids) == text


def test_truncated_checkpoint_names_the_file(tmp_path):
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(np.array(HEADER, "<i4").tobytes() + b"\0" * 1000)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        llama2c.convert_llama2c(bad, tmp_path / "tok.model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint_names_the_file(tmp_path):
    missing = tmp_path / "missing.bin"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        llama2c.convert_llama2c(missing, tmp_path / "tok.model", tmp_path / "out")


def test_cli_prints_one_line_error(tmp_path, capsys):
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(b"not a checkpoint at all, just some bytes")
    argv = ["--checkpoint", str(bad), "--tokenizer", str(TOKENIZER)]
    assert llama2c.main([*argv, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(bad) in err
    assert err.count("\n") == 1
