"""`dflash generate` end to end on the real stories260K model (from ../shared)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import dflash as run_dflash, needs_shared

STORY = ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


def dflash(*args, stdin=None, env=None):
    return run_dflash("generate", *args, input=stdin, text=True, env={**os.environ, **(env or {})})






@needs_shared
def test_piped_prompt_prints_story_and_stats_on_stderr(stories):
    r = dflash("--model", str(stories), "--max-tokens", "40", stdin="Once upon a time\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(STORY)
    for key in ("Prompt:", "Generation:", "Peak memory:"):
        assert key in r.stderr and key not in r.stdout


@needs_shared
def test_plain_output_equals_mlx_lm_generate(stories):
    r = dflash("--model", str(stories), "--prompt", "Once upon a time", "--max-tokens", "100", "--quiet")
    ref = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(stories), "--prompt",
         "Once upon a time", "--max-tokens", "100"], capture_output=True, text=True, timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    mlx_lm_text = ref.stdout.split("==========\n")[1].removesuffix("\n")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.removesuffix("\n") == mlx_lm_text


@needs_shared
def test_drafter_json_output(stories, random_drafter):
    r = dflash("--model", str(stories), "--draft-model", str(random_drafter), "-p", "Once upon a time",
               "-m", "50", "--block-size", "4", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].startswith(STORY[:60])
    assert out["tokens"] == out["generation_tokens"] == 50
    assert sum(out["acceptance_histogram"].values()) == out["steps"]
    assert all(1 <= int(k) <= 4 for k in out["acceptance_histogram"])
    assert set(out["timings_ms"]) == {"prefill", "decode"}
    for key in ("tau", "prompt_tokens", "prompt_tps", "generation_tps", "peak_memory"):
        assert key in out
    assert out["speculative"] is True and out["reason"] is None
    # Which block-attention path the drafter used, and why (no Metal here: the reference).
    import mlx.core as mx

    if not mx.metal.is_available():
        assert out["block_attention"] == {"block_attention": "reference",
                                          "reason": "Metal is not available (CPU backend)"}
    plain = dflash("--model", str(stories), "-p", "Once upon a time", "-m", "50", "--json", "--quiet")
    plain_out = json.loads(plain.stdout)
    assert plain_out["text"] == out["text"]
    assert plain_out["speculative"] is False and "no drafter" in plain_out["reason"]
    assert plain_out["block_attention"] is None


@needs_shared
@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "dflash"])
def test_json_token_ids_are_mlx_lm_greedy_ids_without_the_stop_token(stories, random_drafter, tmp_path, drafter):
    """'.' (id 426) made a stop id: the reply stops at the first one, which token_ids leave out."""
    from mlx_lm import load

    from conftest import mlx_lm_greedy
    from test_cli_inputs import edited_copy

    folder = edited_copy(stories, tmp_path / "stop-at-period",
                         config=lambda c: json.dumps({**c, "eos_token_id": [2, 426]}))
    model, tokenizer = load(str(stories))
    prompt = tokenizer.encode("Once upon a time")
    ref = mlx_lm_greedy(model, prompt, 40)
    pair = ["--draft-model", str(random_drafter)] if drafter else []
    for path, n, want, finish in ((stories, 30, ref[:30], "length"), (folder, 40, ref[:ref.index(426)], "stop")):
        r = dflash("--model", str(path), *pair, "-p", "Once upon a time", "-m", str(n), "--json", "--quiet")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] == len(prompt) and out["finish_reason"] == finish
        assert 5 < len(want) and out["token_ids"] == want and out["tokens"] == len(want)
        assert tokenizer.decode(out["token_ids"]) == out["text"]


@needs_shared
@pytest.mark.parametrize("args, needle", [
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "9"], "--block-size"),
    (["--top-p", "0"], "--top-p"),
    (["--prompt", "   "], "prompt is empty"),
])
def test_bad_flags_give_one_line_errors(stories, random_drafter, args, needle):
    base = ["--model", str(stories), "--draft-model", str(random_drafter)]
    r = dflash(*base, *(["-p", "Once"] if "--prompt" not in args else []), *args)
    assert r.returncode != 0
    assert needle in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@needs_shared
def test_unsupported_family_is_one_line_not_plain_decoding(stories, tmp_path):
    # smollm3 loads in mlx-lm (llama weights) but has no adapter: refused, no fallback.
    import shutil

    folder = shutil.copytree(stories, tmp_path / "smollm3")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "smollm3"}))
    r = dflash("--model", str(folder), "-p", "Once upon a time", "-m", "5")
    assert r.returncode == 1 and r.stdout == ""
    # (transformers may warn about the copied config on its own line first)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert "model_type 'smollm3' is not supported" in errors[0] and "qwen3_5" in errors[0]


def test_missing_model_folder(tmp_path):
    r = dflash("--model", str(tmp_path / "nope"), "-p", "hi")
    assert r.returncode == 1 and str(tmp_path / "nope") in r.stderr and "Traceback" not in r.stderr


def test_default_pair_offline_names_both_repos(tmp_path):
    r = dflash("-p", "hi", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert r.returncode == 1
    assert "Qwen/Qwen3-4B" in r.stderr and "z-lab/Qwen3-4B-DFlash-b16" in r.stderr and "--model DIR" in r.stderr


def test_help_teaches():
    r = dflash("--help")
    assert r.returncode == 0
    for flag in ("--model", "--draft-model", "--max-tokens", "--temp", "--block-size", "--json"):
        assert flag in r.stdout


@needs_shared
def test_draft_window_and_rule_in_json(stories, random_drafter):
    r = dflash("--model", str(stories), "--draft-model", str(random_drafter), "-p", "Once upon a time",
               "-m", "30", "--draft-window", "2,8", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].startswith(STORY[:60])  # greedy: the target's own text
    assert (out["drafter_format"], out["acceptance_rule"], out["block_size"]) == ("DFlashDraftModel", "greedy", 8)
    r = dflash("--model", str(stories), "--draft-model", str(random_drafter), "-p", "Once upon a time",
               "-m", "10", "--temp", "0.8", "--seed", "1", "--json", "--quiet")
    assert r.returncode == 0 and json.loads(r.stdout)["acceptance_rule"] == "sample-and-match"
    bad = dflash("--model", str(stories), "--draft-model", str(random_drafter), "-p", "x", "--draft-window", "64")
    assert bad.returncode == 1 and bad.stderr.startswith("error: --draft-window 64")
