"""The batching engine (serve/batch_engine.py) without HTTP, and `dflash serve --max-batch`:
concurrent requests each equal to their solo run, a cancelled request leaving the batch
with the others unaffected, the queue bound, seeded sampling, every family batching
(sliding-window targets included), the fallback for a target the batch path cannot run
(said in the log and /metrics), and the new metrics."""

import asyncio
import logging
import random
from types import SimpleNamespace

import mlx.core as mx
import pytest

from dflash_mlx import stream_generate
from dflash_mlx.serve.app import ServerConfig, create_app
from dflash_mlx.serve.engine import Engine, GenerationJob, QueueFullError
from dflash_mlx.serve.metrics import ServerMetrics
import conftest
from conftest import parse_metrics, tiny_drafter, tiny_target


class Tokenizer(conftest.ByteTokenizer):
    has_chat_template = False


def make_pair(family="llama", block_size=8):
    model, target = tiny_target(family)
    return SimpleNamespace(model=model, target=target, tokenizer=Tokenizer(), draft_path="tiny",
                           drafter=tiny_drafter(target, block_size=block_size))


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def solo_text(pair, ids, n, stop=()):
    """The request run alone (``dflash generate``'s code path)."""
    return "".join(r.text for r in stream_generate(pair.target, pair.tokenizer, mx.array(ids, dtype=mx.int32),
                                                   pair.drafter, max_tokens=n, stop_strings=stop))


async def collect(job, close_after=None):
    """(text, last chunk, chunks seen); closes the job after ``close_after`` chunks."""
    text, last, n = "", None, 0
    async for c in job:
        text, n = text + c.text, n + 1
        last = c if c.finish_reason or c.error else last
        if close_after is not None and n == close_after:
            job.close()
    return text, last, n


def random_jobs(count, seed):
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        ids = [rng.randrange(1, 255) for _ in range(rng.randint(1, 20))]
        jobs.append(GenerationJob(ids, rng.randint(1, 50), stop=["e"] if i % 3 == 0 else []))
    return jobs


def test_concurrent_requests_equal_their_solo_runs(pair):
    metrics = ServerMetrics(8)
    jobs = random_jobs(12, seed=5)
    sizes, real_set = [], metrics.batch_size.set
    metrics.batch_size.set = lambda v: (sizes.append(v), real_set(v))

    async def main():
        engine = Engine(pair, max_batch=4, block_size=6, metrics=metrics, prefill_step_size=4)
        out = await asyncio.gather(*(collect(engine.submit(j)) for j in jobs))
        engine.shutdown()
        return out

    for job, (text, last, _) in zip(jobs, asyncio.run(main())):
        assert text == solo_text(pair, job.ids, job.max_tokens, job.stop)
        assert last.finish_reason in ("stop", "length") and last.usage["completion_tokens"] >= 1
    rendered = metrics.render().decode()
    counts = parse_metrics(rendered)
    assert counts['dflash_requests_total{endpoint="chat",outcome="completed"}'] == 12
    assert 2 <= max(sizes) <= 4 and sizes[-1] == 0 == counts["dflash_batch_size"]  # batched, then emptied
    assert "dflash_queue_wait_seconds_count 12.0" in rendered
    assert "dflash_request_tau_count 12.0" in rendered


def test_a_cancelled_request_leaves_and_the_others_are_unaffected(pair):
    metrics = ServerMetrics(8)
    jobs = [GenerationJob([5, 6, 7], 60), GenerationJob([9, 10, 11, 12], 200), GenerationJob([40], 45)]

    async def main():
        engine = Engine(pair, max_batch=8, block_size=4, metrics=metrics)
        submitted = [engine.submit(j) for j in jobs]
        out = await asyncio.gather(collect(submitted[0]), collect(submitted[1], close_after=3),
                                   collect(submitted[2]))
        engine.shutdown()
        return out

    (a, _, _), (b, b_last, b_chunks), (c, _, _) = asyncio.run(main())
    assert a == solo_text(pair, jobs[0].ids, 60) and c == solo_text(pair, jobs[2].ids, 45)
    assert b_last is None and b_chunks <= 4  # at most one more step after the close
    assert solo_text(pair, jobs[1].ids, 200).startswith(b)
    counts = parse_metrics(metrics.render().decode())
    assert counts['dflash_requests_total{endpoint="chat",outcome="cancelled"}'] == 1
    assert counts['dflash_requests_total{endpoint="chat",outcome="completed"}'] == 2


def test_a_steps_chunks_reach_the_event_loop_in_one_wake_up(pair, monkeypatch):
    # Each batched step hands every request's chunk (and any end) to the event loop in
    # one call, in order; the texts are still each request's solo text.
    from dflash_mlx.serve import jobs as engine_module

    jobs = [GenerationJob([5, 6, 7], 30), GenerationJob([9, 10, 11, 12], 40), GenerationJob([40], 20)]
    groups = []

    def counting(group):
        groups.append([job for job, _ in group])
        return put_all(group)

    async def main():
        engine = Engine(pair, max_batch=8, block_size=4)
        out = await asyncio.gather(*(collect(engine.submit(j)) for j in jobs))
        engine.shutdown()
        return out

    put_all = engine_module._put_all
    monkeypatch.setattr(engine_module, "_put_all", counting)
    results = asyncio.run(main())
    for job, (text, last, _) in zip(jobs, results):
        assert text == solo_text(pair, job.ids, job.max_tokens) and last.finish_reason == "length"
    assert groups and max(len(set(map(id, g))) for g in groups) == 3  # a step of three requests: one call


def test_queue_bound_counts_beyond_the_batch(pair):
    async def main():
        engine = Engine(pair, max_batch=2, max_queue=1, block_size=4)
        held = [engine.submit(GenerationJob([1, 2, 3], 300)) for _ in range(3)]  # 2 running + 1 waiting
        with pytest.raises(QueueFullError, match="1 requests are waiting"):
            engine.submit(GenerationJob([1, 2, 3], 3))
        for job in held:
            job.close()
        await asyncio.gather(*(collect(j) for j in held), return_exceptions=True)
        engine.shutdown()

    asyncio.run(main())


def test_seeded_sampling_is_reproducible_whatever_the_batch(pair):
    """A seeded request draws with its own key: the same text alone, in a crowd and whatever MLX's global
    generator holds; another seed, another text."""
    async def run(mates, seed=11):
        mx.random.seed(100 + mates)
        engine = Engine(pair, max_batch=8, block_size=4)
        others = [engine.submit(GenerationJob([m, m + 1], 30, temperature=0.8)) for m in range(mates)]
        seeded = GenerationJob([3, 4, 5], 40, temperature=1.0, top_p=0.9, seed=seed)
        out = await asyncio.gather(collect(engine.submit(seeded)), *(collect(o) for o in others))
        engine.shutdown()
        return out[0][0]

    alone, crowded, other = asyncio.run(run(0)), asyncio.run(run(5)), asyncio.run(run(0, seed=12))
    assert alone == crowded and len(alone) > 0 and other != alone


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "llama-sliding", "gpt_oss"])
def test_engine_choice_is_said_in_log_and_metrics(family, caplog):
    """Every family batches: attention, hybrids and sliding-window targets."""
    pair = make_pair(family, block_size=4)
    metrics = ServerMetrics(4)
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        engine = Engine(pair, max_batch=8, metrics=metrics, block_size=4)
    engine.shutdown()
    assert isinstance(engine, Engine) and parse_metrics(metrics.render().decode())["dflash_batching"] == 1
    assert "continuous batching: up to 8 requests decode together" in caplog.text


def test_a_refused_target_falls_back_to_one_at_a_time(caplog, monkeypatch):
    """A target the batch path cannot run (a layer cache with no batched form) is served
    one request at a time, said in the log and in ``dflash_batching``."""
    from dflash_mlx.serve import engine as batch_engine

    monkeypatch.setattr(batch_engine, "not_batchable", lambda target: "target layer 0 keeps an OddCache")
    metrics = ServerMetrics(4)
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        engine = Engine(make_pair("llama", block_size=4), max_batch=8, metrics=metrics, block_size=4)
    engine.shutdown()
    assert type(engine) is Engine and parse_metrics(metrics.render().decode())["dflash_batching"] == 0
    assert "batching is off for this target, requests run one at a time: target layer 0 keeps an OddCache" \
        in caplog.text


def test_max_batch_one_is_todays_engine(pair):
    metrics = ServerMetrics(8)
    engine = Engine(pair, max_batch=1, metrics=metrics, block_size=4)
    engine.shutdown()
    assert type(engine) is Engine and parse_metrics(metrics.render().decode())["dflash_batching"] == 0


def test_batched_sliding_window_server_answers_exactly():
    """A sliding-window target (window 8) under --max-batch 8: batched, and concurrent
    requests running past the window each equal their solo run."""
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    sliding = make_pair("llama-sliding", block_size=4)
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [200]]
    app = create_app(sliding, ServerConfig(model_id="tiny", max_batch=8, block_size=4))
    with TestClient(app) as c:
        post = lambda ids: c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 30})  # noqa: E731
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(post, prompts))
        assert "dflash_batching 1.0" in c.get("/metrics").text
    for ids, r in zip(prompts, replies):
        assert r.json()["choices"][0]["text"] == solo_text(sliding, ids, 30)


@pytest.mark.parametrize("value", ["0", "-1", "100000"])
def test_bad_max_batch_is_a_one_line_error(value):
    from test_cli_hardened import dflash, one_line_error

    one_line_error(dflash("serve", "--model", "nowhere", "--max-batch", value), "--max-batch")
