"""One-line errors where an unlucky user used to get a traceback or a wrong error:
closed stdin/stdout, a full disk behind stdout, prompt files that are not UTF-8 or
hold a message without content, --out under a file, a config's torch_dtype that names
no float type (issue 23)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import dflash as run_dflash
from dflash_mlx import ConfigError, load_target
from dflash_mlx.errors import InputError
from dflash_mlx.train.data import prompts_from_text, read_prompt_file


def dflash(*args, **popen):
    return run_dflash(*args, **popen)


def one_line_error(r, *needles, progress=False):
    """Exit 1 and one "error: " line on stderr (the last one after convert's progress lines)."""
    err = r.stderr.decode()
    if progress:
        assert "Traceback" not in err, err
        err = err.splitlines()[-1] + "\n"
    assert r.returncode == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


# -- standard streams ----------------------------------------------------------------


def test_closed_stdin_is_named(stories):
    r = dflash("generate", "--model", str(stories), "-m", "4", preexec_fn=lambda: os.close(0))
    one_line_error(r, "standard input is closed", "--prompt")


def test_closed_stdin_does_not_break_loading(stories):
    """With fd 0 closed, the weights file would get fd 0 (MLX then fails to read it)."""
    r = dflash("generate", "--model", str(stories), "-p", "Once", "-m", "4", "--quiet",
               preexec_fn=lambda: os.close(0))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip()


def test_closed_stdout_is_named(stories):
    r = dflash("generate", "--model", str(stories), "-p", "Once", "-m", "4", stdout=None,
               preexec_fn=lambda: os.close(1))
    one_line_error(r, "standard output is closed")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("json_out", [False, True])
def test_full_stdout_is_one_line(stories, json_out):
    with open("/dev/full", "w") as full:
        r = dflash("generate", "--model", str(stories), "-p", "Once", "-m", "4", *(["--json"] if json_out else []),
                   stdout=full)
    one_line_error(r, "cannot write to standard output", "No space left")


# -- dflash data / train inputs ----------------------------------------------------------


def test_prompt_file_not_utf8(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "Once \xff upon"}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: not UTF-8 text \(byte 0xff at offset 34\)"):
        read_prompt_file(path)


def test_text_file_not_utf8(tmp_path):
    import numpy as np

    path = tmp_path / "t.txt"
    path.write_bytes(b"Once upon a \xfe time\n")
    with pytest.raises(InputError, match=r"t.txt:1: not UTF-8 text"):
        prompts_from_text(path, np.random.default_rng(0))


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "user"}], "messages[0] has no 'content' string"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": None}], "messages[1] has no 'content'"),
    (["hi"], "messages[0] must be an object with a 'role' string"),
])
def test_message_without_content(tmp_path, messages, needle):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(InputError) as e:
        read_prompt_file(path)
    assert f"{path}:1: {needle}" in str(e.value)


def test_data_cli_bad_prompt_files(stories, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "\xff"}\n')
    r = dflash("data", "--model", str(stories), "--prompts", str(bad), "--out", str(tmp_path / "d"))
    one_line_error(r, f"{bad}:1: not UTF-8")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["data", "train", "convert"])
def test_out_under_a_file(stories, random_drafter, tmp_path, command):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub"
    args = {"data": ["--self-prompts", "2", "--max-tokens", "8"], "train": ["--data", str(tmp_path)],
            "convert": ["--draft-model", str(random_drafter)]}[command]
    r = dflash(command, "--model", str(stories), *args, "--out", str(out))
    one_line_error(r, f"--out {out} is under {tmp_path / 'afile'}, which is a file")


# -- config.json ------------------------------------------------------------------


def test_torch_dtype_that_is_no_float_type(stories, random_drafter, tmp_path):
    folder = tmp_path / "target"
    shutil.copytree(stories, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "int7"}))
    with pytest.raises(ConfigError, match=r"config.json: 'torch_dtype' must be one of float16, .* got 'int7'"):
        load_target(str(folder))
    one_line_error(dflash("generate", "--model", str(folder), "-p", "hi"), "'torch_dtype'", "int7")
    r = dflash("convert", "--model", str(folder), "--draft-model", str(random_drafter), "--out", str(tmp_path / "out"))
    one_line_error(r, "'torch_dtype'", "int7", progress=True)
    assert not (tmp_path / "out").exists()
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "torch.bfloat16"}))
    load_target(str(folder))  # the torch. prefix some exporters write is fine


# -- dflash serve's new flags -------------------------------------------------------------


@pytest.mark.parametrize("flag,value,needle", [
    ("--idle-timeout", "0", "--idle-timeout must be > 0, got 0.0"),
    ("--request-timeout", "-1", "--request-timeout must be >= 0, got -1.0"),
    ("--max-prompt-chars", "0", "--max-prompt-chars must be at least 1, got 0"),
])
def test_serve_limits_flags(tmp_path, flag, value, needle):
    one_line_error(dflash("serve", "--model", str(tmp_path / "nowhere"), flag, value), needle)
