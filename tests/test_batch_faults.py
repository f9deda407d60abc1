"""A failure in the batching engine (serve/batch_engine.py) ends its own request and
nothing else: a fault injected at each stage of one request (tokenize, start, prefill,
join, a step, its text, the prompt-cache store) while others decode. That request
ends with an error (the store: a warning, and its reply intact); every other request
equals its solo run; the next request succeeds; the decoder's sequences stay the
engine's decoding requests (checked by the worker after every turn: ``mismatches``)."""

import asyncio
from types import SimpleNamespace

import mlx.core as mx
import pytest
from starlette.testclient import TestClient

import conftest
from conftest import tiny_drafter, tiny_target
from dflash_mlx import stream_generate
from dflash_mlx.decode.batch_join import Joining
from dflash_mlx.decode.stopping import StopCondition
from dflash_mlx.prompt_cache import store as store_module
from dflash_mlx.prompt_cache.store import PrefixStore
from dflash_mlx.serve.app import ServerConfig, create_app
from dflash_mlx.serve.engine import Engine, GenerationJob
from dflash_mlx.decode.stopping import TextStream

BAD = 250  # the first prompt id of the request that fails
BAD_MAX = 33  # its max_tokens
GOOD = [GenerationJob([5, 6, 7, 8, 9, 10], 30), GenerationJob([40, 41], 24), GenerationJob([90, 91, 92], 28)]
NEXT = GenerationJob([12, 13, 14], 10)


class Tokenizer(conftest.ByteTokenizer):
    has_chat_template = False


@pytest.fixture(scope="module")
def pair():
    model, target = tiny_target("llama")
    return SimpleNamespace(model=model, target=target, tokenizer=Tokenizer(), draft_path="tiny",
                           drafter=tiny_drafter(target, block_size=8))


@pytest.fixture(scope="module")
def solo(pair):
    """Each request's text run alone (``dflash generate``'s code path)."""
    def run(job):
        return "".join(r.text for r in stream_generate(pair.target, pair.tokenizer, mx.array(job.ids, dtype=mx.int32),
                                                       pair.drafter, max_tokens=job.max_tokens))
    return {tuple(j.ids): run(j) for j in GOOD + [NEXT]}


async def outcome(job):
    """("ok", text) or ("error", message) of a submitted job."""
    text = ""
    try:
        async for c in job:
            if c.error:
                return "error", c.error
            text += c.text
    except Exception as e:  # prepare (tokenize) or start failed: what the handler gets
        return "error", f"{type(e).__name__}: {e}"
    return "ok", text


def is_bad(ids) -> bool:
    return int(ids[0]) == BAD


def inject(stage, engine, monkeypatch):
    """Make the request whose prompt starts with BAD fail at ``stage``."""
    if stage == "start":
        real_start = engine.decoder.start

        def start(key, prompt, *a, **k):
            if is_bad(prompt):
                raise RuntimeError("start broke")
            return real_start(key, prompt, *a, **k)
        monkeypatch.setattr(engine.decoder, "start", start)
    elif stage == "prefill":
        real_advance = Joining.advance

        def advance(self):
            if is_bad(self.prompt.tolist()) and self.rest.size < self.prompt.size:
                raise RuntimeError("prefill broke")  # after its first chunk
            return real_advance(self)
        monkeypatch.setattr(Joining, "advance", advance)
    elif stage == "join":
        real_add = engine.decoder.add

        def add(joining, *args):
            real_add(joining, *args)  # in the batch, then the join fails
            if is_bad(joining.prompt.tolist()):
                raise RuntimeError("join broke")
        monkeypatch.setattr(engine.decoder, "add", add)
    elif stage == "step":
        real_cut, calls = StopCondition.cut, []

        def cut(self, tokens):
            if self.max_tokens == BAD_MAX:
                calls.append(1)
                if len(calls) == 3:  # its second batched step (the first call is its first token)
                    raise RuntimeError("stop condition broke")
            return real_cut(self, tokens)
        monkeypatch.setattr(StopCondition, "cut", cut)
    elif stage == "text":
        real_text, calls = TextStream.add, []

        def text(self, tokens, final):
            if self.stop_strings == ("\x01bad",):
                calls.append(1)
                if len(calls) == 2:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "text broke")
            return real_text(self, tokens, final)
        monkeypatch.setattr(TextStream, "add", text)
    elif stage == "store":
        real_keep = engine.decoder.prefix.keep

        def keep(tokens, cache, draft_cache):
            if is_bad(tokens):
                raise RuntimeError("[save_safetensors] Failed to open file")
            return real_keep(tokens, cache, draft_cache)
        monkeypatch.setattr(engine.decoder.prefix, "keep", keep)


STAGES = ["tokenize", "start", "prefill", "join", "step", "text", "store"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_ends_its_request_only(pair, solo, stage, monkeypatch, tmp_path):
    warnings = []
    store = PrefixStore(tmp_path, warn=warnings.append) if stage == "store" else None
    bad = GenerationJob([BAD, 3, 4, 5, 6, 7, 8, 9, 11], BAD_MAX, stop=["\x01bad"])

    def tokenize():
        raise RuntimeError("tokenizer broke")

    async def main():
        engine = Engine(pair, max_batch=4, block_size=4, prefill_step_size=4, store=store)
        inject(stage, engine, monkeypatch)
        jobs = [engine.submit(GOOD[0]), engine.submit(tokenize if stage == "tokenize" else bad),
                engine.submit(GOOD[1]), engine.submit(GOOD[2])]
        out = await asyncio.gather(*(outcome(j) for j in jobs))
        after = await outcome(engine.submit(NEXT))
        engine.shutdown()
        return engine, out, after

    engine, out, after = asyncio.run(main())
    (a, bad_out, b, c) = out
    assert [a, b, c] == [("ok", solo[tuple(j.ids)]) for j in GOOD]
    assert after == ("ok", solo[tuple(NEXT.ids)])
    if stage == "store":  # a failed write costs the entry, never the reply
        assert bad_out[0] == "ok" and len(bad_out[1]) > 0
        assert any("not stored" in w and "save_safetensors" in w for w in warnings), warnings
    else:
        assert bad_out[0] == "error" and "broke" in bad_out[1], bad_out
    assert engine.mismatches == 0
    assert engine.inconsistency() is None and len(engine.decoder) == 0 and engine.pending == 0


class FlakyTarget:
    """The target, whose first batched forward (two rows or more) raises."""

    def __init__(self, target):
        self.inner, self.failed = target, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache, capture=None):
        if inputs.shape[0] > 1 and not self.failed:
            self.failed = True
            raise RuntimeError("[metal] out of memory")
        return self.inner(inputs, cache, capture)


def test_a_failed_batched_forward_ends_the_batch_and_the_engine_goes_on(pair, solo):
    async def main():
        engine = Engine(pair, max_batch=4, block_size=4)
        engine.decoder.target = FlakyTarget(pair.target)
        out = await asyncio.gather(*(outcome(engine.submit(j)) for j in GOOD))
        after = await outcome(engine.submit(NEXT))
        engine.shutdown()
        return engine, out, after

    engine, out, after = asyncio.run(main())
    failed = [o for o in out if o[0] == "error"]
    assert len(failed) >= 2 and all("out of memory" in m for _, m in failed), out
    assert all(o == ("ok", solo[tuple(j.ids)]) for j, o in zip(GOOD, out) if o[0] == "ok")
    assert after == ("ok", solo[tuple(NEXT.ids)])
    assert engine.mismatches == 0 and len(engine.decoder) == 0 and engine.pending == 0


def test_a_check_that_raises_ends_the_batch_and_the_engine_goes_on(pair, solo, monkeypatch):
    """The worker's own bookkeeping check failing (a bug in it) is a failed check: the
    requests in flight end with an error, none hangs, and the worker takes the next one."""
    async def main():
        engine = Engine(pair, max_batch=4, block_size=4)
        checks = {"n": 0}
        real = engine.decoder.inconsistency

        def broken_once():
            checks["n"] += 1
            if checks["n"] == 2:
                raise AttributeError("'NoneType' object has no attribute 'shape'")
            return real()
        monkeypatch.setattr(engine.decoder, "inconsistency", broken_once)
        out = await asyncio.wait_for(asyncio.gather(*(outcome(engine.submit(j)) for j in GOOD)), 120)
        after = await asyncio.wait_for(outcome(engine.submit(NEXT)), 120)
        engine.shutdown(wait=True)
        return engine, out, after

    engine, out, after = asyncio.run(main())
    assert engine.mismatches == 1 and any(o[0] == "error" for o in out), out
    assert all(o == ("ok", solo[tuple(j.ids)]) for j, o in zip(GOOD, out) if o[0] == "ok")
    assert after == ("ok", solo[tuple(NEXT.ids)])


def test_failing_prompt_cache_writes_never_wedge_the_server(pair, monkeypatch, tmp_path):
    """Every disk write of the prompt cache raises (as MLX does when a file cannot be
    written): every request still gets its 200, the next ones too."""
    def write(*a, **k):
        raise RuntimeError("[save_safetensors] Failed to open file")

    monkeypatch.setattr(store_module, "write", write)
    store = PrefixStore(tmp_path, warn=lambda m: None)
    app = create_app(pair, ServerConfig(model_id="tiny", max_tokens=8, max_batch=4, prompt_store=store))
    with TestClient(app, raise_server_exceptions=False) as client:
        for prompt in ["Once upon", "Once upon a time", "Another"]:
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
            assert r.status_code == 200, r.text
        assert app.state.server.engine.mismatches == 0


def test_a_failure_in_generate_is_raised_not_swallowed(pair, monkeypatch):
    """``stream_generate`` runs the server's turn, where a failure is a result's error: alone, it raises that
    error (a stop condition that breaks mid-generation), it does not end the text early and quietly."""
    real_cut, calls = StopCondition.cut, []

    def cut(self, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stop condition broke")
        return real_cut(self, tokens)

    monkeypatch.setattr(StopCondition, "cut", cut)
    with pytest.raises(RuntimeError, match="stop condition broke"):
        list(stream_generate(pair.target, pair.tokenizer, mx.array(GOOD[0].ids, dtype=mx.int32), pair.drafter,
                             max_tokens=30))
    assert len(calls) == 3
