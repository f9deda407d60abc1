"""The streamed text of a generation is the tokenizer's decode of its ids, whatever runs the ids
arrive in, whenever those ids decode to valid UTF-8 (a property test of :class:`TextStream`, the
one place generate, chat and serve turn tokens into text).

Two tokenizers: stories260K's SentencePiece with byte fallback (examples/stories260K/tok512.model,
converted as scripts/convert/llama2c.py does) and a small byte-level BPE (GPT-2's byte alphabet)
trained here with the `tokenizers` library. Ids come from encodings of text with emoji, CJK,
accents and code, and at random (kept when they decode to valid UTF-8)."""

from __future__ import annotations

import importlib.util
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402

from conftest import ROOT  # noqa: E402
from dflash_mlx.decode.stopping import TextStream  # noqa: E402

SAMPLES = [
    "Once upon a time, a café in Zürich served crème brûlée.",
    "naïve façade, jalapeño, smörgåsbord, Ærøskøbing, Øresund, ŝi ĉiam",
    "東京は雨です。我喜欢编程。한국어 텍스트. 日本語とEnglish",
    "emoji: 🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽 ❤️ 🧑🏿‍💻",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # ≠ ≤ → λ\n\tif x != 0: pass",
    "for (int i = 0; i < n; ++i) { s += a[i]; }  // C++ «quoted» “curly” — dash…",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "  leading spaces,   runs   of   spaces\n\n\nnewlines\r\n and tabs\t\t.",
]


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """stories260K's SentencePiece tokenizer (byte fallback), through mlx-lm as the CLI loads it."""
    pytest.importorskip("sentencepiece")
    from mlx_lm.utils import load_tokenizer

    spec = importlib.util.spec_from_file_location("llama2c", ROOT / "scripts" / "convert" / "llama2c.py")
    llama2c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama2c)
    model = ROOT / "examples" / "stories260K" / "tok512.model"
    out = tmp_path_factory.mktemp("spm")
    llama2c.write_tokenizer(model, out, llama2c.read_special_tokens(model, 512), 512)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE of 600 ids (GPT-2's 256-byte alphabet and merges learnt on SAMPLES), through mlx-lm."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(SAMPLES * 4, trainer)
    out = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            clean_up_tokenization_spaces=False).save_pretrained(out)
    return load_tokenizer(out)


def texts():
    """Text to encode: a sample, a slice of one, or samples' pieces joined with arbitrary text."""
    pieces = st.sampled_from(SAMPLES)
    sliced = st.tuples(pieces, st.integers(0, 80), st.integers(1, 80)).map(lambda t: t[0][t[1]:t[1] + t[2]])
    alphabet = st.characters(codec="utf-8", categories=("L", "M", "N", "P", "S", "Zs"))
    mixed = st.lists(st.one_of(pieces, sliced, st.text(alphabet, max_size=8)), min_size=1, max_size=4)
    return st.one_of(pieces, sliced, mixed.map("".join))


def encoded_ids(tokenizer):
    return texts().map(lambda t: list(tokenizer.encode(t, add_special_tokens=False)))


def random_ids(tokenizer):
    return st.lists(st.integers(0, len(tokenizer.get_vocab()) - 1), min_size=1, max_size=40)


def runs(n: int):
    """Run lengths (as verify steps commit tokens: 1 to a block) covering ``n`` ids."""
    return st.lists(st.integers(1, 16), min_size=n, max_size=n)


def streamed(tokenizer, ids, lengths) -> str:
    """The text a TextStream shows for ``ids`` arriving in runs of ``lengths``, the last one final."""
    stream, out, i = TextStream(tokenizer), [], 0
    for n in lengths:
        run, i = ids[i:i + n], i + n
        out.append(stream.add(run, final=i >= len(ids)))
        if i >= len(ids):
            break
    return "".join(out)


def check(tokenizer, data, ids):
    whole = tokenizer.decode(ids)
    assume(ids and "\ufffd" not in whole)  # ids that decode to valid UTF-8
    assert streamed(tokenizer, ids, data.draw(runs(len(ids)), label="runs")) == whole
    assert streamed(tokenizer, ids, [1] * len(ids)) == whole  # one token at a time


SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much,
                                           HealthCheck.too_slow])


@pytest.mark.parametrize("draw", [encoded_ids, random_ids], ids=["encoded-text", "random-ids"])
@pytest.mark.parametrize("name", ["spm_tokenizer", "bpe_tokenizer"])
@SETTINGS
@given(data=st.data())
def test_streamed_text_is_the_decode(request, name, draw, data):
    """Ids of encoded text, and random ids that decode to valid UTF-8."""
    tokenizer = request.getfixturevalue(name)
    check(tokenizer, data, data.draw(draw(tokenizer), label="ids"))


def test_the_samples_need_byte_fallback_and_multibyte_merges(spm_tokenizer, bpe_tokenizer):
    """The tokenizers split characters into bytes here (else the property would test little)."""
    spm = spm_tokenizer.encode(SAMPLES[3], add_special_tokens=False)
    assert any(spm_tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in spm)  # byte-fallback pieces
    bpe = bpe_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(bpe) > 1 and bpe_tokenizer.decode(bpe[:1]).endswith("\ufffd")  # a character split over ids


@pytest.mark.parametrize("name", ["spm_tokenizer", "bpe_tokenizer"])
def test_a_step_decodes_once_but_where_a_character_is_split(request, name):
    """The last run's decode is the next run's left context: one decode a step, plus one where the left context
    moves by a window or a run ends inside a character (counted here, as a step's cost)."""
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(" ".join(SAMPLES[:2]), add_special_tokens=False)  # Latin text: few split characters
    calls = []

    class Counting:
        def decode(self, run):
            calls.append(len(run))
            return tokenizer.decode(run)

    stream = TextStream(Counting())
    text = "".join(stream.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == tokenizer.decode(ids)
    assert len(calls) <= len(ids) + len(ids) // 8 + 8, (len(calls), len(ids))
    assert max(calls) <= 2 * 8 + 1 + 4
