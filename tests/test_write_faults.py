"""Every write can fail, and clean-up touches only what dflash-mlx wrote.

Faults are injected at the one write helper's rename (``os.replace``) with each errno, and
at ``mx.save_safetensors`` with MLX's RuntimeError (tests run as root, where a read-only
folder does not stop writes). The outcome checked: one warning, and a degraded mode that
keeps working (the prompt cache memory-only with the same tokens, the chat session kept
in memory and written at the next line); for convert and train, a one-line error.
"""

import errno
import os
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx import generate_step
from dflash_mlx.atomic import WriteError
from conftest import pair_cache as PairCache
from dflash_mlx.chat.session_file import SessionWriter, read_session
from dflash_mlx.errors import InputError
from dflash_mlx.owned import MARKER, claim
from dflash_mlx.prompt_cache.key import key_id, pair_key
from dflash_mlx.prompt_cache.store import PrefixStore
from conftest import ByteTokenizer, dflash as run_dflash, needs_shared, tiny_drafter, tiny_target

ERRNOS = [errno.EACCES, errno.ENOSPC, errno.EIO, errno.EROFS]
FAULTS = [errno.errorcode[e] for e in ERRNOS] + ["mlx RuntimeError"]
PROMPT = [(5 * i) % 200 + 3 for i in range(40)]
real_replace = os.replace


def inject(monkeypatch, fault, under: Path):
    """From now on, writes under ``under`` fail with ``fault``."""
    if fault == "mlx RuntimeError":
        def save(path, *a, **k):
            raise RuntimeError(f"[save] Failed to open file {path}")
        monkeypatch.setattr(mx, "save_safetensors", save)
        monkeypatch.setattr(mx, "savez", save)
        return
    code = getattr(errno, fault)

    def replace(src, dst, *a, **k):
        if str(dst).startswith(str(under)):
            raise OSError(code, os.strerror(code), str(dst))
        return real_replace(src, dst, *a, **k)
    monkeypatch.setattr(os, "replace", replace)


@pytest.fixture(scope="module")
def pair():
    _, target = tiny_target("llama")
    return target, tiny_drafter(target)


def cold(target, drafter, ids, n):
    steps = generate_step(mx.array(ids, dtype=mx.int32), target, drafter, max_tokens=n, block_size=4)
    return [t for s in steps for t in s.tokens]


def run(pc, ids, n):
    return [t for r in pc.stream(ids, max_tokens=n, block_size=4) for t in r.tokens]


# -- the prompt cache --------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_prompt_cache_write_goes_memory_only_with_one_warning(pair, fault, tmp_path, monkeypatch):
    target, drafter = pair
    warnings = []
    store = PrefixStore(tmp_path, warn=warnings.append)
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)
    first = run(pc, PROMPT, 8)
    assert store.state == f"disk ({tmp_path})" and not warnings
    inject(monkeypatch, fault, tmp_path)  # the folder fails mid-run
    reused = []
    for i, ids in enumerate([[9, 8, 7] * 5, PROMPT + first + [4, 5], [1, 2, 3, 4]]):
        assert run(pc, ids, 8) == cold(target, drafter, ids, 8), i  # still decodes, the same tokens
        reused.append((pc.last_reused, pc.last_source))
    assert len(warnings) == 1 and warnings[0].startswith("prompt cache: cannot write under ")
    assert "keeping entries in memory only" in warnings[0] and "\n" not in warnings[0]
    assert store.state.startswith("memory-only (cannot write under ")
    assert reused[1][0] > len(PROMPT) and reused[1][1] == "memory"  # the memory level still answers
    assert not [p for p in tmp_path.rglob(".*tmp-*")]  # no temporaries left behind


def test_an_entry_whose_json_cannot_be_written_leaves_no_arrays_behind(pair, tmp_path, monkeypatch):
    """The arrays file is renamed into place first; when the JSON that commits it fails,
    the arrays go too: no half-written entry stays for a later process to find."""
    target, drafter = pair
    warnings = []
    store = PrefixStore(tmp_path, warn=warnings.append)
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)

    def replace(src, dst, *a, **k):
        if str(dst).endswith(".json") and str(dst).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_replace(src, dst, *a, **k)
    monkeypatch.setattr(os, "replace", replace)
    assert run(pc, PROMPT, 8) == cold(target, drafter, PROMPT, 8)
    assert len(warnings) == 1 and store.state.startswith("memory-only (")
    assert not list(tmp_path.rglob("*.safetensors"))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_batched_server_keeps_answering_after_a_failed_write(pair, fault, tmp_path, monkeypatch):
    """The prompt cache's folder fails while serving with --max-batch: every later request
    is answered with its solo tokens, and /health says the cache is memory-only."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from dflash_mlx.serve.app import ServerConfig, create_app

    target, drafter = pair

    class Tokenizer(ByteTokenizer):
        has_chat_template = False

    served = SimpleNamespace(model=None, target=target, tokenizer=Tokenizer(), draft_path="tiny", drafter=drafter)
    warnings = []
    store = PrefixStore(tmp_path, warn=warnings.append)
    app = create_app(served, ServerConfig(model_id="tiny", max_batch=4, block_size=4, prompt_store=store))
    prompts = [PROMPT, [9, 8, 7] * 5, PROMPT[:30] + [1, 1]]
    with TestClient(app) as c:
        post = lambda ids: c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 8})  # noqa: E731
        assert post(prompts[0]).status_code == 200
        assert c.get("/health").json()["prompt_cache"] == f"disk ({tmp_path})"
        inject(monkeypatch, fault, tmp_path)
        replies = [post(ids) for ids in prompts]
        health = c.get("/health").json()
    assert [r.status_code for r in replies] == [200] * 3
    for ids, r in zip(prompts, replies):
        assert r.json()["choices"][0]["text"] == Tokenizer().decode(cold(target, drafter, ids, 8))
    assert health["status"] == "ok" and health["prompt_cache"].startswith("memory-only (cannot write under ")
    assert len(warnings) == 1


FOREIGN = {"model.safetensors": b"weights", "config.json": b"{}", "stories/model.safetensors": b"w2",
           "0123456789abcdef01234567/0123456789abcdef01234567.safetensors": b"named like ours",
           "0123456789abcdef01234567/.0123456789abcdef01234567.safetensors.tmp-1.safetensors": b"also"}


def snapshot(root: Path):
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_folder_of_models_given_as_the_prompt_cache_keeps_every_file(pair, tmp_path):
    target, drafter = pair
    for name, data in FOREIGN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    before = snapshot(tmp_path)
    store = PrefixStore(tmp_path, max_bytes=1)  # every write is evicted at once
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)
    run(pc, PROMPT, 8)
    store.evict()
    PrefixStore(tmp_path)  # a later process's start-up clean-up
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k.parts[0] != "dflash-prompt-cache"} == before
    assert store.root == tmp_path / "dflash-prompt-cache" and (store.root / MARKER).is_file()


def test_a_subfolder_of_others_is_refused_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "dflash-prompt-cache").mkdir()
    (tmp_path / "dflash-prompt-cache" / "x").write_text("also mine")
    with pytest.raises(InputError, match=r"^--prompt-cache-dir .* holds files of others, and so does .*; give"):
        PrefixStore(tmp_path)


def test_folders_named_like_entries_do_not_stop_start_up(pair, tmp_path):
    target, drafter = pair
    kid = key_id(pair_key(target, drafter))
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name, other = "0123456789abcdef01234567", "89abcdef0123456789abcdef"
    claim(tmp_path, "prompt-cache", "--prompt-cache-dir")
    odds = (f"{name}.safetensors", f".{name}.safetensors.tmp-{dead.pid}.safetensors", f"{other}.json")
    for odd in odds:  # an arrays file without its JSON, a dead writer's temporary, an index
        (tmp_path / kid / odd).mkdir(parents=True)
    warnings = []
    store = PrefixStore(tmp_path, memory_entries=0, warn=warnings.append)
    pc = PairCache(target, ByteTokenizer(), drafter, store=store)
    assert run(pc, PROMPT, 8) == cold(target, drafter, PROMPT, 8)
    later = PairCache(target, ByteTokenizer(), drafter, store=PrefixStore(tmp_path, memory_entries=0))
    assert run(later, PROMPT + [4], 4) == cold(target, drafter, PROMPT + [4], 4) and later.last_reused > 0
    assert all((tmp_path / kid / odd).is_dir() for odd in odds)
    assert store.degraded is None and not warnings


def test_a_prompt_cache_that_cannot_be_claimed_is_memory_only(pair, tmp_path, monkeypatch):
    inject(monkeypatch, "EROFS", tmp_path)
    warnings = []
    store = PrefixStore(tmp_path / "new", warn=warnings.append)
    assert store.state.startswith("memory-only (cannot write under ") and len(warnings) == 1
    target, drafter = pair
    assert run(PairCache(target, ByteTokenizer(), drafter, store=store), PROMPT, 8) == cold(target, drafter, PROMPT, 8)


# -- chat sessions -------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS[:-1])
def test_a_session_write_that_fails_warns_once_and_is_retried(fault, tmp_path, monkeypatch):
    path = tmp_path / "chat.json"
    said = []
    writer = SessionWriter(path, said.append)
    messages = [{"role": "user", "content": "hi"}]
    assert writer.save(messages)
    with monkeypatch.context() as m:
        inject(m, fault, tmp_path)
        messages.append({"role": "assistant", "content": "hello"})
        assert not writer.save(messages) and not writer.save(messages)
    assert len(said) == 1 and said[0].startswith(f"warning: --session {path}: cannot write (")
    assert read_session(path) == messages[:1]  # the previous file whole
    assert writer.save(messages) and read_session(path) == messages
    assert said[1:] == [f"--session {path}: written again"]


def test_a_session_with_a_lone_surrogate_is_a_one_line_error(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"format": "dflash-chat-session", "messages": [{"role": "user", "content": "a \\ud800"}]}')
    with pytest.raises(InputError, match=r"^--session .*: messages\[0\]\.content holds a lone surrogate"):
        read_session(path)


def test_write_error_carries_any_errno_and_the_path(tmp_path, monkeypatch):
    from dflash_mlx.atomic import atomic_file

    inject(monkeypatch, "ENOSPC", tmp_path)
    with pytest.raises(WriteError) as e:
        with atomic_file(tmp_path / "f") as tmp:
            tmp.write_text("x")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "f")
    assert list(tmp_path.iterdir()) == []


# -- through the CLI ---------------------------------------------------------------


def dflash(*args, stdin=None):
    return run_dflash(*args, input=stdin, text=True)


@needs_shared
def test_generate_with_a_folder_of_models_as_prompt_cache_keeps_the_models(stories, random_drafter, tmp_path):
    import shutil

    models = tmp_path / "models"
    shutil.copytree(stories, models / "stories")
    shutil.copytree(random_drafter, models / "drafter")
    before = snapshot(models)
    args = ["generate", "--model", str(models / "stories"), "--draft-model", str(models / "drafter"), "-m", "8",
            "--prompt-cache-dir", str(models)]
    for prompt in ("Once upon a time", "Once upon a time there"):
        r = dflash(*args, "-p", prompt)
        assert r.returncode == 0, r.stderr
    after = snapshot(models)
    assert {k: v for k, v in after.items() if k.parts[0] != "dflash-prompt-cache"} == before
    assert any(k.suffix == ".safetensors" for k in after if k.parts[0] == "dflash-prompt-cache")


@needs_shared
def test_chat_with_a_session_that_cannot_be_written_runs_every_line(stories, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    session = blocker / "chat.json"  # ENOTDIR at every write
    r = dflash("chat", "--model", str(stories), "--max-tokens", "5", "--session", str(session), "--no-prompt-cache",
               stdin="Once upon a time\n/stats\nThe next day\n")
    assert "Traceback" not in r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: --session")]
    assert len(warnings) == 1 and "kept in memory" in warnings[0]
    assert r.stdout.count("Generation:") == 1 and r.stderr.count(" reused\n") == 2  # every line ran
    assert r.stderr.strip().splitlines()[-1] == f"error: --session {session}: the conversation was not written"
    assert r.returncode == 1


# -- train and convert: the write is the job, so a one-line error -------------------


def trained_one_step(out: Path):
    """A tiny run into ``out`` that checkpoints every step, after its first: (trainer, its steps, the checkpoints)."""
    from dflash_mlx.train.trainer import TrainConfig, Trainer
    from dflash_mlx.train.start import init_drafter
    from conftest import tiny_training_set

    _, target, seqs = tiny_training_set(4, 24)
    drafter = init_drafter(target, mask_token_id=0, layers=1, block_size=4, target_layer_ids=[1, 2], seed=0)
    trainer = Trainer(drafter, target, seqs, TrainConfig(steps=3, anchors=4, save_every=1), out)
    steps = trainer.run()
    assert next(steps).step == 1
    return trainer, steps, snapshot(out / "checkpoints")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_checkpoint_that_cannot_be_written_keeps_the_earlier_one(fault, tmp_path, monkeypatch):
    from dflash_mlx import load_drafter

    trainer, steps, first = trained_one_step(tmp_path)
    inject(monkeypatch, fault, tmp_path)
    with pytest.raises(WriteError) as e:
        next(steps)
    assert e.value.filename and e.value.strerror and "\n" not in str(e.value)
    assert trainer.step == 2  # the in-memory state goes on
    assert snapshot(tmp_path / "checkpoints") == first  # no half checkpoint, the earlier one whole
    monkeypatch.undo()
    load_drafter(str(tmp_path / "checkpoints" / "step_0000001"))


@pytest.mark.parametrize("entry", ["first", "last"])
def test_ctrl_c_while_the_optimizer_state_is_written_stops_the_run(entry, tmp_path, monkeypatch):
    """``mx.savez`` writes through Python's zipfile from C++, where a KeyboardInterrupt raised as an entry closes is
    lost: in the first entry it becomes a ValueError, in the last savez returns with optimizer.npz unfinished. Held
    over the write, it stops the run after it: no half checkpoint, the earlier one whole and loadable."""
    import signal
    import zipfile

    from dflash_mlx import load_drafter
    from mlx.utils import tree_flatten

    trainer, steps, first = trained_one_step(tmp_path)
    entries = len(tree_flatten(trainer.optimizer.state))
    assert entries > 2
    closed, close = [], zipfile._ZipWriteFile.close

    def ctrl_c_as_it_closes(self):
        closed.append(1)
        if len(closed) == (1 if entry == "first" else entries):
            signal.raise_signal(signal.SIGINT)  # runs the handler inside this Python frame, under mx.savez
        return close(self)

    monkeypatch.setattr(zipfile._ZipWriteFile, "close", ctrl_c_as_it_closes)
    with pytest.raises(KeyboardInterrupt):
        next(steps)
    assert len(closed) == entries  # the write ran to its end before the interrupt
    monkeypatch.undo()
    assert snapshot(tmp_path / "checkpoints") == first
    load_drafter(str(tmp_path / "checkpoints" / "step_0000001"))
    assert len(mx.load(str(tmp_path / "checkpoints" / "step_0000001" / "optimizer.npz"))) == entries


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from hf_checkpoints import write_drafter, write_hf_target

    root = tmp_path_factory.mktemp("hf-qwen3")
    return write_hf_target(root / "target", "qwen3"), write_drafter(root / "drafter", "qwen3")


@pytest.mark.parametrize("fault", FAULTS[:-1])
def test_convert_that_cannot_write_is_a_one_line_error(hf_pair, fault, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    out = tmp_path / "out"
    inject(monkeypatch, fault, tmp_path)
    r = CliRunner().invoke(app, ["convert", "--model", str(hf_pair[0]), "--draft-model", str(hf_pair[1]),
                                 "--out", str(out), "--no-validate"])
    assert r.exit_code == 1 and not isinstance(r.exception, (OSError, RuntimeError)), r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and os.strerror(getattr(errno, fault)) in last, r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half-written left


# -- bench results -------------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize("fault", FAULTS[:-1])
def test_bench_results_that_cannot_be_written_still_print(stories, random_drafter, fault, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from dflash_mlx.cli.app import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    out = tmp_path / "out"
    inject(monkeypatch, fault, out)
    r = CliRunner().invoke(app, ["bench", "--model", str(stories), "--draft-model", str(random_drafter), "--dataset",
                                 str(prompts), "-n", "1", "-m", "8", "--warmup-tokens", "0", "--no-plots",
                                 "--out", str(out)])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "dflash B=" in r.output  # the table
    warnings = [line for line in r.output.splitlines() if line.startswith("warning: cannot write")]
    assert len(warnings) == 1 and os.strerror(getattr(errno, fault)) in warnings[0], r.output
    assert not (out / "results.json").exists()


def test_train_overwrite_deletes_only_a_training_runs_files(tmp_path):
    from dflash_mlx.train.trainer import check_fresh_out

    for name in ("config.json", "model.safetensors"):  # a model folder given as --out
        (tmp_path / name).write_text(name)
    with pytest.raises(InputError, match=r"did not write \(no \.dflash-mlx\); --overwrite deletes only"):
        check_fresh_out(tmp_path, overwrite=True)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_a_prompt_cache_written_before_marks_is_still_used(pair, tmp_path):
    target, drafter = pair
    run(PairCache(target, ByteTokenizer(), drafter, store=PrefixStore(tmp_path, memory_entries=0)), PROMPT, 8)
    (tmp_path / MARKER).unlink()  # as an earlier version left it
    store = PrefixStore(tmp_path, memory_entries=0)
    assert store.root == tmp_path and (tmp_path / MARKER).is_file()
    later = PairCache(target, ByteTokenizer(), drafter, store=store)
    run(later, PROMPT + [4], 4)
    assert later.last_source == "disk"
    assert not (tmp_path / "dflash-prompt-cache").exists()
