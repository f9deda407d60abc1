"""The quick-start pair that ships in examples/stories260K: the target converts, the drafter
loads against it, decoding with it is lossless, and it reaches the tau its README documents."""

import importlib.util
import json
import re

import mlx.core as mx
import pytest

from dflash_mlx import generate_step, load
from conftest import ROOT, assert_varied, mlx_lm_greedy

PAIR = ROOT / "examples" / "stories260K"
OPENINGS = ["Once upon a time", "The old fisherman looked at the sea", "Mia found a tiny key under her bed",
            "A brave knight rode to the castle"]


def _documented_tau() -> float:
    """The floor examples/stories260K/README.md states: 'tau at least X at block size 16'."""
    found = re.search(r"tau at least (\d+(?:\.\d+)?)\s+at\s+block\s+size\s+16", (PAIR / "README.md").read_text())
    assert found, "examples/stories260K/README.md states no tau floor"
    return float(found.group(1))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("llama2c", ROOT / "scripts" / "convert" / "llama2c.py")
    llama2c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama2c)
    folder = llama2c.convert_llama2c(PAIR / "stories260K.bin", PAIR / "tok512.model",
                                     tmp_path_factory.mktemp("shipped-target"))
    return load(str(folder), str(PAIR / "drafter"))


def test_the_drafter_records_how_it_was_made():
    made = json.loads((PAIR / "drafter" / "made_by.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", made["commit"])
    assert made["command"].startswith("scripts/train_stories260k.sh")


def test_shipped_pair_is_lossless_and_reaches_its_tau(shipped):
    floor = _documented_tau()
    steps = committed = 0
    for opening in OPENINGS:
        prompt = shipped.tokenizer.encode(opening)
        ref = mlx_lm_greedy(shipped.model, prompt, 128)
        assert_varied(ref)
        out = []
        for step in generate_step(mx.array(prompt), shipped.target, shipped.drafter, max_tokens=128, block_size=16):
            out += step.tokens
            if step.accepted is not None:
                steps += 1
                committed += step.accepted + 1
        assert out == ref, opening
    assert committed / steps >= floor, f"tau {committed / steps:.2f} below the documented {floor}"
