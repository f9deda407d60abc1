"""The statistics as the commands report them, on stories260K: one request gives the same
steps, tau and histogram through generate, chat, bench and serve; tau is never shown
without a drafter; a cached prompt says what it reused and prefilled; generate --compare;
tables a person reads in a terminal and in a log."""

import io
import json
import re

import httpx
import pytest
from rich.console import Console
from rich.table import Table

from conftest import dflash as run_dflash, needs_shared
from test_server import live_server

PROMPT = "Once upon a time"
N = 24  # tokens per request
STEPS = re.compile(r"^Acceptance: tau ([\d.]+) tokens/step over (\d+) verify steps", re.M)


def dflash(command, *args, stdin=None):
    return run_dflash(command, *args, input=stdin, text=True)


def _histogram(text: str) -> dict:
    line = re.search(r"^Histogram: (.*)$", text, re.M).group(1)
    return {k: int(n) for k, n in (pair.split(":") for pair in line.split())}


@needs_shared
def test_one_request_gives_the_same_statistics_through_generate_chat_bench_and_serve(stories, random_drafter,
                                                                                       tmp_path):
    pair = ["--model", str(stories), "--draft-model", str(random_drafter), "--block-size", "4"]
    r = dflash("generate", *pair, "-p", PROMPT, "-m", str(N), "--json", "--no-prompt-cache")
    assert r.returncode == 0, r.stderr
    gen = json.loads(r.stdout)
    assert gen["generation_tokens"] == N and gen["plain_steps"] == 0
    assert gen["steps"] == sum(gen["acceptance_histogram"].values()) >= 1
    # tau counts the target's own token: committed tokens after the first, per verify step
    assert gen["tau"] == pytest.approx((N - 1) / gen["steps"], abs=1e-4)
    tau, steps = STEPS.search(r.stderr).groups()
    assert (float(tau), int(steps)) == (round(gen["tau"], 2), gen["steps"])

    chat = dflash("chat", *pair, "-m", str(N), "--no-prompt-cache", stdin=f"{PROMPT}\n/stats\n")
    assert chat.returncode == 0, chat.stderr
    out = chat.stdout + chat.stderr
    tau, steps = STEPS.search(out).groups()
    assert (float(tau), int(steps)) == (round(gen["tau"], 2), gen["steps"])
    assert _histogram(out) == gen["acceptance_histogram"]
    assert f"Generation: {N} tokens" in out and f"Prompt: {gen['prompt_tokens']} tokens," in out

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    r = dflash("bench", *pair, "--dataset", str(prompts), "-n", "1", "-m", str(N), "--warmup-tokens", "0",
               "--no-plots", "--out", str(tmp_path / "bench"))
    assert r.returncode == 0, r.stderr
    runs = json.loads((tmp_path / "bench" / "results.json").read_text())["datasets"][0]["runs"]
    run = next(x for x in runs if x["engine"] == "dflash")
    assert run["prompt_tokens"] == gen["prompt_tokens"] and run["generation_tokens"] == N
    for key in ("steps", "plain_steps", "tau", "acceptance_rate", "acceptance_histogram"):
        assert run[key] == gen[key], key

    with live_server(tmp_path / "serve.log", *pair, "--max-batch", "1") as url:
        body = {"model": str(stories), "prompt": PROMPT, "max_tokens": N, "temperature": 0}
        usage = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
    d = usage["dflash"]
    assert usage["prompt_tokens"] == gen["prompt_tokens"] and usage["completion_tokens"] == N
    for key in ("steps", "plain_steps", "tau", "acceptance_rate", "acceptance_histogram",
                "prompt_tokens_reused", "prompt_tokens_prefilled", "block_attention", "prompt_lookup"):
        assert d[key] == gen[key], key
    # measured as generate measures them (the server's own peak memory holds more than one request's)
    assert d["peak_memory"] >= gen["peak_memory"] > 0 and d["bandwidth_gbps"] > 0 and gen["bandwidth_gbps"] > 0
    assert d["timings_ms"]["prefill"] > 0 and d["timings_ms"]["decode"] > 0


@needs_shared
def test_without_a_drafter_no_tau_is_shown_and_every_step_is_plain(stories):
    r = dflash("generate", "--model", str(stories), "-p", PROMPT, "-m", str(N), "--json", "--no-prompt-cache")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tau"] is None and d["steps"] == 0 and d["plain_steps"] == N - 1 and d["acceptance_histogram"] == {}
    assert d["bandwidth_gbps"] > 0
    assert "tau" not in r.stderr and "Histogram" not in r.stderr
    chat = dflash("chat", "--model", str(stories), "-m", str(N), stdin=f"{PROMPT}\n/stats\n")
    assert chat.returncode == 0, chat.stderr
    assert "tau" not in chat.stdout + chat.stderr and f"{N} tokens · " in chat.stderr


@needs_shared
def test_a_cached_prompt_says_what_it_reused_and_rates_what_it_prefilled(stories, tmp_path):
    args = ["--model", str(stories), "-p", PROMPT, "-m", "8", "--prompt-cache-dir", str(tmp_path / "pc")]
    first = dflash("generate", *args)
    assert re.search(r"^Prompt: 5 tokens, [\d.]+ tokens-per-sec$", first.stderr, re.M), first.stderr
    again = dflash("generate", *args)
    line = re.search(r"^Prompt: .*$", again.stderr, re.M).group(0)
    assert re.fullmatch(r"Prompt: 5 tokens \(4 reused from the prompt cache, 1 prefilled\), [\d.]+ tokens-per-sec",
                        line), line
    d = json.loads(dflash("generate", *args, "--json").stdout)
    assert (d["prompt_tokens"], d["prompt_tokens_reused"], d["prompt_tokens_prefilled"]) == (5, 4, 1)


@needs_shared
def test_compare_decodes_plainly_and_reports_the_speedup_and_the_same_text(stories, random_drafter):
    args = ["--model", str(stories), "--draft-model", str(random_drafter), "--block-size", "4", "-p", PROMPT,
            "-m", str(N), "--no-prompt-cache", "--compare"]
    r = dflash("generate", *args)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^Compare: plain decoding [\d.]+ tokens-per-sec; DFlash [\d.]+x, same output "
                     r"\(both timed after a warm-up that built their kernels\)$",
                     r.stderr, re.M), r.stderr
    d = json.loads(dflash("generate", *args, "--json", "--quiet").stdout)
    c = d["compare"]
    assert c["same_output"] is True and "plain_text" not in c and c["plain_generation_tokens"] == N
    assert c["speedup"] == pytest.approx(d["generation_tps"] / c["plain_generation_tps"], rel=1e-2)
    plain = dflash("generate", "--model", str(stories), "-p", PROMPT, "-m", "4", "--compare")
    assert plain.returncode == 1 and plain.stdout == ""
    assert plain.stderr == "error: --compare needs --draft-model (it compares DFlash with plain decoding)\n"


def test_every_line_fits_80_piped_columns_folded_under_its_label(stories, random_drafter, tmp_path):
    """COLUMNS=80 in a pipe: generate's statistics (with --compare) and convert's closing lines fold at word
    boundaries, the rest of a line under the text after its label; no line is longer than 80."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    env = {**os.environ, "COLUMNS": "80"}
    r = run_dflash("generate", "--model", str(stories), "--draft-model", str(random_drafter), "-p", PROMPT, "-m",
                   str(N), "--compare", env=env, text=True)
    assert r.returncode == 0 and max(map(len, r.stderr.splitlines())) <= 80, r.stderr
    assert re.search(r"^Acceptance: tau .*\n {12}\S", r.stderr, re.M), r.stderr
    out = Path(tempfile.mkdtemp()) / "out"  # short: a path is one word, never split, and must fit 80
    r = run_dflash("convert", "--model", str(stories), "--out", str(out), env=env, text=True)
    assert r.returncode == 0 and max(map(len, r.stderr.splitlines())) <= 80, r.stderr
    assert f"Run: dflash generate --model {out}" in r.stderr.replace("\n     ", " ")
    shutil.rmtree(out.parent)


def _table() -> Table:
    table = Table(title="dflash bench: speed and acceptance")
    for col in ("dataset", "engine", "tau", "tok/s", "prompt tok/s", "peak GB", "speedup\n(med/med)",
                "speedup\n(med ratio)", "outputs\ndiffer", "t_AR/token", "measured\n/ideal"):
        table.add_column(col, justify="right")
    table.add_row("gsm8k_test", "ar (baseline)", "", "50.1", "1000", "1.000", "1.00x", "1.00x", "", "20.00", "")
    table.add_row("", "dflash B=16", "3.21", "123.4", "2345", "1.234", "2.31x", "2.29x", "0/10", "20.00", "0.900")
    return table


def test_a_table_fits_80_terminal_columns_and_is_plain_text_in_a_log(monkeypatch):
    from dflash_mlx.cli.common import print_table

    monkeypatch.delenv("COLUMNS", raising=False)  # a log of rows: piped with no COLUMNS (tests/test_fit.py: with)

    term = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    print_table(_table(), term)
    shown = term.file.getvalue()
    assert max(len(line) for line in shown.splitlines()) <= 80 and "…" not in shown
    for word in ("gsm8k", "dflash", "3.21", "2.29x", "0.900", "20.00"):
        assert word in shown, word  # no column dropped off the edge

    log = io.StringIO()
    print_table(_table(), Console(file=log, width=80))
    text = log.getvalue()
    assert text.endswith("\n") and "\x1b" not in text
    assert not set(text) & set("─━│┃┏┓┗┛┡┩└┘├┤┼╇╈")  # no box drawing
    rows = text.splitlines()
    assert rows[0] == "dflash bench: speed and acceptance"
    assert re.fullmatch(r"\s+dflash B=16\s+3\.21\s+123\.4\s+2345\s+1\.234\s+2\.31x\s+2\.29x\s+0/10\s+20\.00\s+0\.900",
                        rows[-1])


def test_prompt_lookup_copies_from_the_whole_prompt_when_the_cache_holds_part_of_it(stories, tmp_path):
    """A prompt the prompt cache restores from disk is still context to copy from: the second run drafts
    the same copies as the first, whose cache was empty, and both say the same as --prompt-lookup off.
    The prompt ends as its beginning does, so the first copies come from the part the cache restores
    (with that part left out of the context the second run drafts nothing)."""
    story = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One "
             "day, she saw a big, red ball. She wanted to play with it, but it was too high.\nLily\nOnce upon a time")
    args = ["generate", "--model", str(stories), "-p", story, "-m", "120", "--json", "--quiet",
            "--prompt-cache-dir", str(tmp_path / "cache")]
    runs = [json.loads(dflash(*args).stdout) for _ in range(2)]
    off = json.loads(dflash(*args, "--prompt-lookup", "off").stdout)
    assert runs[0]["prompt_tokens_reused"] == 0 < runs[1]["prompt_tokens_reused"]
    assert runs[0]["prompt_lookup"] == runs[1]["prompt_lookup"] and runs[0]["prompt_lookup"]["drafted"] > 0
    assert runs[0]["text"] == runs[1]["text"] == off["text"] and off["prompt_lookup"]["drafted"] == 0


def test_compare_decodes_plainly_without_copies_either(monkeypatch):
    """--compare's plain half is plain decoding: no drafter and no prompt lookup, whatever the DFlash half
    was given."""
    from dflash_mlx import compare
    from dflash_mlx.stats import GenerationStats

    seen = {}

    def fake(target, tokenizer, prompt, drafter, **kwargs):
        seen.update(kwargs, drafter=drafter)
        return "text", GenerationStats(block_size=1)

    monkeypatch.setattr(compare, "generate", fake)
    compare.compare_with_plain(None, None, [1, 2], "text", GenerationStats(block_size=1), prompt_lookup=True,
                               max_tokens=8)
    assert seen == {"drafter": None, "prompt_lookup": False, "max_tokens": 8}
