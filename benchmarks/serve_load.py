#!/usr/bin/env python3
"""Load and overhead of ``dflash serve`` against ``dflash generate`` on the same prompts.

Starts ``dflash serve`` on a free loopback port and, in this process, the pair that
``dflash generate`` loads. Then, ``--repeats`` times:

1. **overhead**: each prompt through ``dflash generate``'s own code path (prompt
   encoding, fresh caches, ``stream_generate``), then the same prompt as one
   non-streaming ``/v1/completions`` request with nothing else running (a pause
   between the two); the ratio of the two latencies, per prompt (the process start
   and model load of a ``dflash generate`` run are not counted);
2. **load**: ``--clients`` threads each send ``--requests`` requests back to back
   (chat and completions, streaming and not, in turn) over the prompts; requests/s,
   p50/p95 latency (send to last byte) and tokens/s (completion tokens over the wall
   time).

Every server output is checked against ``dflash generate``'s (greedy). Reports the
median over every (prompt, repeat) pair for the overhead and over the repeats for the
load; ``--json-out`` keeps every figure. Run it under the benchmark lock, with one
OpenBLAS thread per process (two processes each spinning a 2-thread pool on 2 cores
disturb each other's timings more than the server costs):

    OPENBLAS_NUM_THREADS=1 flock /tmp/dflash-bench.lock python benchmarks/serve_load.py \\
        --model models/stories260K --draft-model models/random-drafter
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Tuple

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 0.3  # between the two sides: OpenBLAS threads spin ~0.1 s after their last call


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int, key: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``, or ``key`` such as ``VmHWM``) in MB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for {pid}")


def launch_server(cmd: List[str], port: int, log: Path) -> Tuple[subprocess.Popen, str]:
    """Start a ``dflash serve`` command (its output into ``log``, no API key from the
    environment) and wait until its ``/health`` answers; returns (process, base URL).
    Exits with the log when the server ends or does not answer in 2 minutes."""
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "DFLASH_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"the server exited: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the server did not start: {log.read_text()}")


def start_server(model: str, draft: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--model", model, "--draft-model", draft,
           "--port", str(port), "--log-level", "warning"]
    return launch_server(cmd, port, log)[0]


class Baseline:
    """``dflash generate``'s code path, in this process: a fresh generation per prompt."""

    def __init__(self, model: str, draft: str):
        from dflash_mlx import load

        self.pair = load(model, draft)

    def __call__(self, prompt: str, max_tokens: int) -> tuple[str, float, int]:
        from dflash_mlx import stream_generate
        from dflash_mlx.prompt import encode_messages, plain_text

        tic = time.perf_counter()
        ids = encode_messages(self.pair.tokenizer, [{"role": "user", "content": prompt}], {"enable_thinking": False},
                              plain=plain_text)
        text, n = "", 0
        for r in stream_generate(self.pair.target, self.pair.tokenizer, ids, self.pair.drafter,
                                 max_tokens=max_tokens):
            text += r.text
            n = r.stats.generation_tokens
        return text, time.perf_counter() - tic, n


def request(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, kind: int):
    """One request of kind 0..3 (completions / chat x non-streaming / streaming);
    returns (text, seconds, completion tokens)."""
    chat, stream = kind % 2 == 1, kind >= 2
    body = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    tic = time.perf_counter()
    if not stream:
        r = client.post(url + path, json=body).json()
        text = r["choices"][0]["message"]["content"] if chat else r["choices"][0]["text"]
        return text, time.perf_counter() - tic, r["usage"]["completion_tokens"]
    text, n = "", 0
    with client.stream("POST", url + path, json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text += (c["delta"].get("content") or "") if chat else c["text"]
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    return text, time.perf_counter() - tic, n


def run_clients(loop, clients: int) -> float:
    """Run ``loop(i)`` for i in 0..clients-1 on as many threads at once; wall seconds."""
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - tic


def load_round(url, model, prompts, refs, max_tokens, clients, per_client) -> dict:
    latencies, tokens, wrong, errors = [], [], [], []

    def client_loop(i: int) -> None:
        with httpx.Client(timeout=300) as c:
            for k in range(per_client):
                p = prompts[(i * per_client + k) % len(prompts)]
                try:
                    text, s, n = request(c, url, model, p, max_tokens, (i + k) % 4)
                except Exception as e:  # noqa: BLE001 (counted, reported)
                    errors.append(repr(e))
                    continue
                latencies.append(s)
                tokens.append(n)
                if text != refs[p]:
                    wrong.append(p)

    wall = run_clients(client_loop, clients)
    return {
        "requests": len(latencies), "errors": len(errors), "outputs_differing": len(wrong),
        "wall_s": wall, "requests_per_s": len(latencies) / wall,
        "latency_p50_s": float(np.percentile(latencies, 50)), "latency_p95_s": float(np.percentile(latencies, 95)),
        "tokens_per_s": sum(tokens) / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target mlx-lm folder")
    p.add_argument("--draft-model", required=True, help="drafter folder")
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts" / "tinystories.jsonl"))
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=5, help="requests per client")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][: args.n_prompts]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load_{os.getpid()}.log"
    port = free_port()
    server = start_server(args.model, args.draft_model, port, log)
    url = f"http://127.0.0.1:{port}"
    model = args.model
    try:
        base = Baseline(args.model, args.draft_model)
        refs = {q: base(q, args.max_tokens)[0] for q in prompts}  # also the warm-up
        with httpx.Client(timeout=300) as c:
            for q in prompts:
                request(c, url, model, q, args.max_tokens, 0)
        rounds = []
        for _ in range(args.repeats):
            ratios, gen_s, srv_s, wrong = [], [], [], 0
            with httpx.Client(timeout=300) as c:
                for q in prompts:
                    _, g, _ = base(q, args.max_tokens)
                    time.sleep(SETTLE_S)
                    text, s, _ = request(c, url, model, q, args.max_tokens, 0)
                    time.sleep(SETTLE_S)
                    wrong += text != refs[q]
                    ratios.append(s / g)
                    gen_s.append(g)
                    srv_s.append(s)
            load = load_round(url, model, prompts, refs, args.max_tokens, args.clients, args.requests)
            rounds.append({"overhead_ratios": ratios, "generate_s": gen_s, "serve_s": srv_s,
                           "sequential_outputs_differing": wrong, "load": load})
            print(json.dumps({"overhead_median_ratio": round(statistics.median(ratios), 3),
                              "outputs_differing": wrong, **load}), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)

    def med(f):
        return statistics.median(f(r) for r in rounds)

    summary = {
        "prompts": len(prompts), "max_tokens": args.max_tokens, "clients": args.clients,
        "requests_per_client": args.requests, "repeats": args.repeats,
        "requests_per_s": med(lambda r: r["load"]["requests_per_s"]),
        "latency_p50_s": med(lambda r: r["load"]["latency_p50_s"]),
        "latency_p95_s": med(lambda r: r["load"]["latency_p95_s"]),
        "tokens_per_s": med(lambda r: r["load"]["tokens_per_s"]),
        "overhead_ratio": statistics.median(x for r in rounds for x in r["overhead_ratios"]),
        "overhead_ms": 1e3 * statistics.median(s - g for r in rounds for g, s in zip(r["generate_s"], r["serve_s"])),
        "generate_latency_s": statistics.median(x for r in rounds for x in r["generate_s"]),
        "serve_latency_s": statistics.median(x for r in rounds for x in r["serve_s"]),
        "errors": sum(r["load"]["errors"] for r in rounds),
        "outputs_differing": sum(r["load"]["outputs_differing"] + r["sequential_outputs_differing"] for r in rounds),
        "rounds": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
