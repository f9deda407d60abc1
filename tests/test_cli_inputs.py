"""Inputs a new user gives the CLI: bytes that are not UTF-8, prompts past the context,
top-k past the vocabulary, broken config.json files, a drafter passed as the target,
a system prompt or template config without a chat template, and the end token of `dflash data`."""

import json
import re
import shutil

import numpy as np
import pytest

from conftest import dflash as run_dflash, needs_shared
from dflash_mlx import CheckpointError, ConfigError, load_target
from dflash_mlx.train.data import load_sequences, response_end_token

STORY = ", there was a little girl named Lily."


def dflash(*args, stdin=None):
    return run_dflash(*args, input=stdin)


def text(r):
    return r.stdout.decode(), r.stderr.decode()


def one_line_error(r, *needles):
    out, err = text(r)
    assert r.returncode == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def edited_copy(src, dst, config=None, tokenizer_config=None):
    """A copy of a model folder with config.json / tokenizer_config.json edited."""
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if edit is not None:
            path = dst / name
            path.write_text(edit(json.loads(path.read_text())))
    return dst


# --- prompts that are not UTF-8 -----------------------------------------------------

@needs_shared
@pytest.mark.parametrize("where", ["stdin", "flag"])
def test_invalid_utf8_prompt_is_replaced_with_a_warning(stories, where):
    raw = b"Once upon a \xff\xfe time"
    args = ["generate", "--model", str(stories), "-m", "8", "--quiet"]
    r = dflash(*args, stdin=raw) if where == "stdin" else dflash(*args, b"-p", raw)
    out, err = text(r)
    assert r.returncode == 0, err
    assert err == "warning: the prompt is not valid UTF-8: the invalid bytes were replaced by U+FFFD\n"
    assert out.strip()


@needs_shared
def test_invalid_utf8_chat_line_is_replaced_with_a_warning(stories):
    r = dflash("chat", "--model", str(stories), "-m", "8", stdin=b"Once upon a \xff time\n/stats\n")
    out, err = text(r)
    assert r.returncode == 0, err
    assert "the line is not valid UTF-8" in err and "Traceback" not in err
    assert "Turns: 1 (0 interrupted)" in out


# --- the context ------------------------------------------------------------------

@needs_shared
def test_prompt_longer_than_the_context_is_refused(stories):
    r = dflash("generate", "--model", str(stories), "-p", "Once upon a time. " * 120)
    one_line_error(r, "the prompt is 602 tokens", "context (max_position_embeddings) is 512")


@needs_shared
def test_reply_is_capped_at_the_context_with_a_warning(stories):
    r = dflash("generate", "--model", str(stories), "-p", "Once upon a time. " * 90, "-m", "200",
               "--json", "--quiet")
    out, err = text(r)
    assert r.returncode == 0, err
    result = json.loads(out)
    left = 512 - result["prompt_tokens"]
    assert err.startswith(f"warning: at most {left} tokens will be generated") and err.count("\n") == 1
    assert 0 < result["generation_tokens"] == left < 200


@needs_shared
@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "512"], "--max-tokens 512 does not fit the target's context of 512"),
    (["--max-length", "600"], "--max-length 600 is past the target's context of 512"),
])
def test_data_lengths_past_the_context_are_refused(stories, tmp_path, args, needle):
    r = dflash("data", "--model", str(stories), "--self-prompts", "2", "--out", str(tmp_path / "d"), *args)
    one_line_error(r, needle)
    assert not (tmp_path / "d").exists()


# --- top-k ------------------------------------------------------------------------

@needs_shared
def test_top_k_at_or_past_the_vocabulary_is_off(stories, random_drafter):
    base = ["generate", "--model", str(stories), "--draft-model", str(random_drafter), "-p", "Once upon a time",
            "-m", "30", "--temp", "1.0", "--seed", "3", "--quiet", "--block-size", "8"]  # auto: draws follow timings
    outs = []
    for k in ("0", "512", "100000"):  # the vocabulary is 512
        r = dflash(*base, "--top-k", k)
        assert r.returncode == 0, r.stderr.decode()
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2]
    r = dflash("chat", "--model", str(stories), "--top-k", "100000", "--temp", "1", "-m", "8",
               stdin=b"Once upon a time\n")
    assert r.returncode == 0 and b"Traceback" not in r.stderr


def test_effective_top_k():
    from dflash_mlx.sampling import effective_top_k

    assert [effective_top_k(k, 512) for k in (0, 1, 511, 512, 10**6)] == [0, 1, 511, 0, 0]
    assert effective_top_k(5, None) == 5


# --- config.json that cannot be read --------------------------------------------------

@needs_shared
@pytest.mark.parametrize("edit, needle", [
    (lambda c: json.dumps(c)[:-4], "invalid JSON"),
    (lambda c: json.dumps([c]), "expected a JSON object, found list"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "model_type"}), "missing key 'model_type'"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}), "cannot build the target model"),
    (lambda c: json.dumps({**c, "hidden_size": "wide"}), "cannot build the target model"),
])
def test_bad_target_config_names_the_file(stories, tmp_path, edit, needle):
    folder = edited_copy(stories, tmp_path / "target", config=edit)
    with pytest.raises(ConfigError) as e:
        load_target(str(folder))
    assert str(folder / "config.json") in str(e.value) and needle in str(e.value)
    r = dflash("generate", "--model", str(folder), "-p", "hi")
    one_line_error(r, str(folder / "config.json"), needle)


def test_drafter_passed_as_the_target(random_drafter):
    with pytest.raises(CheckpointError, match="this is a DFlash drafter, not a target model; pass it as --draft-model"):
        load_target(str(random_drafter))
    r = dflash("generate", "--model", str(random_drafter), "-p", "hi")
    one_line_error(r, str(random_drafter), "pass it as --draft-model")


def test_a_mistyped_local_path_is_not_found_not_a_repo_to_download(tmp_path):
    """`--model models/nonexist` where `models/` is a local folder: a local path that is not there, not a
    Hugging Face repo id to fetch."""
    (tmp_path / "models").mkdir()
    r = run_dflash("generate", "--model", "models/nonexist", "-p", "hi", cwd=tmp_path)
    one_line_error(r, "models/nonexist: target model folder not found")
    assert "hf download" not in text(r)[1]


@pytest.mark.parametrize("config", [
    {"architectures": ["DFlash2DraftModel"]},
    {"architectures": ["MuseGlimmerAssistantModel"]},
    {"architectures": ["Qwen3ForCausalLM"], "dflash_config": {}},
])
def test_drafter_formats_are_recognised(config):
    from dflash_mlx.pair.loading import is_drafter_config

    assert is_drafter_config(config)
    assert not is_drafter_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})


# --- system prompt ------------------------------------------------------------------

@needs_shared
def test_system_prompt_without_a_template_warns_and_goes_first(stories):
    r = dflash("generate", "--model", str(stories), "--system-prompt", "The dragon slept.", "-p", "Once upon a time",
               "-m", "5", "--json", "--quiet")
    out, err = text(r)
    assert r.returncode == 0, err
    assert err == ("warning: this model has no chat template: the --system-prompt text goes before the prompt "
                   "as plain text\n")
    # BOS + "The dragon slept." + newline + "Once upon a time", as `dflash chat` renders it
    from mlx_lm import load

    _, tokenizer = load(str(stories))
    assert json.loads(out)["prompt_tokens"] == len(tokenizer.encode("The dragon slept.\nOnce upon a time"))
    r = dflash("chat", "--model", str(stories), "--system-prompt", "The dragon slept.", "-m", "5",
               stdin=b"Once upon a time\n")
    assert r.returncode == 0 and "no chat template" in text(r)[1]


@needs_shared
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_template_config_without_a_template_warns_once(stories, command):
    args = ["-p", "Once upon a time", "--json", "--quiet"] if command == "generate" else []
    r = dflash(command, "--model", str(stories), "-m", "5", "--chat-template-config", '{"enable_thinking": true}',
               *args, stdin=None if command == "generate" else b"Once upon a time\n")
    out, err = text(r)
    assert r.returncode == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: this model has no chat template: --chat-template-config is not used"], err
    r = dflash(command, "--model", str(stories), "-m", "5", *args,
               stdin=None if command == "generate" else b"Once upon a time\n")
    assert "warning: " not in text(r)[1]  # not without the flag


# --- the end token of regenerated responses --------------------------------------------

class FakeTokenizer:
    """Bytes as tokens; the template closes an assistant turn with the byte 9 (a tab)."""

    def __init__(self, template=True, eos=(0, 5, 9), eos_token_id=5, end="\t\n"):
        self.has_chat_template, self.eos_token_ids, self.eos_token_id, self.end = template, set(eos), eos_token_id, end

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}> {m['content']}{self.end}" for m in messages)


def test_response_end_token():
    # The template's own end of turn, when it is an EOS id: not the eos_token_id, not the smallest.
    assert response_end_token(FakeTokenizer(), templated=True) == 9
    # Past a leading space the template puts before it.
    assert response_end_token(FakeTokenizer(end=" \t"), templated=True) == 9
    # Not rendered with the template, no template, or a template end that is no EOS id.
    assert response_end_token(FakeTokenizer(), templated=False) == 5
    assert response_end_token(FakeTokenizer(template=False), templated=True) == 5
    assert response_end_token(FakeTokenizer(end="\n"), templated=True) == 5
    assert response_end_token(FakeTokenizer(eos_token_id=None), templated=False) == 0
    assert response_end_token(FakeTokenizer(eos=(), eos_token_id=None), templated=False) is None


@needs_shared
def test_data_ends_responses_with_the_templates_end_token(stories, tmp_path):
    """A template closing turns with </s> (id 2), a tokenizer whose eos_token is <unk>
    (id 0), and '.' (id 426) as a third stop id so responses finish early."""
    template = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %} {% endif %}"
    folder = edited_copy(stories, tmp_path / "chat-stories",
                         config=lambda c: json.dumps({**c, "eos_token_id": [2, 426]}),
                         tokenizer_config=lambda c: json.dumps({**c, "eos_token": "<unk>", "chat_template": template}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Once upon a time", "Tom had a ball"]))
    r = dflash("data", "--model", str(folder), "--prompts", str(prompts), "--self-prompts", "2",
               "--self-prompt-tokens", "8", "--max-tokens", "64", "--out", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr.decode()
    seqs = load_sequences(tmp_path / "data")
    assert len(seqs) == 4
    finished = [(i, s) for i, s in enumerate(seqs) if s.tokens.size - s.response_start < 64]
    assert {i for i, _ in finished} >= {0, 1}  # the templated prompts stop at a '.'
    for i, s in finished:
        # templated rows end with the template's </s>; self-sampled openings with eos_token <unk>
        assert s.tokens[-1] == (2 if i < 2 else 0), (i, s.tokens[-4:])
        assert not np.isin(s.tokens[s.response_start:-1], [2, 426]).any()


# --- stop strings -----------------------------------------------------------------------

@needs_shared
def test_generate_stops_at_the_first_stop_string(stories, random_drafter):
    base = ["generate", "--model", str(stories), "-p", "Once upon a time", "-m", "60", "--quiet"]
    r = dflash(*base, "--draft-model", str(random_drafter), "--stop", "little", "--stop", "Lily", "--json")
    out = json.loads(text(r)[0])
    assert out["text"] == ", there was a " and out["finish_reason"] == "stop"
    assert out["generation_tokens"] < 10
    r = dflash(*base, "--stop", "girl")  # plain decoding, streamed text
    assert text(r)[0] == ", there was a little \n"
    r = dflash(*base, "--stop", "\\n\\n")  # escapes expanded: no blank line in 60 tokens
    assert r.returncode == 0 and text(r)[0].startswith(STORY)
    one_line_error(dflash(*base, "--stop", ""), "--stop needs a non-empty text")


@needs_shared
def test_chat_stop_applies_to_every_reply(stories, random_drafter):
    r = dflash("chat", "--model", str(stories), "--draft-model", str(random_drafter), "-m", "40",
               "--stop", "named", stdin=b"Once upon a time\nOnce upon a time\n/stats\n")
    out, err = text(r)
    assert r.returncode == 0, err
    assert out.startswith(", there was a little girl \n, there was a little girl \n")
    n, target, drafter = re.search(r"Cache: (\d+) tokens of \d+ \(target (\d+), drafter (\d+)\)", out).groups()
    assert n == target == drafter  # both caches hold the conversation the history renders


@needs_shared
def test_auto_and_tree_budget_report_the_verifies_chosen(stories, random_drafter):
    base = ["generate", "--model", str(stories), "--draft-model", str(random_drafter), "-p", "Once upon a time",
            "-m", "40", "--json", "--quiet"]
    plain = dflash("generate", "--model", str(stories), "-p", "Once upon a time", "-m", "40", "--json", "--quiet")
    cases = [([], "auto"), (["--tree-budget", "16"], 8), (["--tree-budget", "auto"], "auto"), (["--block-size", "4"], 4)]
    for extra, verify_block in cases:  # a fixed tree budget fixes the verify: trees drafted at B=8
        r = dflash(*base, *extra)
        assert r.returncode == 0, r.stderr.decode()
        out = json.loads(r.stdout)
        assert out["text"] == json.loads(plain.stdout)["text"]  # greedy: the target's own text
        assert sum(out["widths"].values()) > 0 and set(out["mode_ms"]) <= {"plain", "chain", "tree"}
        assert out["verify"]["block_size"] == verify_block
        if extra == ["--tree-budget", "16"]:
            assert set(out["widths"]) == {"tree 16"}


@needs_shared
@pytest.mark.parametrize("flags,message", [
    (["--seed", "-1"], "error: invalid value for '--seed': input should be greater than or equal to 0, got '-1' "
                       "(see dflash generate --help)"),
    (["--tree-budget", "0"], "error: --tree-budget must be a node count >= 1 or 'auto', got 0 "
                             "(see dflash generate --help)"),
    (["--tree-budget", "many"], "error: --tree-budget must be a node count >= 1 or 'auto', got 'many' "
                                "(see dflash generate --help)"),
    (["--block-size", "big"], "error: --block-size must be an integer or 'auto', got 'big' "
                              "(see dflash generate --help)"),
])
def test_bad_block_size_or_tree_budget_is_one_line(flags, message, tmp_path):
    r = dflash("generate", "--model", str(tmp_path), "--draft-model", str(tmp_path), "-p", "x", *flags)
    assert r.returncode == 1 and r.stderr.decode().strip() == message


def test_tree_budget_needs_a_drafter(tmp_path):
    r = dflash("generate", "--model", str(tmp_path), "-p", "x", "--tree-budget", "8")
    assert r.returncode == 1
    assert r.stderr.decode().strip() == "error: --tree-budget needs --draft-model (plain decoding has no drafts)"
