"""The server's pieces without HTTP: the engine's queue and cancellation on a tiny
random pair, the chat template inputs, the usage object."""

import asyncio
from types import SimpleNamespace

import mlx.core as mx
import pytest

from dflash_mlx import GenerationStats, generate_step
from dflash_mlx.serve.app import APIError, chat_prompt_ids
from dflash_mlx.serve.api import ChatCompletionRequest, usage
from dflash_mlx.serve.engine import Engine, GenerationJob, QueueFullError
from dflash_mlx.serve.metrics import ServerMetrics
from dflash_mlx.serve.tools import check_tool_support
import conftest
from conftest import tiny_drafter, tiny_target


class ByteTokenizer(conftest.ByteTokenizer):
    """Byte tokens; ``template`` records apply_chat_template's kwargs."""

    def __init__(self, template=False, fail=False):
        self.has_chat_template, self.fail, self.calls = template, fail, []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        if self.fail:
            raise ValueError("no such role")
        self.calls.append((messages, kwargs))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.fixture
def pair():
    model, target = tiny_target("llama")
    return SimpleNamespace(model=model, target=target, tokenizer=ByteTokenizer(), drafter=tiny_drafter(target))


def fresh(pair, ids, n):
    steps = generate_step(mx.array(ids, dtype=mx.int32), pair.target, pair.drafter, max_tokens=n)
    return [t for s in steps for t in s.tokens]


async def collect(job):
    text, last = "", None
    async for c in job:
        text += c.text
        last = c if c.finish_reason else last
    return text, last



def requests(metrics, outcome):
    """The ``dflash_requests_total`` sample of chat requests with ``outcome``, as /metrics shows it."""
    return metrics.registry.get_sample_value("dflash_requests_total", {"endpoint": "chat", "outcome": outcome})

def test_queue_bound_and_order(pair):
    """With room for one waiting request, a third gets QueueFullError; the other two
    run one after the other and each equals a fresh generation."""
    metrics = ServerMetrics(pair.drafter.block_size)
    ids_a, ids_b = list(range(10, 30)), list(range(10, 20)) + [99, 98]

    async def main():
        engine = Engine(pair, max_queue=1, block_size=4, metrics=metrics)
        a = engine.submit(GenerationJob(ids_a, 60))
        b = engine.submit(GenerationJob(ids_b, 30))
        with pytest.raises(QueueFullError, match="1 requests are waiting"):
            engine.submit(GenerationJob(ids_b, 5))
        out = await asyncio.gather(collect(a), collect(b))
        engine.shutdown()
        return out, engine

    (a, b), engine = asyncio.run(main())
    assert a[1].usage["completion_tokens"] == 60 and b[1].usage["completion_tokens"] == 30
    assert a[0] == ByteTokenizer().decode(fresh(pair, ids_a, 60))
    assert b[0] == ByteTokenizer().decode(fresh(pair, ids_b, 30))
    assert b[1].usage["prompt_tokens_details"]["cached_tokens"] == 10  # the common prefix
    assert engine.pending == 0 and engine.pair_cache.is_consistent()
    assert requests(metrics, "completed") == 2


def test_closed_job_stops_and_leaves_the_caches_consistent(pair):
    ids = list(range(40, 70))

    async def main():
        engine = Engine(pair, block_size=4, metrics=ServerMetrics(8))
        job = engine.submit(GenerationJob(ids, 200))
        seen = 0
        async for c in job:
            seen += 1
            if seen == 3:
                job.close()
        after = engine.submit(GenerationJob(ids + [5], 20))
        out = await collect(after)
        engine.shutdown()
        return engine, out

    engine, (text, last) = asyncio.run(main())
    assert requests(engine.metrics, "cancelled") == 1
    assert engine.metrics.registry.get_sample_value("dflash_generation_tokens_total") < 200 + 20
    assert text == ByteTokenizer().decode(fresh(pair, ids + [5], 20))
    assert engine.pair_cache.is_consistent()


def test_chat_template_gets_tools_and_kwargs():
    tok = ByteTokenizer(template=True)
    req = ChatCompletionRequest.model_validate({
        "model": "m", "chat_template_kwargs": {"enable_thinking": True},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                           "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                     {"role": "tool", "tool_call_id": "1", "content": "r"}],
    })
    ids = chat_prompt_ids(tok, req, {"enable_thinking": False, "other": 1})
    messages, kwargs = tok.calls[0]
    assert kwargs == {"enable_thinking": True, "other": 1, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert messages[0] == {"role": "user", "content": "ab"}
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [  # arguments decoded for templates
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert bytes(ids).decode() == "<user>ab<assistant><tool>r<assistant>"


def test_chat_template_errors_are_400():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}]})
    with pytest.raises(APIError) as e:
        chat_prompt_ids(ByteTokenizer(template=True, fail=True), req, {})
    assert e.value.status == 400 and e.value.param == "messages" and "no such role" in e.value.message
    tools = ChatCompletionRequest.model_validate({"model": "m", "tools": [{"type": "function", "function": {"name": "f"}}],
                                                  "messages": [{"role": "user", "content": "a"}]})
    with pytest.raises(APIError, match="no chat template") as e:  # checked before the request is queued
        check_tool_support(ByteTokenizer(template=False), bool(tools.tools), tools.tool_choice, set())
    assert e.value.param == "tools"


def test_usage_counts_and_dflash_stats():
    s = GenerationStats(block_size=4, prompt_tokens=10, prompt_reused=7, generation_tokens=7)
    s.record_step(2)
    s.record_step(3)
    u = usage(s)
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (10, 7, 17)
    assert u["prompt_tokens_details"] == {"cached_tokens": 7}
    d = u["dflash"]
    assert d["prompt_tokens_reused"] == 7 and d["prompt_tokens_prefilled"] == 3
    assert d["tau"] == s.tau == 3.5 and d["steps"] == 2 and d["acceptance_histogram"] == {"3": 1, "4": 1}


def test_the_server_and_stream_generate_run_one_decode_loop(pair, monkeypatch):
    """The server's worker and ``stream_generate`` drive the decoder through the same turn (a prefill chunk, a
    step): a request served alone decodes and counts exactly what ``stream_generate`` does for its prompt."""
    from dflash_mlx import stream_generate
    from dflash_mlx.decode.batch import BatchDecoder

    turns, real = [], BatchDecoder.turn

    def counted(self, joining):
        turns.append(len(self.sequences))
        return real(self, joining)

    monkeypatch.setattr(BatchDecoder, "turn", counted)
    ids = list(range(10, 30))
    *_, last = stream_generate(pair.target, pair.tokenizer, ids, pair.drafter, max_tokens=40, block_size=4)
    alone = len(turns)

    async def main():
        engine = Engine(pair, block_size=4)
        out = await collect(engine.submit(GenerationJob(ids, 40)))
        engine.shutdown()
        return out

    text, chunk = asyncio.run(main())
    assert alone > 1 and len(turns) - alone == alone  # one turn per step, the same steps
    assert text == ByteTokenizer().decode(fresh(pair, ids, 40))
    served, streamed = chunk.usage["dflash"], usage(last.stats)["dflash"]
    same = ("steps", "tau", "acceptance_histogram", "verify", "acceptance_rule", "drafter_format", "widths")
    assert {k: served[k] for k in same} == {k: streamed[k] for k in same}
