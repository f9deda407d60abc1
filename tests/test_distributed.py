"""DFlash on a target sharded over 2 local ranks (`mlx.launch --backend ring -n 2`): rank 0 alone prints, and
the text is the single process's (tensor: generate greedy and seeded-sampled, serve, chat; pipeline: generate);
training on 2 ranks (data parallel) writes the single process's drafter."""

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx
import mlx.core as mx
import pytest

from conftest import ROOT, dflash, openai_client, start_server

BIN = Path(sys.executable).parent
LAUNCH = BIN / "mlx.launch"
DRAFTER = ROOT / "examples" / "stories260K" / "drafter"
TIMEOUT = 600


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


_SINGLE: dict = {}  # the single-process reference runs, shared by the tests in this worker


def _single(args) -> dict:
    """``dflash generate ... --json`` in one process (the reference), run once per argument list."""
    key = tuple(args)
    if key not in _SINGLE:
        done = _run(args, 1)
        assert done.returncode == 0, done.stderr[-2000:]
        _SINGLE[key] = json.loads(done.stdout)
    return _SINGLE[key]


def _launch(ranks: int = 2) -> list:
    """``mlx.launch`` over the ring backend on ports of its own: every launch otherwise listens from port
    32323, and two at once (the test workers run side by side) would connect to each other's ranks. They are
    drawn below Linux's ephemeral range (32768 up), from which the servers' ports (:func:`conftest.free_port`)
    come, so a port probed free here is not handed to a server before the ranks bind it."""
    rng = random.Random()
    for _ in range(100):
        start = rng.randrange(20000, 32000)
        with contextlib.ExitStack() as held:  # the ranks' ports must all be free
            try:
                for port in range(start, start + ranks):
                    held.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--starting-port", str(start), "--"]
    raise RuntimeError(f"no {ranks} free consecutive ports for mlx.launch")


def _run(args, ranks: int, input: Optional[str] = None) -> subprocess.CompletedProcess:
    """The command in one process (:func:`conftest.dflash`) or under ``mlx.launch``, ``input`` on its standard
    input. Under mlx.launch the input stays open until the command exits: at the end of its input mlx.launch polls it without pause and
    takes a whole core from the ranks."""
    if ranks == 1:
        return dflash(*args, input=input, text=True, cwd=ROOT, timeout=TIMEOUT)
    cmd = [*_launch(ranks), str(BIN / "dflash"), *args]
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(cmd, stdin=read, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(), cwd=ROOT)
        os.close(read)
        read = None
        if input:
            os.write(write, input.encode())
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    finally:
        os.close(write)
        if read is not None:
            os.close(read)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """Skips (naming why) where mlx.launch cannot start two ranks that all-sum."""
    if not LAUNCH.is_file():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    probe.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                     "print(g.size(), mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu).item())\n")
    done = subprocess.run([*_launch(), sys.executable, str(probe)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "2 2.0" not in done.stdout:
        pytest.skip(f"mlx.launch --backend ring -n 2 cannot start ranks here: {done.stderr.strip()[-300:]}")


def _generate_args(target, drafter, *extra) -> list:
    """The drafter's verifies and rollbacks on ranks: prompt lookup off, so that copies (the same on every
    rank) take none of their steps; ``extra`` may turn it on."""
    return ["generate", "--model", str(target), "--draft-model", str(drafter), "--prompt", "Once upon a time",
            "--max-tokens", "64", "--no-prompt-cache", "--json", "--quiet", "--prompt-lookup", "off", *extra]


def _generate(stories, ranks: int, *extra):
    if ranks == 1:
        return _single(_generate_args(stories, DRAFTER, *extra))
    done = _run(_generate_args(stories, DRAFTER, *extra), ranks)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    return json.loads(lines[0])


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.8", "--seed", "7", "--block-size", "8"],
                                      ["--temp", "0", "--prompt-lookup", "auto"]], ids=["greedy", "seeded", "lookup"])
def test_two_ranks_print_the_single_process_text(launcher, stories, sampling):
    one = _generate(stories, 1, *sampling)
    two = _generate(stories, 2, *sampling)
    assert one["distributed"] is None
    assert two["distributed"] == {"ranks": 2, "sharding": "tensor"}
    assert two["text"] == one["text"]
    assert two["tau"] > 1
    if "--block-size" not in sampling:  # auto on ranks: rank 0 plans every step; rank 0 printed what ran
        assert two["verify"]["block_size"] == "auto" and len(two["widths"]) >= 2, two["widths"]


def test_other_ranks_say_their_errors_alone():
    """A rank other than 0 keeps its one-line errors (named with the rank) and drops everything else:
    mlx.launch stops rank 0 when rank 1 fails first, and the reason must still reach the user."""
    import io

    from dflash_mlx.pair.sharded import ErrorsOnly

    out = io.StringIO()
    stderr = ErrorsOnly(out, 1)
    for piece in ["warning: slow\nerr", "or: a llama target cannot", " be split\n", "Loading 100%\n"]:
        stderr.write(piece)
    assert out.getvalue() == "error: rank 1: a llama target cannot be split\n"


def test_pipeline_sharding_of_a_family_without_it_is_refused_in_one_line(launcher, stories):
    done = _run(["generate", "--model", str(stories), "--draft-model", str(DRAFTER), "--prompt", "Hi",
                 "--sharding", "pipeline"], 2)
    assert "a llama target cannot be split with --sharding pipeline" in done.stderr, done.stderr[-2000:]  # any rank
    assert "use --sharding tensor" in done.stderr and "Traceback" not in done.stderr  # mlx.launch exits 0


@pytest.fixture(scope="module")
def hybrid_pair(stories, tmp_path_factory):
    """A tiny random qwen3_5 target (Gated-DeltaNet and attention layers) saved as mlx-lm saves it, with
    stories260K's tokenizer, and a random drafter reading its layers 1 and 3."""
    import dataclasses
    import shutil

    from mlx_lm.utils import save_config, save_model

    from conftest import tiny_drafter, tiny_target
    from dflash_mlx import save_drafter

    out = tmp_path_factory.mktemp("qwen3_5")
    model, target = tiny_target("qwen3_5", vocab=512, hidden=64, layers=4)
    save_model(out / "target", model)
    save_config(dataclasses.asdict(model.args), out / "target" / "config.json")
    for f in stories.glob("tokenizer*"):
        shutil.copy(f, out / "target" / f.name)
    return out / "target", save_drafter(tiny_drafter(target, block_size=4), out / "drafter")


@pytest.mark.parametrize("sampling", [["--temp", "0", "--block-size", "4"],
                                      ["--temp", "0.8", "--seed", "7", "--block-size", "4"]], ids=["greedy", "seeded"])
def test_a_pipeline_split_hybrid_target_prints_the_single_process_text(launcher, hybrid_pair, sampling):
    # a fixed block size: every step verifies and rolls back (auto, which decodes a random drafter's target
    # plainly, probed 4 to 6 times in 64 tokens as the machine's timings went); auto on ranks: the test above
    target, drafter = hybrid_pair
    args = _generate_args(target, drafter, *sampling)
    one = _single(args)
    two = _run([*args, "--sharding", "pipeline"], 2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert len(two.stdout.splitlines()) == 1, two.stdout  # rank 0 alone prints
    two = json.loads(two.stdout)
    assert two["distributed"] == {"ranks": 2, "sharding": "pipeline"}
    assert len(set(two["text"])) > 10 and two["text"] == one["text"]  # varied, and the same
    assert two["steps"] > 5 and two["tau"] >= 1  # verify steps ran (a random drafter: each rolls its drafts back)


def test_bench_refuses_several_ranks_in_one_line(launcher, stories):
    done = _run(["bench", "--model", str(stories), "--draft-model", str(DRAFTER), "--dataset", "x.jsonl"], 2)
    assert "error: dflash bench runs in one process, not under mlx.launch" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_a_request_served_on_two_ranks_gets_the_single_process_text(launcher, request, sharding, tmp_path):
    target, drafter = (request.getfixturevalue("stories"), DRAFTER) if sharding == "tensor" else \
        request.getfixturevalue("hybrid_pair")
    one = _single(_generate_args(target, drafter, "--temp", "0"))
    launch = _launch()
    proc, url = start_server(tmp_path / "serve.log", "--model", str(target), "--draft-model", str(drafter),
                             "--sharding", sharding, launch=launch)
    try:
        health = httpx.get(f"{url}/health").json()
        assert health["distributed"] == {"ranks": 2, "sharding": sharding, "max_batch": 1}
        reply = openai_client(url).completions.create(model=str(target), prompt="Once upon a time", max_tokens=64,
                                                      temperature=0)
        assert reply.choices[0].text == one["text"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: rank 0 stops the others
        proc.wait(timeout=TIMEOUT)
    with pytest.raises(ProcessLookupError):  # every rank has exited
        os.killpg(proc.pid, 0)
    log = (tmp_path / "serve.log").read_text()  # mlx.launch prints its own KeyboardInterrupt
    assert str(ROOT / "dflash_mlx") not in log, log[-3000:]


def test_a_chat_on_two_ranks_replies_as_one_process_does(launcher, stories):
    lines = "Once upon a time\nThe cat\n/quit\n"  # mlx.launch never passes on the end of its input
    args = ["chat", "--model", str(stories), "--draft-model", str(DRAFTER), "--max-tokens", "40", "--no-prompt-cache"]
    one, two = (_run(args, ranks, input=lines) for ranks in (1, 2))
    assert two.returncode == 0 and "Traceback" not in two.stderr, two.stderr[-2000:]
    assert len(one.stdout.splitlines()) == 2
    assert two.stdout == one.stdout


def test_two_ranks_train_the_single_process_drafter(launcher, stories, tmp_path):
    """Data parallel: the ranks share each step's --grad-accum sequences and sum their gradients, so the drafter
    and the logged losses are one process's (up to float summation order); rank 0 alone prints and writes."""
    from test_train_cli import regenerate

    regenerate(stories, tmp_path / "data")
    args = ["train", "--model", str(stories), "--data", str(tmp_path / "data"), "--layers", "1", "--block-sizes",
            "4,8", "--steps", "4", "--anchors", "4", "--grad-accum", "4", "--held-out", "4", "--eval-every", "0",
            "--save-every", "2"]
    logs = {}
    for ranks in (1, 2):
        done = _run([*args, "--out", str(tmp_path / str(ranks))], ranks)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        logs[ranks] = re.findall(r"^step (\d+)/4: loss ([\d.]+)", done.stderr, re.M)
    assert logs[2] == logs[1] and len(logs[1]) == 2, logs  # the whole step's loss, not a rank's share
    assert "2 ranks share each step's 4" in " ".join(done.stderr.split())
    one, two = (mx.load(str(tmp_path / str(r) / "model.safetensors")) for r in (1, 2))
    start = mx.load(str(tmp_path / "1" / "checkpoints" / "step_0000002" / "model.safetensors"))
    assert any(not mx.allclose(one[k], start[k]) for k in one)  # it trained past the checkpoint
    assert all(mx.allclose(one[k], two[k], atol=1e-6).item() for k in one)
    assert sorted(p.name for p in (tmp_path / "2" / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]


def test_training_ranks_refuse_what_they_cannot_share_in_one_line(launcher, stories, tmp_path):
    from test_train_cli import regenerate

    regenerate(stories, tmp_path / "data")
    args = ["train", "--model", str(stories), "--data", str(tmp_path / "data"), "--block-size", "4", "--steps", "2",
            "--anchors", "4", "--held-out", "4", "--out", str(tmp_path / "d")]
    for extra, needle in ((["--grad-accum", "1"], "--grad-accum 1: give at least 2"),
                          (["--grad-accum", "2", "--miss-anchors", "0.5"], "--miss-anchors 0.5: give 0")):
        done = _run([*args, *extra], 2)
        assert needle in " ".join(done.stderr.split()) and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "d" / "checkpoints").exists()
