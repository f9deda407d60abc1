"""`dflash data` -> `dflash train` -> `dflash generate --draft-model` on stories260K."""

import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from conftest import ROOT, SHARED, dflash as run_dflash, needs_shared
from test_cli import STORY, dflash


def run(*args):
    return run_dflash(*args, text=True, timeout=300)


def regenerate(stories, data) -> None:
    """``dflash data`` on the shared TinyStories sample, 24 tokens per response, into ``data``."""
    r = run("data", "--model", str(stories), "--text", str(SHARED / "datasets" / "tinystories_sample.txt"),
            "--max-tokens", "24", "--out", str(data))
    assert r.returncode == 0, r.stderr


@needs_shared
def test_data_train_generate(stories, tmp_path):
    data, out = tmp_path / "data", tmp_path / "drafter"
    r = run("data", "--model", str(stories), "--text", str(SHARED / "datasets" / "tinystories_sample.txt"),
            "--max-tokens", "24", "--shard-size", "16", "--out", str(data))
    assert r.returncode == 0, r.stderr
    assert json.loads((data / "manifest.json").read_text())["num_prompts"] == 40
    assert re.findall(r"^regenerated (\d+)/40 sequences \(\d+ s\)$", r.stderr, re.M) == ["16", "32", "40"], r.stderr
    # Re-running resumes: nothing is regenerated, nothing changes.
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    assert run("data", "--model", str(stories), "--text", str(SHARED / "datasets" / "tinystories_sample.txt"),
               "--max-tokens", "24", "--shard-size", "16", "--out", str(data)).returncode == 0
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before

    # A second source: openings cut from sentences inside stories the target samples itself.
    openings = tmp_path / "openings"
    r = run("data", "--model", str(stories), "--self-prompts", "6", "--self-prompt-tokens", "64",
            "--self-prompt-style", "sentence", "--max-tokens", "24", "--out", str(openings))
    assert r.returncode == 0, r.stderr
    n_openings = json.loads((openings / "manifest.json").read_text())["num_prompts"]
    assert 1 <= n_openings <= 6

    r = run("train", "--model", str(stories), "--data", str(data), "--data", str(openings), "--out", str(out), "--layers", "1",
            "--block-size", "4", "--steps", "6", "--anchors", "4", "--grad-accum", "1", "--held-out", "4",
            "--eval-every", "3", "--save-every", "3")
    assert r.returncode == 0, r.stderr
    assert "held-out tau" in r.stderr
    # a log gets a line per checkpoint, so a long run shows where it is
    assert re.findall(r"^step (\d+)/6: loss [\d.]+ lr .* tok/s \(\d+ s\)$", r.stderr, re.M) == ["3", "6"], r.stderr
    # a log gets the last held-out table as plain text (no box drawing), then the last line on its own
    assert re.search(r"^held-out acceptance at step \d+ \(teacher forced\)\n *B +tau", r.stderr, re.M), r.stderr
    assert "\u2500" not in r.stderr
    assert r.stderr.endswith(f"\nwrote drafter to {out}\n")
    assert f"{40 + n_openings - 4} train / 4 held-out" in " ".join(r.stderr.split())
    assert (out / "checkpoints" / "step_0000006").is_dir()
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 4 and config["num_hidden_layers"] == 1

    r = dflash("--model", str(stories), "--draft-model", str(out), "-p", "Once upon a time", "-m", "40", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(STORY[:80])

    # --init starts from a drafter's weights and keeps its shape (the shipped one: 2 layers, B=16)
    shipped = ROOT / "examples" / "stories260K" / "drafter"
    r = run("train", "--model", str(stories), "--data", str(data), "--out", str(tmp_path / "bad"), "--init",
            str(shipped), "--layers", "1", "--steps", "1")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: --layers 1: the --init drafter {shipped} has 2; give as many or more"], r.stderr
    assert not (tmp_path / "bad").exists()
    warm = tmp_path / "warm"
    r = run("train", "--model", str(stories), "--data", str(data), "--out", str(warm), "--init", str(shipped),
            "--block-sizes", "4,8", "--steps", "1", "--lr", "1e-9", "--anchors", "4", "--grad-accum", "1",
            "--held-out", "4", "--eval-every", "0", "--save-every", "1", "--draft-vocab", "64")
    assert r.returncode == 0, r.stderr
    config = json.loads((warm / "config.json").read_text())
    assert (config["num_hidden_layers"], config["block_size"], config["draft_vocab_size"]) == (2, 16, 64)
    before, after = mx.load(str(shipped / "model.safetensors")), mx.load(str(warm / "model.safetensors"))
    assert after.keys() - before.keys() == {"d2t"}
    assert all(mx.allclose(before[k], after[k], atol=1e-6).item() for k in before)
    # --draft-vocab: the 64 tokens most frequent in the training responses (counted here; ties: lower ids)
    shards = [np.load(f) for f in sorted(data.glob("shard_*.npz"))]
    rows = [r[start:] for z in shards for r, start in zip(np.split(z["tokens"], np.cumsum(z["lengths"])[:-1]),
                                                          z["response_starts"])]
    counts = Counter(t for row in rows[:-4] for t in row.tolist())
    top = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:64])
    assert (np.array(after["d2t"]) + np.arange(64)).tolist() == top
    r = dflash("--model", str(stories), "--draft-model", str(warm), "-p", "Once upon a time", "-m", "40", "--quiet")
    assert r.returncode == 0 and r.stdout.startswith(STORY[:80]), r.stderr
    state = json.loads(next((warm / "checkpoints").glob("step_*")).joinpath("trainer_state.json").read_text())
    assert state["config"]["init"] == str(shipped)

    # --layers above the --init drafter's: its layers kept, the added one an identity (zero o_proj, down_proj)
    grown = tmp_path / "grown"
    r = run("train", "--model", str(stories), "--data", str(data), "--out", str(grown), "--init", str(shipped),
            "--layers", "3", "--block-sizes", "4,8", "--steps", "1", "--lr", "1e-9", "--anchors", "4",
            "--held-out", "4", "--eval-every", "0", "--save-every", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((grown / "config.json").read_text())["num_hidden_layers"] == 3
    after = mx.load(str(grown / "model.safetensors"))
    assert all(mx.allclose(before[k], after[k], atol=1e-6).item() for k in before)
    added = {k: v for k, v in after.items() if k.startswith("layers.2.")}
    assert len(added) == len([k for k in before if k.startswith("layers.1.")])
    assert all(mx.abs(added[f"layers.2.{name}.weight"]).max().item() < 1e-6
               for name in ("self_attn.o_proj", "mlp.down_proj"))
    assert mx.abs(added["layers.2.mlp.up_proj.weight"]).max().item() > 1e-3
    r = dflash("--model", str(stories), "--draft-model", str(grown), "-p", "Once upon a time", "-m", "40",
               "--block-size", "8", "--json")
    r0 = dflash("--model", str(stories), "--draft-model", str(shipped), "-p", "Once upon a time", "-m", "40",
                "--block-size", "8", "--json")
    assert r.returncode == r0.returncode == 0, r.stderr + r0.stderr
    assert json.loads(r.stdout)["tau"] == json.loads(r0.stdout)["tau"]


@needs_shared
def test_data_errors(stories, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = run("data", "--model", str(stories), "--prompts", str(empty), "--out", str(tmp_path / "d"))
    assert r.returncode == 1 and "empty" in r.stderr and str(empty) in r.stderr and "Traceback" not in r.stderr
    r = run("data", "--model", str(stories), "--out", str(tmp_path / "d"))
    assert r.returncode == 1 and "--prompts" in r.stderr
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 200}) + "\n")
    r = run("data", "--model", str(stories), "--prompts", str(long), "--max-length", "64", "--out", str(tmp_path / "d2"))
    assert r.returncode == 1 and "--max-length 64" in r.stderr
    r = run("data", "--model", str(stories), "--self-prompts", "2", "--self-prompt-style", "middle",
            "--out", str(tmp_path / "d3"))
    assert r.returncode == 1 and "--self-prompt-style" in r.stderr


@needs_shared
def test_interrupted_training_says_where_its_checkpoint_is(stories, tmp_path):
    data, out = tmp_path / "data", tmp_path / "drafter"
    regenerate(stories, data)
    train = ["train", "--model", str(stories), "--data", str(data), "--out", str(out), "--block-size", "4",
             "--anchors", "4", "--grad-accum", "1", "--held-out", "4", "--eval-every", "0"]
    # So many steps that only the interrupt ends the run; it lands after the first checkpoint.
    p = subprocess.Popen([sys.executable, "-m", "dflash_mlx.cli.main", *train, "--steps", "1000000",
                          "--save-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("checkpoints/step_*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)  # (only the newest three are kept: step_0000001 may be gone already)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()  # a run that ignored the interrupt must not train on through the rest of the suite
    assert p.returncode == 130, err
    note = err.splitlines()[-1]
    assert "Traceback" not in err and "The newest checkpoint is" in note and "--resume continues" in note
    newest = note.split("The newest checkpoint is ")[1].split(":")[0]
    assert newest.startswith(str(out / "checkpoints" / "step_"))
    r = dflash("--model", str(stories), "--draft-model", newest, "-p", "Once upon a time", "-m", "8", "--quiet")
    assert r.returncode == 0, r.stderr  # the checkpoint is a drafter

    # The folder holds that run: a fresh run is refused, --resume must keep its settings,
    # --overwrite starts afresh.
    r = run(*train, "--steps", "2")
    assert r.returncode == 1 and "holds an earlier training run" in r.stderr and "--resume" in r.stderr
    r = run(*train, "--steps", "2", "--resume")
    assert r.returncode == 1 and "--steps 1000000; resuming with --steps 2" in " ".join(r.stderr.split())
    r = run(*train, "--steps", "2", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert not (out / "checkpoints").exists() and (out / "config.json").is_file()


@needs_shared
def test_runs_share_a_features_folder_only_at_the_same_layers(stories, tmp_path):
    data, feats = tmp_path / "data", tmp_path / "features"
    regenerate(stories, data)
    train = ["train", "--model", str(stories), "--data", str(data), "--block-size", "4", "--steps", "2",
             "--anchors", "4", "--grad-accum", "1", "--held-out", "4", "--eval-every", "0", "--features-dir", str(feats)]
    for name in ("a", "b"):  # the second run reuses the first one's features
        r = run(*train, "--out", str(tmp_path / name), "--target-layer-ids", "1,3")
        assert r.returncode == 0, r.stderr
    assert len(list(feats.glob("*.npy"))) >= 2 and not (tmp_path / "b" / "features").exists()
    r = run(*train, "--out", str(tmp_path / "c"), "--target-layer-ids", "1,2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"error: {feats} holds features of another target or other layers; give another features folder" in " ".join(
        r.stderr.split())


@needs_shared
def test_a_miss_anchors_fraction_outside_0_to_1_is_one_line(stories, tmp_path):
    regenerate(stories, tmp_path / "data")
    r = run("train", "--model", str(stories), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "d"),
            "--block-size", "4", "--steps", "2", "--anchors", "4", "--miss-anchors", "1.5")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--miss-anchors must be a fraction from 0 to 1, got 1.5" in " ".join(r.stderr.split())
    assert not (tmp_path / "d" / "checkpoints").exists()


@needs_shared
def test_data_keeps_features_and_train_reads_them(stories, tmp_path):
    """`dflash data --target-layer-ids` keeps one feature file per sequence; `dflash train` at those layers
    reads them without a word, at other layers says it computes its own; a layer the target lacks is one line."""
    data = tmp_path / "data"
    args = ["data", "--model", str(stories), "--text", str(SHARED / "datasets" / "tinystories_sample.txt"),
            "--max-tokens", "16", "--out", str(data)]
    r = run(*args, "--target-layer-ids", "1,3")
    assert r.returncode == 0, r.stderr
    from dflash_mlx.train.data import load_sequences

    distinct = {s.tokens.tobytes() for s in load_sequences(data)}  # some cut prompts repeat: one file each
    assert len(list((data / "features").glob("*.npy"))) == len(distinct) > 20
    train = ["train", "--model", str(stories), "--data", str(data), "--layers", "1", "--block-size", "4",
             "--steps", "2", "--anchors", "4", "--grad-accum", "1", "--held-out", "4", "--eval-every", "0"]
    r = run(*train, "--out", str(tmp_path / "d1"), "--target-layer-ids", "1,3")
    assert r.returncode == 0 and "computed instead" not in r.stderr, r.stderr
    r = run(*train, "--out", str(tmp_path / "d2"), "--target-layer-ids", "0,3")
    said = " ".join(r.stderr.split())  # wrapped at 80 columns where the tmp path's length puts the break
    assert r.returncode == 0 and "holds features of another target or other layers" in said, r.stderr
    r = run(*args[:-2], "--out", str(tmp_path / "bad"), "--target-layer-ids", "1,9")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "--target-layer-ids 1,9" in r.stderr


@needs_shared
def test_train_a_dspark_drafter(stories, tmp_path):
    """`--arch dspark`: fresh, or from a v1 drafter (--init); the result loads with --draft-model, names its
    format and gives the target's own text; flags that do not go together are one line each."""
    data, out = tmp_path / "data", tmp_path / "dspark"
    regenerate(stories, data)
    common = ("--model", str(stories), "--data", str(data), "--steps", "2", "--anchors", "4", "--held-out", "4",
              "--eval-every", "2", "--save-every", "2")
    r = run("train", *common, "--out", str(out), "--arch", "dspark", "--markov-rank", "8", "--block-size", "4")
    assert r.returncode == 0, r.stderr
    assert "Qwen3DSparkModel" in r.stderr and "Markov rank 8" in " ".join(r.stderr.split())
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["block_size"], config["markov_rank"]) == (["Qwen3DSparkModel"], 3, 8)
    r = dflash("--model", str(stories), "--draft-model", str(out), "-p", "Once upon a time", "-m", "40", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["drafter_format"] == "Qwen3DSparkModel", r.stderr
    r = dflash("--model", str(stories), "--draft-model", str(out), "-p", "Once upon a time", "-m", "40", "--quiet")
    assert r.returncode == 0 and r.stdout.startswith(STORY[:80]), r.stderr

    shipped = ROOT / "examples" / "stories260K" / "drafter"
    r = run("train", *common, "--out", str(tmp_path / "from-v1"), "--init", str(shipped), "--arch", "dspark")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "from-v1" / "config.json").read_text())
    assert (config["architectures"], config["block_size"], config["markov_rank"]) == (["Qwen3DSparkModel"], 15, 256)
    only = "give dflash or dspark (--markov-rank and --confidence-head go with dspark only)"
    for flags, line in [(("--markov-rank", "8"), f"error: --arch dflash: {only}"),
                        (("--confidence-head",), f"error: --arch dflash: {only}"),
                        (("--arch", "dspark2"), f"error: --arch dspark2: {only}"),
                        (("--init", str(out)), f"error: --arch dflash: the --init drafter {out} is a Qwen3DSparkModel; "
                                               "pass --arch dspark")]:
        r = run("train", *common, "--out", str(tmp_path / "bad"), *flags)
        assert r.returncode == 1 and " ".join(r.stderr.split()) == line, r.stderr
    assert not (tmp_path / "bad").exists()


@needs_shared
def test_train_a_dspark_drafter_with_its_confidence_head(stories, tmp_path):
    """`--confidence-head` (DeepSpec's losses against the target's distribution, `--l1-weight`): saved with the
    head, loads and gives the target's text; with a sampled softmax it is one line."""
    data, out = tmp_path / "data", tmp_path / "dspark"
    regenerate(stories, data)
    common = ("--model", str(stories), "--data", str(data), "--steps", "2", "--anchors", "4", "--held-out", "4",
              "--eval-every", "0", "--save-every", "2", "--arch", "dspark", "--confidence-head")
    r = run("train", *common, "--out", str(out), "--markov-rank", "8", "--block-size", "4", "--l1-weight", "9")
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["enable_confidence_head"], config["confidence_head_with_markov"]) == (True, True)
    assert mx.load(str(out / "model.safetensors"))["confidence_head.proj.weight"].shape == (1, 64 + 8)
    r = dflash("--model", str(stories), "--draft-model", str(out), "-p", "Once upon a time", "-m", "40", "--quiet")
    assert r.returncode == 0 and r.stdout.startswith(STORY[:80]), r.stderr
    r = run("train", *common, "--out", str(tmp_path / "bad"), "--loss-vocab", "step")
    assert r.returncode == 1 and " ".join(r.stderr.split()) == (
        "error: --loss-vocab step: a confidence head needs the full vocabulary"), r.stderr
