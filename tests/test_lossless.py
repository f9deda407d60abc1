"""Greedy output with a drafter equals mlx-lm's plain greedy output, token for token.

Every family of the fixtures (``FAMILIES`` in conftest.py) runs 200 tokens at block
sizes 4 and 16 with a random drafter and drafters forcing full and partial
acceptance, on targets whose greedy output is varied, and the mutation test shows
that the lossless check fails when rollback does nothing. The families in
``FULL_MATRIX`` also run block size 2 and drafts that are all rejected (the random
drafter already rejects nearly everything elsewhere); ``QUANTIZED`` ones run 4-bit.
DSpark drafters (both fixtures: with a Markov and confidence head, and DeepSeek's DFlash
block7 without) run on every qwen3 family, Gemma 4's on gemma4_text, at several block sizes
and with drafts forced half right (and fail with rollback broken); a drafter with a reduced
draft vocabulary on every family.
"""

import mlx.core as mx
import pytest

from dflash_mlx import TargetAdapter, bind_drafter, generate_step
from dflash_mlx.bench.simulate import SimulatedDrafter
from dflash_mlx.drafter.vocab import set_draft_vocab
from conftest import FAMILIES, ScriptedDrafter, assert_varied, format_drafter, mlx_lm_greedy, tiny_drafter, tiny_target

PROMPT = [1, 17, 33, 2, 9, 100, 42]
N = 200
FULL_MATRIX = ("llama", "llama-sliding", "qwen3", "qwen3_5")
QUANTIZED = ("llama", "llama-sliding", "qwen3", "qwen3_5", "gpt_oss")
BLOCKS = [(f, b) for f in sorted(FAMILIES) for b in (2, 4, 16) if b != 2 or f in FULL_MATRIX]


def _run(target, drafter, n=N, prompt=PROMPT, **kw):
    prompt = mx.array(prompt, dtype=mx.int32)
    return [t for s in generate_step(prompt, target, drafter, max_tokens=n, **kw) for t in s.tokens]


_REFERENCES = {}


@pytest.fixture
def reference(family):
    """(model, adapter, mlx-lm greedy tokens) of the family's tiny target, built once."""
    if family not in _REFERENCES:
        model, target = tiny_target(family)
        _REFERENCES[family] = model, target, mlx_lm_greedy(model, PROMPT, N + 16)
    return _REFERENCES[family]


def test_reference_output_is_varied(reference):
    _, _, ref = reference
    assert_varied(ref[:N])


@pytest.mark.parametrize("family,block_size", BLOCKS)
def test_random_drafter_is_lossless(reference, block_size):
    _, target, ref = reference
    assert _run(target, tiny_drafter(target), block_size=block_size) == ref[:N]


@pytest.mark.parametrize("family,block_size,kind", [
    (f, b, k) for f, b in BLOCKS for k in ("full", "partial", "none") if k != "none" or f in FULL_MATRIX
])
def test_scripted_drafter_is_lossless(reference, block_size, kind):
    # full: every draft accepted; partial: half of each block; none: all rejected.
    _, target, ref = reference
    correct = {"full": block_size - 1, "partial": max(1, block_size // 2), "none": 0}[kind]
    drafter = ScriptedDrafter(PROMPT + ref, correct=correct, block_size=block_size, vocab=256)
    assert _run(target, drafter, block_size=block_size) == ref[:N]


DSPARK = [(f, fmt) for f in sorted(FAMILIES) if f.startswith("qwen3") for fmt in ("dspark", "dflash-block7")]


@pytest.mark.parametrize("family,fmt", DSPARK + [("gemma4_text", "gemma4-dspark")])
def test_dspark_drafters_are_lossless(reference, fmt, monkeypatch):
    """DSpark drafters (Gemma 4's on the Gemma 4 target, its copies of the embedding and capped head shared); with
    drafts half right, the check fails once rollback is a no-op."""
    _, target, ref = reference
    drafter = format_drafter(target, fmt)
    assert "embed_tokens" not in drafter and "lm_head" not in drafter
    for block_size in (2, 8):
        assert _run(target, drafter, block_size=block_size) == ref[:N], block_size
    half_right = SimulatedDrafter(drafter, PROMPT + ref, accept=3, vocab_size=target.vocab_size)
    assert _run(target, half_right, block_size=8) == ref[:N]
    monkeypatch.setattr(TargetAdapter, "rollback", lambda self, cache, n: None)
    half_right.reset(PROMPT + ref, 3)
    assert _run(target, half_right, block_size=8) != ref[:N]


def test_reduced_draft_vocabulary_is_lossless(reference):
    """Drafts among the reference's own tokens only (FR-Spec's reduced head, over each family's head)."""
    _, target, ref = reference
    drafter = tiny_drafter(target)
    set_draft_vocab(drafter, mx.array(sorted(set(ref[:N]))))
    bind_drafter(drafter, target)
    for block_size in (4, 16):
        assert _run(target, drafter, block_size=block_size) == ref[:N], block_size


def test_plain_engine_matches_mlx_lm(reference):
    _, target, ref = reference
    assert _run(target, None) == ref[:N]


def test_prefill_in_several_chunks_is_lossless(reference):
    # A 7-token prompt in chunks of 2 is prefilled in 4 forwards.
    _, target, ref = reference
    drafter = ScriptedDrafter(PROMPT + ref, correct=3, block_size=8, vocab=256)
    assert _run(target, drafter, n=60, block_size=8, prefill_step_size=2) == ref[:60]


def test_broken_rollback_is_caught(reference, monkeypatch):
    # The lossless check has power: with rollback a no-op it must fail.
    _, target, ref = reference
    monkeypatch.setattr(TargetAdapter, "rollback", lambda self, cache, n: None)
    drafter = ScriptedDrafter(PROMPT + ref, correct=2, block_size=4, vocab=256, check_anchor=False)
    assert _run(target, drafter, block_size=4) != ref[:N]


def test_untied_and_tied_heads_both_covered():
    # llama fixtures are untied, qwen3 tied: check each really is what it claims.
    llama_model, _ = tiny_target("llama")
    qwen_model, _ = tiny_target("qwen3")
    assert hasattr(llama_model, "lm_head") and not hasattr(qwen_model, "lm_head")


@pytest.mark.parametrize("family", QUANTIZED)
@pytest.mark.parametrize("block_size", [4, 16])
def test_quantized_target_is_lossless(family, block_size):
    # 4-bit target: the drafter borrows a QuantizedEmbedding (and QuantizedLinear head when untied).
    import mlx.nn as nn

    model, target = tiny_target(family)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    assert type(target.inner.embed_tokens).__name__ == "QuantizedEmbedding"
    ref = mlx_lm_greedy(model, PROMPT, N)
    assert_varied(ref)
    assert _run(target, tiny_drafter(target), block_size=block_size) == ref
    sequence = PROMPT + ref + [0] * 16
    assert _run(target, ScriptedDrafter(sequence, correct=block_size // 2, block_size=block_size, vocab=256),
                block_size=block_size) == ref


@pytest.mark.parametrize("family", QUANTIZED)
def test_quantized_verify_rows_against_single_steps(family, record_property):
    # A 16-row verify may use other quantized matmul kernels than 1-row decoding
    # (spec section 5). Measure how often its logits differ from the 1-row steps' in
    # the last bits, and require that the greedy token never does on this backend.
    import mlx.nn as nn

    model, target = tiny_target(family)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    tokens = PROMPT + mlx_lm_greedy(model, PROMPT, 5 * 16)
    block_cache, step_cache = target.make_cache(16), target.make_cache(16)
    target(mx.array([PROMPT]), block_cache)
    target(mx.array([PROMPT]), step_cache)
    rows = differ = flips = 0
    worst = 0.0
    for start in range(len(PROMPT), len(tokens) - 15, 16):
        block = tokens[start : start + 16]
        h, _ = target(mx.array([block]), block_cache)
        verify = target.lm_head(h)[0]
        steps = mx.concatenate([target.lm_head(target(mx.array([[t]]), step_cache)[0])[0] for t in block])
        rows += 16
        differ += int(mx.any(verify != steps, axis=-1).sum().item())
        flips += int((mx.argmax(verify, -1) != mx.argmax(steps, -1)).sum().item())
        worst = max(worst, mx.abs(verify - steps).max().item())
    record_property("verify_rows_differing_in_last_bits", f"{differ}/{rows}")
    print(f"{family} 4-bit: {differ}/{rows} verify rows differ from 1-row steps (largest logit "
          f"difference {worst:.2e}); {flips} greedy flips")
    assert flips == 0, f"{flips}/{rows} greedy tokens differ between a 16-row verify and 1-row steps"


class ScriptedLookup:
    """A prompt lookup that copies the target's known continuation (``want`` after ``prompt``), its
    drafts in turn all right, right for half of them, and wrong from the first: the decoder's copy path
    (verify, acceptance, rollback) as any real match would drive it."""

    def __init__(self, tokens, prompt, want, vocab=256):
        self.want, self.vocab, self.at, self.steps = want, vocab, len(tokens) - len(prompt), 0

    def extend(self, tokens):
        self.at += len(tokens)

    def propose(self, limit=15):
        k = min(limit, 6, len(self.want) - self.at)
        drafts = list(self.want[self.at:self.at + k])
        right = (len(drafts), len(drafts) // 2, 0)[self.steps % 3]
        return drafts[:right] + [(t + 1) % self.vocab for t in drafts[right:right + 1]] + drafts[right + 1:]

    def observe(self, accepted):
        self.steps += 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompt_lookup_is_lossless(reference, family, monkeypatch):
    """Copied drafts (prompt lookup), alone and beside a drafter, accepted whole, in part and not at all:
    mlx-lm's greedy output; with rollback a no-op the output differs."""
    from dflash_mlx.decode import batch
    from dflash_mlx.stats import GenerationStats

    _, target, ref = reference
    monkeypatch.setattr(batch, "PromptLookup", lambda tokens: ScriptedLookup(tokens, PROMPT, ref))
    for drafter in (None, tiny_drafter(target)):
        stats = GenerationStats(block_size=16 if drafter else 1)
        assert _run(target, drafter, n=96, prompt_lookup=True, stats=stats) == ref[:96]
        assert 0 < stats.copies_accepted < stats.copied, (stats.copies_accepted, stats.copied)
    monkeypatch.setattr(TargetAdapter, "rollback", lambda self, cache, n: None)
    assert _run(target, None, n=96, prompt_lookup=True) != ref[:96]


def test_prompt_lookup_copies_what_followed_the_longest_earlier_match():
    """The continuation of the latest earlier occurrence of the tail (the longest n-gram first), never the
    tail itself; a copy that keeps nothing pauses lookup for 2, then 4 steps; one that keeps any resets."""
    from dflash_mlx.decode.lookup import PromptLookup

    lookup = PromptLookup([5, 1, 2, 3, 9, 9, 7, 1, 2, 3, 4, 8])
    assert lookup.propose() == []  # 3, 4, 8 never occurred before
    lookup.extend([1, 2, 3])  # 1 2 3 ran on to 9 first and to 4 later: the latest
    assert lookup.propose() == [4, 8, 1, 2, 3] and lookup.propose(2) == [4, 8]
    lookup.extend([9, 9, 7, 1, 2, 3, 4])  # 2 3 4 and 1 2 3 4: the longer match wins, what followed it
    assert lookup.propose(3) == [8, 1, 2]
    lookup.observe(0)
    assert lookup.propose() == []
    lookup.extend([8]), lookup.extend([1])
    assert lookup.propose(3) == [2, 3, 9]  # 1 2 3 4 8 1 occurred once, then 2 3 9 9 ... (paused for 2 steps)
    lookup.observe(0), lookup.extend([2]), lookup.extend([3]), lookup.extend([9])
    assert lookup.propose() == []  # paused for 4 now
