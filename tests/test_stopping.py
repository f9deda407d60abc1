"""Stop tokens, stop strings and the token budget cut a block where they occur."""

import mlx.core as mx
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.decode.stopping import StopCondition, held_back, text_before_stop
from conftest import ScriptedDrafter

# A toy tokenizer: token i decodes to LETTERS[i]; token 9 decodes to two characters.
LETTERS = "abcdefghi"


def decode(ids):
    return "".join("xy" if i == 9 else LETTERS[i] for i in ids)


def test_budget_and_stop_tokens():
    stop = StopCondition(5, stop_token_ids=[8])
    assert stop.cut([1, 2, 3]) == ([1, 2, 3], None)
    assert stop.cut([4, 5, 6]) == ([4, 5], "length")
    stop = StopCondition(10, stop_token_ids=[8])
    assert stop.cut([1, 8, 3]) == ([1], "stop") and stop.emitted == 1


def test_stop_string_inside_a_block_and_across_blocks():
    stop = StopCondition(20, stop_strings=["cd"], decode=decode)
    assert stop.cut([0, 2, 3, 4]) == ([0, 2, 3], "stop")  # 'a c d' completes at the 3rd token
    stop = StopCondition(20, stop_strings=["dxy"], decode=decode)
    assert stop.cut([0, 1, 2, 3]) == ([0, 1, 2, 3], None)
    assert stop.cut([9, 5]) == ([9], "stop")  # 'd' was committed a block earlier


def test_the_first_stop_wins():
    stop = StopCondition(4, stop_token_ids=[7], stop_strings=["bc"], decode=decode)
    assert stop.cut([1, 2, 7, 4]) == ([1, 2], "stop")
    stop = StopCondition(2, stop_strings=["bc"], decode=decode)
    assert stop.cut([1, 2]) == ([1, 2], "stop")  # at the budget too: the stop is the reason


def test_bad_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopCondition(5, stop_strings=["a"])
    with pytest.raises(ValueError):
        StopCondition(5, stop_strings=[""], decode=decode)


def test_text_helpers():
    assert text_before_stop("hello world", ["wor", "lo"]) == 3
    assert text_before_stop("hello", ["x"]) is None
    assert held_back("hello wo", ["world"]) == 2
    assert held_back("hello", ["world"]) == 0
    assert held_back("a\n", ["\n\n", "b"]) == 1


def test_stream_stops_before_the_stop_string_and_settles_caches(stories):
    from dflash_mlx import load

    pair = load(str(stories))
    ids = pair.tokenizer.encode("Once upon a time")
    full = "".join(r.text for r in stream_generate(pair.target, pair.tokenizer, ids, max_tokens=40))
    assert "Lily" in full
    ref_ids = [t for r in stream_generate(pair.target, pair.tokenizer, ids, max_tokens=40) for t in r.tokens]
    # The same with a drafter that is always right, so the stop string lands mid-block.
    drafter = ScriptedDrafter(ids + ref_ids + [0] * 16, correct=7, block_size=8, vocab=512, layer_ids=(1,))
    for d in (None, drafter):
        cache = pair.target.make_cache(8)
        responses = list(stream_generate(pair.target, pair.tokenizer, ids, d, max_tokens=40, block_size=8 if d else None,
                                         stop_strings=["Lily"], prompt_cache=cache))
        text = "".join(r.text for r in responses)
        tokens = [t for r in responses for t in r.tokens]
        assert text == full[: full.index("Lily")]
        assert responses[-1].finish_reason == "stop"
        assert "Lily" in pair.tokenizer.decode(tokens) and tokens == ref_ids[: len(tokens)]
        assert all(c.offset == len(ids) + len(tokens) - 1 for c in cache)


def test_text_stream_holds_back_a_possible_stop_and_cuts_at_it():
    from types import SimpleNamespace

    from dflash_mlx.decode.stopping import TextStream

    text = TextStream(SimpleNamespace(decode=decode), stop_strings=["cde"])
    assert text.add([0, 1, 2]) == "ab"  # "c" could begin the stop string
    assert text.add([3]) == ""
    assert text.add([5]) == "cdf"  # not the stop string after all
    assert text.add([2, 3, 4, 9], final=True) == "" and text.text == "abcdfcdexy"
    plain = TextStream(SimpleNamespace(decode=decode))
    assert plain.add([0, 9]) + plain.add([1], final=True) == "axyb"
