#!/usr/bin/env python3
"""``dflash serve`` under hostile requests: memory, abandoned requests, fuzzing.

Starts ``dflash serve`` on a free loopback port and measures, reading the server's
resident memory from ``/proc/PID/status`` (VmRSS sampled every 5 ms, and VmHWM after
resetting it through ``/proc/PID/clear_refs``; Linux only):

1. **baseline**: RSS after one warm-up request;
2. **big prompts**: ``--burst`` concurrent completions, each a ``--prompt-mb`` MB prompt
   (under the 4 MB body cap): status codes, peak RSS during the burst, RSS after;
3. **templates**: ``--burst`` concurrent chat requests carrying their own Jinja template
   (``{% set x = "a" * 500000000 %}``): the same figures;
4. **abandoned**: a non-streaming request for ``--abandon-tokens`` tokens whose client
   closes its socket once the server reports it running; the tokens it generated, and
   the seconds from the close until ``/metrics`` counts it cancelled;
5. **fuzz**: ``--fuzz`` hostile requests from ``tests/request_fuzz.py`` (hypothesis,
   derandomized), one after another: status codes (5xx must be 0) and RSS after.

    python benchmarks/serve_hostile.py --model models/stories260K --draft-model models/random-drafter
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from serve_load import free_port, rss_mb  # benchmarks/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]
BOMB = '{% set x = "a" * 500000000 %}{{ x | length }}'


class Peak:
    """Peak RSS of ``pid`` while the block runs: sampled VmRSS and VmHWM, the larger."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def __enter__(self):
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid, "VmHWM"))


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def burst(url: str, path: str, body: dict, n: int) -> Counter:
    def one(_):
        try:
            return httpx.post(f"{url}{path}", json=body, timeout=600).status_code
        except httpx.TransportError as e:
            return type(e).__name__

    with ThreadPoolExecutor(n) as pool:
        return Counter(pool.map(one, range(n)))


def measure_burst(name: str, url: str, pid: int, path: str, body: dict, n: int, out: dict) -> None:
    before = rss_mb(pid)
    tic = time.perf_counter()
    with Peak(pid) as peak:
        codes = burst(url, path, body, n)
    seconds = time.perf_counter() - tic
    time.sleep(1.0)
    out[name] = {"codes": dict(codes), "seconds": seconds, "rss_before_mb": before, "peak_rss_mb": peak.peak,
                 "rss_after_mb": rss_mb(pid)}
    print(f"{name}: {dict(codes)} in {seconds:.2f} s; RSS {before:.0f} MB before, peak {peak.peak:.0f} MB, "
          f"{out[name]['rss_after_mb']:.0f} MB after", flush=True)


def abandoned(url: str, model: str, tokens: int, out: dict) -> None:
    before = metrics(url)
    keys = [f'dflash_requests_total{{endpoint="completions",outcome="{o}"}}' for o in ("cancelled", "completed")]
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": tokens}).encode()
    host, port = url.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    while httpx.get(f"{url}/health").json()["queue"] == 0:  # wait until the engine holds it
        time.sleep(0.001)
    sock.close()
    closed = time.perf_counter()
    while True:  # until /metrics counts it, cancelled or (a server that misses the close) completed
        after = metrics(url)
        ended = [k.split('"')[-2] for k in keys if after.get(k, 0) != before.get(k, 0)]
        if ended:
            break
        time.sleep(0.001)
    stopped = time.perf_counter() - closed
    generated = after["dflash_generation_tokens_total"] - before.get("dflash_generation_tokens_total", 0)
    out["abandoned"] = {"max_tokens": tokens, "generated": generated, "seconds_to_stop": stopped,
                        "outcome": ended[0]}
    print(f"abandoned non-streaming request: {ended[0]} {stopped * 1000:.1f} ms after the client closed, "
          f"{generated:.0f} of {tokens} tokens generated", flush=True)


def fuzz(url: str, model: str, n: int, pid: int, out: dict) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from hypothesis import HealthCheck, Phase, given, settings

    from request_fuzz import hostile_request

    codes: Counter = Counter()
    client = httpx.Client(timeout=600)
    before = rss_mb(pid)

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(request=hostile_request(model))
    def run(request):
        path, body = request
        try:
            r = client.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
            codes[r.status_code] += 1
        except httpx.TransportError:  # the server dropped the connection: as bad as a 5xx
            codes[599] += 1

    tic = time.perf_counter()
    run()
    seconds = time.perf_counter() - tic
    fivexx = sum(v for k, v in codes.items() if k >= 500)  # 599: connection dropped
    out["fuzz"] = {"requests": sum(codes.values()), "codes": {str(k): v for k, v in sorted(codes.items())},
                   "5xx": fivexx, "seconds": seconds, "rss_before_mb": before, "rss_after_mb": rss_mb(pid)}
    print(f"fuzz: {sum(codes.values())} requests in {seconds:.1f} s: {dict(sorted(codes.items()))}; "
          f"5xx: {fivexx}; RSS {before:.0f} MB before, {rss_mb(pid):.0f} MB after", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--prompt-mb", type=float, default=3.8)
    p.add_argument("--abandon-tokens", type=int, default=500)
    p.add_argument("--fuzz", type=int, default=1000)
    p.add_argument("--skip", action="append", default=[], choices=["big_prompts", "templates", "abandoned"],
                   help="leave a phase out (e.g. templates against a server that runs them: 2 GB each)")
    p.add_argument("--src", help="run the server from this folder holding a dflash_mlx package (an older "
                   "version, for comparison: git archive REV dflash_mlx cli, with cli/ moved to dflash_mlx/cli)")
    p.add_argument("--json-out")
    p.add_argument("server_args", nargs="*", help="more `dflash serve` flags (after --)")
    a = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = ["-m", "dflash_mlx.cli.main"]
    if a.src:  # ahead of this checkout's editable install, whose finder would win over PYTHONPATH
        launch = ["-c", "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                        f"sys.path.insert(0, {a.src!r}); sys.argv[0] = 'dflash'; "
                        "from dflash_mlx.cli.main import main; main()"]
    cmd = [sys.executable, *launch, "serve", "--model", a.model, "--port", str(port),
           "--log-level", "warning", *(["--draft-model", a.draft_model] if a.draft_model else []), *a.server_args]
    log = open("/tmp/serve_hostile.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DFLASH_API_KEY": ""})
    try:
        for _ in range(600):
            assert proc.poll() is None, "the server exited (see /tmp/serve_hostile.log)"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out: dict = {"command": " ".join(cmd)}
        r = httpx.post(f"{url}/v1/completions", json={"model": a.model, "prompt": "Once upon a time",
                                                      "max_tokens": 16}, timeout=600)
        assert r.status_code == 200, r.text
        time.sleep(1.0)
        out["baseline_rss_mb"] = rss_mb(proc.pid)
        print(f"baseline RSS {out['baseline_rss_mb']:.0f} MB", flush=True)
        text = ("Once upon a time, there was a little girl named Lily. " * 200_000)[: int(a.prompt_mb * 1e6)]
        if "big_prompts" not in a.skip:
            measure_burst("big_prompts", url, proc.pid, "/v1/completions", {"model": a.model, "prompt": text},
                          a.burst, out)
        if "templates" not in a.skip:
            measure_burst("templates", url, proc.pid, "/v1/chat/completions",
                          {"model": a.model, "messages": [{"role": "user", "content": "Hi"}],
                           "chat_template_kwargs": {"chat_template": BOMB}}, a.burst, out)
        if "abandoned" not in a.skip:
            abandoned(url, a.model, a.abandon_tokens, out)
        if a.fuzz:
            fuzz(url, a.model, a.fuzz, proc.pid, out)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(out, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
