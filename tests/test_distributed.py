"""DFlash on a target tensor-sharded over 2 local ranks (`mlx.launch --backend ring -n 2`): rank 0 alone
prints, and the text is the single process's, greedy and seeded-sampled."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

BIN = Path(sys.executable).parent
LAUNCH = BIN / "mlx.launch"
DRAFTER = ROOT / "examples" / "stories260K" / "drafter"
TIMEOUT = 600


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(args, ranks: int):
    cmd = [str(BIN / "dflash"), *args] if ranks == 1 else \
        [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--", str(BIN / "dflash"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """Skips (naming why) where mlx.launch cannot start two ranks that all-sum."""
    if not LAUNCH.is_file():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    probe.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                     "print(g.size(), mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu).item())\n")
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "-n", "2", "--", sys.executable, str(probe)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "2 2.0" not in done.stdout:
        pytest.skip(f"mlx.launch --backend ring -n 2 cannot start ranks here: {done.stderr.strip()[-300:]}")


def _generate(stories, ranks: int, *extra):
    done = _run(["generate", "--model", str(stories), "--draft-model", str(DRAFTER), "--prompt", "Once upon a time",
                 "--max-tokens", "64", "--no-prompt-cache", "--json", "--quiet", *extra], ranks)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    return json.loads(lines[0])


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.8", "--seed", "7", "--block-size", "8"]],
                         ids=["greedy", "seeded"])
def test_two_ranks_print_the_single_process_text(launcher, stories, sampling):
    one = _generate(stories, 1, *sampling)
    two = _generate(stories, 2, *sampling)
    assert one["distributed"] is None
    assert two["distributed"] == {"ranks": 2, "sharding": "tensor"}
    assert two["text"] == one["text"]
    assert two["tau"] > 1


def test_pipeline_sharding_is_refused_in_one_line(launcher, stories):
    done = _run(["generate", "--model", str(stories), "--draft-model", str(DRAFTER), "--prompt", "Hi",
                 "--sharding", "pipeline"], 2)
    assert "error: --sharding pipeline" in done.stderr and "Traceback" not in done.stderr  # mlx.launch exits 0


@pytest.mark.parametrize("command", ["chat", "serve"])
def test_chat_and_serve_refuse_several_ranks_in_one_line(launcher, stories, command):
    done = _run([command, "--model", str(stories), "--draft-model", str(DRAFTER)], 2)
    assert f"error: dflash {command} does not run under mlx.launch yet" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
