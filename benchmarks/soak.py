#!/usr/bin/env python3
"""``dflash serve`` soaked: valid and hostile traffic for minutes while the prompt cache's
folder keeps failing; nothing may be lost and nothing may wedge.

Starts ``dflash serve`` (continuous batching, ``--max-batch 8``, an API key, the prompt
cache in a scratch folder) on a free loopback port, with the stories260K target converted
from ``../shared/models/stories260K`` as the tests do (or ``--model``) and the drafter of
``--draft-model``. Then:

1. **solo references**: each valid request (8 prompts, completions and chat, greedy) is
   sent alone, one after another, before any load or fault: its reply is the reference
   (the tests check that a request alone equals ``dflash generate``).
2. **soak** for ``--minutes``: 8 client threads, each sending a random mix (seeded) of
   valid requests (streamed and not) and hostile ones: bad JSON, 200 KB headers,
   slowloris (headers a byte at a time), a wrong API key, a prompt plus ``max_tokens``
   past the context, a tool message without ``tool_call_id``, and streams dropped after
   their first event. Meanwhile a **fault injector** breaks the prompt-cache folder every
   ``--fault-every`` seconds for half that time, in a way that fails writes even for
   root (chmod does not): each pair's subfolder is swapped for a plain file, or the
   whole folder is; then it is put back.
3. A JSON report on stdout: requests by kind and status, ``5xx`` (must be 0), valid
   replies equal to their solo reference (must be all), the server's RSS at the start
   and the end, faults injected, prompt-cache warnings in the server's log. Exit 1 when
   any 5xx, any valid reply differs or fails, or a hostile request got an unexpected status.

    python benchmarks/soak.py --draft-model PATH [--minutes 30] [--model FOLDER] [--log serve.log]
"""

from __future__ import annotations

import argparse
import json
import random
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from serve_load import free_port, launch_server, rss_mb  # benchmarks/ is on the path when run as a script
from story_openings import convert_stories260k

ROOT = Path(__file__).resolve().parents[1]
KEY = "soak-key"
CONTEXT = 512  # stories260K's
PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts" / "tinystories.jsonl")
           .read_text().splitlines()[:8]]
HOSTILE = {  # kind: the statuses that are right for it (None: the client leaves, no status)
    "bad_json": {400}, "huge_headers": {431}, "slowloris": {408, 0}, "bad_auth": {401},
    "past_context": {400}, "bad_tool_message": {400}, "disconnect": {None},
}


# -- requests ---------------------------------------------------------------------


def valid_requests(model: str):
    """(name, path, body) of every valid request: each prompt, completions and chat."""
    out = []
    for i, p in enumerate(PROMPTS):
        n = 16 + 8 * (i % 4)
        out.append((f"completions-{i}", "/v1/completions", {"model": model, "prompt": p, "max_tokens": n}))
        out.append((f"chat-{i}", "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": n}))
    return out


def send_valid(client: httpx.Client, path: str, body: dict, stream: bool):
    """(status, text) of a valid request, streamed or not; text None when it failed."""
    chat = path.endswith("chat/completions")
    if not stream:
        r = client.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, None
        c = r.json()["choices"][0]
        return 200, c["message"]["content"] if chat else c["text"]
    text = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, None
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 500, None  # an error event in a stream: counted as a server error
            c = event["choices"][0] if event.get("choices") else {}
            text.append(((c.get("delta") or {}).get("content") or "") if chat else c.get("text", ""))
    return 200, "".join(text)


def raw(port: int, data: bytes, trickle: float = 0.0) -> int:
    """Send ``data`` on a fresh connection (a byte per ``trickle`` s when set); the status
    the server answers (0: it closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            for i in range(0, len(data), 1 if trickle else len(data)):
                s.sendall(data[i : i + (1 if trickle else len(data))])
                if trickle and select.select([s], [], [], trickle)[0]:
                    break  # the server answered before the headers were done
            reply = s.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            return 0
        return int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def send_hostile(kind: str, client: httpx.Client, port: int, model: str):
    """The status a hostile request got (None for a client that left mid-stream)."""
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    if kind == "bad_json":
        return client.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                           headers={"Content-Type": "application/json"}).status_code
    if kind == "huge_headers":
        return raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    if kind == "slowloris":
        return raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n", trickle=0.05)
    if kind == "bad_auth":
        return client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
    if kind == "past_context":
        return client.post("/v1/completions", json={"model": model, "prompt": list(range(3, 3 + CONTEXT - 12)),
                                                    "max_tokens": 100}).status_code
    if kind == "bad_tool_message":
        messages = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "20C"}]
        return client.post("/v1/chat/completions", json={"model": model, "messages": messages}).status_code
    with client.stream("POST", "/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 200,
                                                        "stream": True}) as r:
        for _ in r.iter_lines():
            break  # leave after the first event
    return None


# -- the fault injector -------------------------------------------------------------


class Faults:
    """Breaks the prompt-cache folder every ``every`` seconds for ``every / 2``: each
    pair's subfolder (or, every other time, the whole folder) becomes a plain file, so
    writes fail with ENOTDIR/EEXIST even as root; then puts it back."""

    def __init__(self, root: Path, every: float):
        self.root, self.every, self.count, self._stop = root, every, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every / 2):
            swapped = self._break()
            self.count += 1
            self._stop.wait(self.every / 2)
            self._mend(swapped)

    def _break(self):
        if self.count % 2 == 1:
            targets = [self.root]
        else:
            targets = [p for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []
        swapped = []
        for p in targets:
            aside = p.with_name(p.name + ".soak-aside")
            try:
                p.rename(aside)
            except OSError:  # gone meanwhile (the server evicts, or has not written yet)
                continue
            try:
                p.write_text("the soak's fault injector put this file here\n")
            except OSError:  # the server made it again meanwhile: leave both, mend puts ours back
                pass
            swapped.append((p, aside))
        return swapped

    def _mend(self, swapped) -> None:
        for p, aside in swapped:
            if p.is_dir():
                shutil.rmtree(p)  # what the server made while ours was aside
            elif p.exists():
                p.unlink()
            aside.rename(p)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


# -- the soak -------------------------------------------------------------------------


def start_server(args, model: str, cache: Path, log: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "--model", model, "--draft-model",
           args.draft_model, "--port", str(port), "--api-key", KEY, "--max-batch", "8", "--prompt-cache-dir",
           str(cache), "--log-level", "warning"]
    return launch_server(cmd, port, log)[0], port


def client_loop(seed: int, port: int, model: str, refs: dict, until: float, out: dict, lock: threading.Lock):
    rng = random.Random(seed)
    valid = valid_requests(model)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=300) as client:
        while time.monotonic() < until:
            if rng.random() < 0.6:
                name, path, body = rng.choice(valid)
                stream = rng.random() < 0.5
                try:
                    status, text = send_valid(client, path, body, stream)
                except httpx.HTTPError as e:
                    status, text = f"transport:{type(e).__name__}", None
                with lock:
                    out["statuses"][f"valid:{status}"] += 1
                    if text is not None and text == refs[name]:
                        out["equal"] += 1
                    else:
                        out["differ"].append({"request": name, "stream": stream, "status": status})
            else:
                kind = rng.choice(sorted(HOSTILE))
                try:
                    status = send_hostile(kind, client, port, model)
                except (httpx.HTTPError, OSError) as e:
                    status = f"transport:{type(e).__name__}"
                with lock:
                    out["statuses"][f"{kind}:{status}"] += 1
                    if status not in HOSTILE[kind]:
                        out["unexpected"].append({"kind": kind, "status": status})


def first_traceback(log: str) -> str:
    """The first traceback of the server's log with the line before it, or ""."""
    lines = log.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if at is None:
        return ""
    end = next((j for j in range(at + 1, len(lines)) if lines[j] and not lines[j][0].isspace()), len(lines) - 1)
    return "\n".join(lines[max(0, at - 1) : end + 1])


def soak(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    try:
        model = args.model or str(convert_stories260k(work / "stories260K"))
        cache, log = work / "prompt-cache", work / "serve.log"
        proc, port = start_server(args, model, cache, log)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"},
                              timeout=300) as c:
                refs = {}
                for name, path, body in valid_requests(model):
                    status, refs[name] = send_valid(c, path, body, stream=False)
                    if status != 200:
                        sys.exit(f"solo reference {name}: status {status}")
            rss_start = rss_mb(proc.pid)
            out = {"statuses": Counter(), "equal": 0, "differ": [], "unexpected": []}
            lock, faults = threading.Lock(), Faults(cache, args.fault_every)
            faults.thread.start()
            until = time.monotonic() + 60 * args.minutes
            threads = [threading.Thread(target=client_loop, args=(args.seed + i, port, model, refs, until, out, lock))
                       for i in range(args.threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            faults.stop()
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            rss_end = rss_mb(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        text = log.read_text()
        if args.log:
            shutil.copy(log, args.log)
        statuses = out["statuses"]
        fives = sum(n for k, n in statuses.items() if k.split(":")[-1].isdigit() and k.split(":")[-1][0] == "5")
        return {
            "minutes": args.minutes, "threads": args.threads,
            "requests": sum(statuses.values()),
            "valid": sum(n for k, n in statuses.items() if k.startswith("valid:")),
            "valid_equal_solo": out["equal"], "valid_differ_or_failed": len(out["differ"]),
            "5xx": fives, "unexpected_hostile": len(out["unexpected"]),
            "statuses": dict(sorted(statuses.items())),
            "faults_injected": faults.count,
            "prompt_cache_warnings": text.count("prompt cache"),
            "tracebacks_in_log": text.count("Traceback"),
            "first_traceback": first_traceback(text),
            "rss_mb_start": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
            "health_after": health,
            "examples": {"differ": out["differ"][:5], "unexpected": out["unexpected"][:5]},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-model", required=True, help="the drafter folder (for the stories260K target)")
    ap.add_argument("--model", help="the target folder (default: stories260K from ../shared, converted)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--fault-every", type=float, default=20.0, help="seconds between two breaks of the cache folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", help="copy the server's log here")
    args = ap.parse_args()
    report = soak(args)
    print(json.dumps(report, indent=1))
    bad = report["5xx"] or report["valid_differ_or_failed"] or report["unexpected_hostile"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
