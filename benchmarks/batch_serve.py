#!/usr/bin/env python3
"""Aggregate tokens/s and time to first token of ``dflash serve --max-batch N`` under load,
against ``--max-batch 1`` and ``mlx_lm.server`` on the same target.

Each server is started in turn, alone (pinned to CPU ``--server-cpu`` with taskset;
this process, the clients, to the others). For each number of concurrent clients C,
C threads each send ``--requests`` streaming ``/v1/completions`` (``--chat``: chat) requests back to back
with the official ``openai`` client (greedy, ``--max-tokens`` each, prompts in turn),
after one warm-up request. Per C and server: aggregate tokens/s (completion tokens of
every request, from ``usage``, over the wall time of the round), p50 / p95 time to first
token (send to the first chunk with text). Rounds are repeated ``--repeats`` times in
turn over the servers (reversed every other repeat); medians are reported, with the
ratios to ``--max-batch 1`` and to mlx_lm.server of each repeat's figures (ratios of the
same repeat, then the median) and a one-sided sign test of those ratios
(:func:`sign_test`, SciPy's exact binomial test).

Every dflash reply is checked against mlx_lm.server's reply for the same prompt
(greedy: both are the target's own greedy text).

    OPENBLAS_NUM_THREADS=1 python benchmarks/batch_serve.py --model /tmp/b21/target \\
        --draft-model /tmp/b21/random-drafter --clients 1,2,4,8 --repeats 3 --json-out /tmp/b21/serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional


from serve_load import free_port, launch_server, run_clients  # benchmarks/ is on the path when run as a script
from story_openings import PROMPTS

from dflash_mlx.cli.bench_tables import cell


def server_command(kind: str, args, port: int) -> List[str]:
    """The command line of one server kind: ``dflash-bN`` (``--max-batch N``),
    ``dflash-bN-BK`` (and ``--block-size K``, for this server only), either with ``-off`` at the end
    (``--prompt-lookup off``), or ``mlx_lm``."""
    if kind == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", args.model, "--port", str(port),
                "--log-level", "WARNING"]
    name = kind.removesuffix("-off")
    batch, _, own_block = name.split("-b")[1].partition("-B")
    block = args.baseline_block_size if batch == "1" and args.baseline_block_size else args.block_size
    block = own_block or block
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--model", args.model, "--port", str(port),
           "--max-batch", batch, "--log-level", "warning", "--block-size", block,
           "--prompt-cache-dir", tempfile.mkdtemp(prefix="batch-serve-")]  # every server starts cold
    cmd += ["--prompt-lookup", "off"] if name != kind else []
    return cmd + (["--draft-model", args.draft_model] if args.draft_model else [])


def start(kind: str, args, log: Path):
    """Start a server pinned to ``--server-cpu``; returns (process, base URL) once it answers."""
    port = free_port()
    cmd = ["taskset", "-c", args.server_cpu, *server_command(kind, args, port)]
    return launch_server(cmd, port, log)


def one_request(client, model: str, prompt: str, max_tokens: int, chat: bool = False) -> Dict:
    """One streaming completion (``chat``: a chat completion of one user turn): its text, tokens, and seconds
    to the first text chunk."""
    tic = time.perf_counter()
    first, text, tokens = None, "", None
    kwargs = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                  stream_options={"include_usage": True})
    stream = (client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs) if chat
              else client.completions.create(prompt=prompt, **kwargs))
    for chunk in stream:
        piece = chunk.choices and (chunk.choices[0].delta.content if chat else chunk.choices[0].text)
        if piece:
            if first is None:
                first = time.perf_counter() - tic
            text += piece
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"prompt": prompt, "text": text, "tokens": tokens, "ttft": first, "seconds": time.perf_counter() - tic}


def load_round(url: str, model: str, clients: int, requests: int, max_tokens: int, prompts: List[str],
               chat: bool) -> Dict:
    """``clients`` threads x ``requests`` requests; aggregate tokens/s and TTFT percentiles."""
    import openai

    results, errors = [], []

    def loop(i: int):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        try:
            for k in range(requests):
                results.append(one_request(c, model, prompts[(i * requests + k) % len(prompts)], max_tokens, chat))
        except Exception as e:  # noqa: BLE001 (reported)
            errors.append(repr(e))

    wall = run_clients(loop, clients)
    if errors:
        raise SystemExit(f"client errors: {errors[:3]}")
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {"clients": clients, "wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "texts": {r["prompt"]: r["text"] for r in results}}


def run_server(kind: str, args, log_dir: Path, repeat: int) -> List[Dict]:
    proc, url = start(kind, args, log_dir / f"{kind}-{repeat}.log")
    try:
        import openai

        warm = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        one_request(warm, args.model, args.texts[0], args.max_tokens, args.chat)
        rounds = []
        for c in args.clients:
            r = load_round(url, args.model, c, args.requests, args.max_tokens, args.texts, args.chat)
            print(f"  {kind:10s} clients {c}: {r['tokens_per_s']:8.1f} tokens/s, TTFT p50 "
                  f"{1000 * r['ttft_p50_s']:.0f} ms p95 {1000 * r['ttft_p95_s']:.0f} ms", flush=True)
            rounds.append(r)
        return rounds
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def summarize(runs: Dict[str, List[List[Dict]]], clients: List[int], kinds: List[str]) -> List[Dict]:
    """Medians over repeats per (server, clients), and ratios of each repeat to the baselines."""
    rows = []
    for i, c in enumerate(clients):
        for kind in kinds:
            figures = [rep[i] for rep in runs[kind]]
            row = {"server": kind, "clients": c,
                   "tokens_per_s": statistics.median(f["tokens_per_s"] for f in figures),
                   "ttft_p50_ms": 1000 * statistics.median(f["ttft_p50_s"] for f in figures),
                   "ttft_p95_ms": 1000 * statistics.median(f["ttft_p95_s"] for f in figures),
                   "tokens_per_s_all": [round(f["tokens_per_s"], 1) for f in figures]}
            for base in ("dflash-b1", "mlx_lm"):
                if base in runs and base != kind:
                    ratios = [f["tokens_per_s"] / b[i]["tokens_per_s"] for f, b in zip(figures, runs[base])]
                    row[f"vs_{base}"] = statistics.median(ratios)
                    row[f"vs_{base}_all"] = [round(r, 3) for r in ratios]
                    row[f"vs_{base}_sign_test"] = sign_test(ratios)
            rows.append(row)
    return rows


def sign_test(ratios: List[float]) -> dict:
    """One-sided exact sign test that paired ratios (one per repeat) are above 1 more often than chance, ratios
    of 1 dropped: ``{"above", "n", "p"}`` (p = 1 when n = 0)."""
    from scipy.stats import binomtest

    signs = [r > 1.0 for r in ratios if r != 1.0]
    n, above = len(signs), sum(signs)
    return {"above": above, "n": n, "p": float(binomtest(above, n, 0.5, alternative="greater").pvalue) if n else 1.0}


def check_texts(runs: Dict[str, List[List[Dict]]]) -> Optional[int]:
    """Replies of every dflash server that differ from mlx_lm.server's for the same prompt (None: it did not run)."""
    if "mlx_lm" not in runs:
        return None
    reference = {p: t for rep in runs["mlx_lm"] for r in rep for p, t in r["texts"].items()}
    return sum(1 for kind, reps in runs.items() if kind != "mlx_lm" for rep in reps for r in rep
               for p, t in r["texts"].items() if t != reference.get(p, t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--block-size", default="auto", help="dflash serve --block-size (both dflash servers)")
    p.add_argument("--baseline-block-size", default=None, help="--block-size of the --max-batch 1 server "
                   "(default: --block-size)")
    p.add_argument("--servers", default="dflash-b8,dflash-b1,mlx_lm",
                   help="dflash-bN (--max-batch N), dflash-bN-BK (and --block-size K), either with -off "
                   "(--prompt-lookup off), mlx_lm")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=3, help="requests per client per round")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-cpu", default="0", help="taskset CPU list of the servers")
    p.add_argument("--client-cpus", default="1", help="CPUs of this process (the clients)")
    p.add_argument("--prompts", default=None, help="JSONL of {'prompt': ...} rows (default: story openings)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a chat turn (/v1/chat/completions)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    args.texts = ([json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()] if args.prompts
                  else PROMPTS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the server started
    args.clients = [int(c) for c in args.clients.split(",")]
    os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    kinds = args.servers.split(",")
    log_dir = Path(args.json_out or "/tmp/batch_serve.json").with_suffix(".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: Dict[str, List[List[Dict]]] = {k: [] for k in kinds}
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        for kind in kinds if repeat % 2 == 0 else kinds[::-1]:  # A B, B A, ...: a drift favours neither
            runs[kind].append(run_server(kind, args, log_dir, repeat))
    rows = summarize(runs, args.clients, kinds)
    mismatches = check_texts(runs)
    print("\nreplies differing from mlx_lm.server's: " + ("not compared (mlx_lm is not among --servers)"
                                                         if mismatches is None else str(mismatches)))
    print("| server | clients | tokens/s (median) | all repeats | vs --max-batch 1 | vs mlx_lm.server | "
          "TTFT p50 ms | TTFT p95 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s_all']} | "
              f"{cell(r.get('vs_dflash-b1'), '{:.2f}x')} | {cell(r.get('vs_mlx_lm'), '{:.2f}x')} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} |")
    for r in rows:
        if "vs_mlx_lm_sign_test" in r:
            t = r["vs_mlx_lm_sign_test"]
            print(f"{r['server']}, {r['clients']} clients: ahead of mlx_lm.server in {t['above']} of {t['n']} "
                  f"repeats (one-sided sign test p = {t['p']:.3f}); ratios {r['vs_mlx_lm_all']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows, "mismatches": mismatches,
                                                   "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
