"""Hypothesis strategies for hostile `dflash serve` requests: bodies near the OpenAI
schema with any field set to any JSON value (lone surrogates, NaN, huge numbers,
wrong types, nested junk), plus bodies that are not JSON at all.

Used by tests/test_server_fuzz.py."""

from __future__ import annotations

import json
from typing import Tuple

from hypothesis import strategies as st

# Any character, lone surrogates included (hypothesis leaves category Cs out by default,
# and with it in draws one rarely: one text in ~100 then, so some are put in on purpose).
SURROGATES = st.sampled_from(["\ud800", "\udfff", "\ud83d", "\udc00"])
ANY_TEXT = (st.text(st.characters(exclude_categories=()), max_size=24)
            | st.builds(lambda a, s, b: a + s + b, st.text(max_size=6), SURROGATES, st.text(max_size=6)))
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | ANY_TEXT
           | st.sampled_from([0, 1, 2, -1, 0.5, 1e-300, 5e-324, 2**64, "", "auto", "none", "text"]))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(ANY_TEXT, inner, max_size=3), max_leaves=8)

FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "best_of", "suffix",
          "logit_bias", "presence_penalty", "frequency_penalty", "response_format", "tools", "tool_choice",
          "chat_template_kwargs", "user", "unknown_field"]
PLAUSIBLE = {  # values a real client sends, so that many requests get past validation
    "temperature": [0, 0.7, 1.0, 2.0, 1e-9], "top_p": [0.9, 1.0], "top_k": [0, 5, 10**6], "min_p": [0.0, 0.05],
    "seed": [0, 7, 2**64 - 1], "stop": ["\n", ["a", "b"], ""], "stream": [True, False],
    "stream_options": [{"include_usage": True}], "n": [1], "logprobs": [False], "echo": [False],
    "chat_template_kwargs": [{"enable_thinking": False}], "user": ["u"], "tool_choice": ["auto"],
}
ROLES = ["system", "developer", "user", "assistant", "tool", "bot", ""]


def _message():
    content = ANY_TEXT | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": ANY_TEXT}), max_size=2) | JSON_VALUES
    return st.fixed_dictionaries({"role": st.sampled_from(ROLES)}, optional={"content": content,
                                                                           "name": JSON_VALUES})


@st.composite
def hostile_request(draw, model: str) -> Tuple[str, bytes]:
    """``(path, body bytes)``: a chat or completions request, most fields valid, some not."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    kind = draw(st.sampled_from(["schema"] * 8 + ["json", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(JSON_VALUES)).encode()
    body = {"model": draw(st.sampled_from([model] * 8 + [model + "\ud800", "\udfff"])),
            "max_tokens": draw(st.integers(1, 8))}
    if path == "/v1/chat/completions":
        body["messages"] = draw(st.lists(_message(), min_size=0, max_size=3)
                                | st.just([{"role": "user", "content": "Once upon a time"}]))
    else:
        body["prompt"] = draw(ANY_TEXT | st.lists(st.integers(-5, 300), max_size=8) | st.just("Once upon")
                              | JSON_VALUES)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(st.sampled_from(PLAUSIBLE.get(name, [None])) | JSON_VALUES)
    # allow_nan: NaN and Infinity go out as the bare words Python's json reads back.
    return path, json.dumps(body, allow_nan=True).encode()
