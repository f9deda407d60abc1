"""The prompt cache through the CLI on stories260K: a second `dflash generate` process
reuses the first one's prompt from disk with the same text, `--no-prompt-cache` turns it
off, and `dflash chat --session FILE` resumes a conversation without prefilling its history."""

import json
import re

from conftest import dflash as run_dflash, needs_shared

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


def dflash(command, *args, stdin=None):
    return run_dflash(command, *args, input=stdin, text=True)


@needs_shared
def test_a_later_generate_process_reuses_the_prompt_from_disk(stories, random_drafter, tmp_path):
    args = ["--model", str(stories), "--draft-model", str(random_drafter), "-m", "30", "--json", "--quiet",
            "--prompt-cache-dir", str(tmp_path / "prompts")]
    first = json.loads(dflash("generate", *args, "-p", PROMPT).stdout)
    assert first["prompt_tokens_reused"] == 0 and first["prompt_tokens_prefilled"] == first["prompt_tokens"]
    again = dflash("generate", *args, "-p", PROMPT + " in the park.")
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    whole = dflash("generate", *args, "-p", PROMPT + " in the park.", "--no-prompt-cache")
    cold = json.loads(whole.stdout)
    assert second["text"] == cold["text"]
    assert second["prompt_tokens_reused"] >= first["prompt_tokens"] - 2  # all but the last prompt token or two
    assert second["prompt_tokens_reused"] + second["prompt_tokens_prefilled"] == second["prompt_tokens"]
    assert cold["prompt_tokens_reused"] == 0 and cold["prompt_tokens_prefilled"] == cold["prompt_tokens"]


@needs_shared
def test_bad_prompt_cache_flags_are_one_line_errors(stories, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    r = dflash("generate", "--model", str(stories), "-p", "Hi", "--prompt-cache-dir", str(a_file))
    assert r.returncode == 1 and r.stderr.strip() == f"error: --prompt-cache-dir {a_file} is a file, not a folder"
    r = dflash("generate", "--model", str(stories), "-p", "Hi", "--prompt-cache-gb", "0")
    assert r.returncode == 1 and r.stderr.strip() == "error: --prompt-cache-gb must be > 0, got 0.0"


REUSED = re.compile(r"prefill (\d+) tokens?, (\d+) reused")


@needs_shared
def test_chat_session_resumes_in_a_later_process_without_prefilling_the_history(stories, random_drafter,
                                                                               tmp_path):
    session = tmp_path / "chat.json"
    args = ["--model", str(stories), "--draft-model", str(random_drafter), "--max-tokens", "20",
            "--session", str(session), "--prompt-cache-dir", str(tmp_path / "prompts")]
    first = dflash("chat", *args, stdin="Once upon a time\n")
    assert first.returncode == 0, first.stderr
    messages = json.loads(session.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    later = dflash("chat", *args, stdin="The next day\n")
    assert later.returncode == 0, later.stderr
    assert f"resumed 2 messages from {session}" in later.stderr
    prefilled, reused = map(int, REUSED.findall(later.stderr)[-1])
    history = len(messages[0]["content"]) // 8  # far fewer tokens than characters; the history is longer
    assert reused > history and prefilled <= 8, later.stderr
    assert [m["role"] for m in json.loads(session.read_text())["messages"]] == ["user", "assistant"] * 2
    # Without the prompt cache the history is prefilled again.
    cold = dflash("chat", *args, "--no-prompt-cache", stdin="Then\n")
    assert REUSED.findall(cold.stderr)[-1][1] == "0"


@needs_shared
def test_a_session_file_that_is_not_one_is_refused(stories, tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text('{"messages": []}')
    r = dflash("chat", "--model", str(stories), "--session", str(bad), stdin="Hi\n")
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: --session {bad}: not a dflash chat session (\"format\" is not 'dflash-chat-session')"
