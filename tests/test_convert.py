"""dflash convert on tiny random Hugging Face-format checkpoints (no hub, no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from typer.testing import CliRunner

from conftest import ROOT, assert_varied, mlx_lm_greedy
from dflash_mlx import (
    CheckpointError, ConfigError, InputError, MismatchError, generate_step, load, load_drafter, save_drafter,
)
from dflash_mlx.pair.convert import convert
from dflash_mlx.pair.loading import quantization
from dflash_mlx.fingerprint import sha256_file
from dflash_mlx.pair.manifest import MANIFEST
from dflash_mlx.pair.validation import drafter_logits, logit_difference
from hf_checkpoints import edit_config, write_drafter, write_hf_target

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104]
N = 64


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def sources(request, tmp_path_factory):
    """(family, HF target folder, released bf16 drafter folder)."""
    root = tmp_path_factory.mktemp(f"hf-{request.param}")
    target = write_hf_target(root / "target", request.param)
    drafter = write_drafter(root / "drafter", request.param, layers=2)
    return request.param, target, drafter


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-qwen3")
    return write_hf_target(root / "target", "qwen3"), write_drafter(root / "drafter", "qwen3")


def nothing_left(out: Path) -> None:
    """Neither the output folder nor a temporary folder beside it remains."""
    assert not out.exists()
    assert list(out.parent.glob(f".{out.name}*")) == []


def dflash_greedy(pair, prompt, n):
    tokens = []
    for step in generate_step(mx.array(prompt, dtype=mx.int32), pair.target, pair.drafter, max_tokens=n,
                              stop_token_ids=()):
        tokens += step.tokens
    return tokens


def fixed_logits(drafter_dir: Path, target) -> mx.array:
    return drafter_logits(load_drafter(str(drafter_dir)), target, PROMPT)


# -- round trip -----------------------------------------------------------------------


def test_float_round_trip(sources, tmp_path):
    """float32: the drafter's logits equal the unconverted ones; DFlash through the
    converted pair reproduces the converted target's greedy output."""
    family, target_src, drafter_src = sources
    out = tmp_path / "pair"
    result = convert(str(target_src), str(drafter_src), out, dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == ["dflash.json", "drafter", "target"]
    assert list(tmp_path.glob(".pair*")) == []

    pair = load(str(out))  # the manifest gives both halves
    assert pair.drafter is not None and pair.target.dtype == mx.float32
    diff, _ = logit_difference(fixed_logits(out / "drafter", pair.target), fixed_logits(drafter_src, pair.target))
    assert diff <= 1e-5

    reference = mlx_lm_greedy(pair.model, PROMPT, N)
    assert_varied(reference)
    assert dflash_greedy(pair, PROMPT, N) == reference
    assert [c.ok for c in result.checks if c.ok is False] == []


def test_manifest_records_sources_and_hashes(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    manifest = convert(str(target_src), str(drafter_src), out, validate_output=False).manifest
    assert json.loads((out / MANIFEST).read_text()) == manifest
    t, d = manifest["target"], manifest["drafter"]
    assert (t["path"], t["source"], t["method"], t["quantization"]) == ("target", str(target_src.resolve()),
                                                                         "mlx_lm.convert", None)
    assert t["dtype"] == "bfloat16" and t["model_type"] == "qwen3"
    src_config = json.loads((drafter_src / "config.json").read_text())
    assert d["format"] == "DFlashDraftModel"
    assert d["block_size"] == src_config["block_size"]
    assert d["target_layer_ids"] == src_config["dflash_config"]["target_layer_ids"]
    assert d["quantization"] is None and d["dtype"] == "bfloat16"
    # Every file a loader reads: weights, configs, tokenizer files.
    assert sorted(manifest["files"]) == sorted(f"{part}/{f.name}" for part in ("target", "drafter")
                                               for f in (out / part).iterdir())
    assert {"drafter/model.safetensors", "target/model.safetensors", "target/config.json", "drafter/config.json",
            "target/tokenizer_config.json"} <= set(manifest["files"])
    for name, digest in manifest["files"].items():
        assert sha256_file(out / name) == digest
    # The target folder is mlx-lm's own output; the drafter folder the released format.
    assert json.loads((out / "target" / "config.json").read_text())["model_type"] == "qwen3"
    assert "dflash_config" in json.loads((out / "drafter" / "config.json").read_text())


def test_validation_on_the_float_path(qwen3, tmp_path):
    """bf16 kept: the converted target's greedy output must equal the unconverted one's."""
    target_src, drafter_src = qwen3
    checks = {c.name: c for c in convert(str(target_src), str(drafter_src), tmp_path / "pair").checks}
    assert list(checks) == ["vocabulary", "hidden size", "layers", "target vs unconverted",
                            "DFlash vs target", "drafter logits"]
    assert all(c.ok for c in checks.values()), checks
    assert checks["target vs unconverted"].result == "32/32 tokens equal"
    assert "tau" in checks["DFlash vs target"].result


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_drafter(qwen3, tmp_path, bits):
    """8-bit within 1e-2 relative of the float drafter (4-bit: measured, worse); fc,
    hidden_norm and norms stay float; it computes in float32; output stays lossless."""
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    manifest = convert(str(target_src), str(drafter_src), out, dtype="float32", draft_q_bits=bits).manifest
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": bits, "mode": "affine"}
    assert manifest["drafter"]["quantization"]["bits"] == bits
    assert manifest["drafter"]["compute_dtype"] == "float32"
    keys = set(mx.load(str(out / "drafter" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.scales" in keys and "layers.0.mlp.down_proj.scales" in keys
    assert not any(k.startswith(("fc.", "hidden_norm.", "norm.")) and k.endswith("scales") for k in keys)

    pair = load(str(out))
    up, stored = pair.drafter.layers[0].mlp.up_proj, mx.load(str(out / "drafter" / "model.safetensors"))
    if mx.default_device() == mx.cpu:  # MLX's CPU backend multiplies quantized weights slowly: the file's, dequantized
        parts = [stored[f"layers.0.mlp.up_proj.{k}"] for k in ("weight", "scales", "biases")]
        assert up.weight.dtype == mx.float32
        assert mx.array_equal(up.weight, mx.dequantize(*parts, group_size=64, bits=bits)).item()
        assert quantization(pair.drafter) == f"{bits}-bit (group 64) file, float32 here"  # the chat header's
    else:
        assert isinstance(up, nn.QuantizedLinear)
    assert pair.drafter.fc.weight.dtype == mx.float32
    _, rel = logit_difference(fixed_logits(out / "drafter", pair.target), fixed_logits(drafter_src, pair.target))
    if bits == 8:
        assert rel <= 1e-2
    else:
        assert 1e-2 < rel < 0.3  # quantization happened, and is not garbage
    assert dflash_greedy(pair, PROMPT, N) == mlx_lm_greedy(pair.model, PROMPT, N)


def test_quantized_drafter_computes_in_float32(qwen3, tmp_path):
    """With a bf16 target, a quantized drafter still runs in float32 (never in the
    target's half precision); a float drafter runs in the target's dtype."""
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    convert(str(target_src), str(drafter_src), out, draft_q_bits=4, validate_output=False)
    pair = load(str(out))
    assert pair.target.dtype == mx.bfloat16
    layer = pair.drafter.layers[0].self_attn.q_proj
    assert pair.drafter.fc.weight.dtype == (layer.scales if "scales" in layer else layer.weight).dtype == mx.float32
    cache = pair.drafter.make_cache()
    _, features = pair.target(mx.array(PROMPT)[None], pair.target.make_cache(), pair.drafter.target_layer_ids)
    logits = pair.drafter(mx.array([PROMPT[:16]]), features, cache)
    assert logits.dtype == mx.bfloat16  # the target's head, fed float32 hidden states cast back
    assert cache[0].keys.dtype == mx.float32
    assert load(str(target_src), str(drafter_src)).drafter.fc.weight.dtype == mx.bfloat16


def test_quantized_target(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    result = convert(str(target_src), str(drafter_src), out, quantize=True, q_bits=8, q_group_size=32)
    assert json.loads((out / "target" / "config.json").read_text())["quantization"] == {
        "group_size": 32, "bits": 8, "mode": "affine"}
    assert result.manifest["target"]["quantization"]["bits"] == 8
    checks = {c.name: c for c in result.checks}
    assert checks["target vs unconverted"].ok in (True, None)  # measured only when quantized
    pair = load(str(out))
    assert isinstance(pair.model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)


def test_mlx_target_is_copied_or_requantized(qwen3, tmp_path):
    """An mlx-lm folder is copied byte for byte; re-quantized only when asked for another quantization."""
    target_src, drafter_src = qwen3
    convert(str(target_src), str(drafter_src), tmp_path / "q4", quantize=True, q_bits=4, validate_output=False)
    mlx_target = tmp_path / "q4" / "target"

    same = convert(str(mlx_target), str(drafter_src), tmp_path / "copy", quantize=True, q_bits=4,
                   validate_output=False).manifest["target"]
    assert same["method"].startswith("copied")
    assert sha256_file(tmp_path / "copy/target/model.safetensors") == sha256_file(mlx_target / "model.safetensors")

    other = convert(str(mlx_target), str(drafter_src), tmp_path / "q8", quantize=True, q_bits=8).manifest["target"]
    assert other["method"].startswith("re-quantized") and other["quantization"]["bits"] == 8
    assert not any(p.name.startswith(".") for p in (tmp_path / "q8").iterdir())


def test_force_replaces_only_when_complete(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(InputError, match="--force"):
        convert(str(target_src), str(drafter_src), out, validate_output=False)
    assert (out / "old.txt").read_text() == "keep me"
    with pytest.raises(InputError, match=r"holds files that convert did not write \(no dflash.json or .dflash-mlx"):
        convert(str(target_src), str(drafter_src), out, force=True, validate_output=False)  # not ours to delete
    assert (out / "old.txt").read_text() == "keep me"
    (out / MANIFEST).write_text("{}")  # an earlier convert's output: --force may replace it
    with pytest.raises(MismatchError):  # a failing --force run keeps the old folder too
        bad = write_drafter(tmp_path / "narrow", hidden=32)
        convert(str(target_src), str(bad), out, force=True, validate_output=False)
    assert (out / "old.txt").read_text() == "keep me"
    convert(str(target_src), str(drafter_src), out, force=True, validate_output=False)
    assert not (out / "old.txt").exists() and (out / MANIFEST).is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# -- bad input: one clear error, nothing left behind ------------------------------------


def test_unknown_architecture(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in target_src.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    edit_config(odd, model_type="qwen9", architectures=["Qwen9ForCausalLM"])
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"config.json: model_type 'qwen9' .*not supported by mlx-lm") as e:
        convert(str(odd), str(drafter_src), out)
    assert "\n" not in str(e.value)
    nothing_left(out)


def test_missing_dflash_config(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_bytes((drafter_src / "model.safetensors").read_bytes())
    config = json.loads((drafter_src / "config.json").read_text())
    config.update(config.pop("dflash_config"))
    (old / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"old/config.json: missing key 'dflash_config'.*drafter_layout.py"):
        convert(str(target_src), str(old), out)
    nothing_left(out)


def test_drafter_target_mismatch(qwen3, tmp_path):
    target_src, _ = qwen3
    narrow = write_drafter(tmp_path / "narrow", hidden=32)
    out = tmp_path / "out"
    with pytest.raises(MismatchError, match="hidden_size 32 does not match the target's 64"):
        convert(str(target_src), str(narrow), out)
    nothing_left(out)


def test_existing_output_folder(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InputError, match=r"--out .*out already exists; pass --force"):
        convert(str(target_src), str(drafter_src), out)
    assert list(out.iterdir()) == [] and list(tmp_path.glob(".out*")) == []


@pytest.mark.parametrize("kwargs, flag", [
    (dict(quantize=True, q_bits=3), "--q-bits"),
    (dict(quantize=True, q_group_size=48), "--q-group-size"),
    (dict(q_bits=4), "--q-bits needs -q"),
    (dict(draft_q_bits=2), "--draft-q-bits"),
    (dict(dtype="float64"), "--dtype"),
])
def test_bad_options(qwen3, tmp_path, kwargs, flag):
    target_src, drafter_src = qwen3
    with pytest.raises(InputError, match=flag):
        convert(str(target_src), str(drafter_src), tmp_path / "out", **kwargs)
    nothing_left(tmp_path / "out")


@pytest.mark.parametrize("name", ["out", "new/out"])
def test_failure_while_writing(qwen3, tmp_path, name):
    """mlx-lm refuses the quantization once the temporary folder exists: it is removed,
    and so is a parent folder that convert created."""
    target_src, drafter_src = qwen3
    with pytest.raises(InputError, match=r"^--q-mode mxfp4 --q-bits 8: mlx-lm cannot quantize .*requires bits to be 4"):
        convert(str(target_src), str(drafter_src), tmp_path / name, quantize=True, q_mode="mxfp4", q_bits=8)
    assert list(tmp_path.iterdir()) == []


def test_missing_source(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        convert(str(tmp_path / "nowhere"), str(tmp_path / "drafter"), tmp_path / "out")
    nothing_left(tmp_path / "out")


SLOW_WRITE = """
import faulthandler, signal, sys, time
import dflash_mlx.pair.convert as convert

# A terminal's Ctrl-C reaches a process that neither blocks nor ignores SIGINT, whatever the test
# worker passed on; SIGUSR1 prints a hung child's stacks for the failure message.
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1)

def slow_write(drafter, dst, *args, **kwargs):  # the drafter folder half written, then a long write
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"partial")
    print("WRITING", flush=True, file=sys.__stdout__)
    time.sleep(120)

convert.write_drafter = slow_write
from dflash_mlx.cli.app import app
app(sys.argv[1:])
"""


def start_slow_convert(qwen3, out):
    """A convert into ``out`` stopped in the middle of writing the drafter (its target already written)."""
    target_src, drafter_src = qwen3
    env = dict(os.environ, TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, "convert", "--model", str(target_src), "--draft-model",
         str(drafter_src), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    assert proc.stdout.readline().strip() == "WRITING"
    staged = list(out.parent.glob(f".{out.name}.tmp-{proc.pid}-*"))  # named after its writer
    assert len(staged) == 1 and (staged[0] / "target" / "config.json").is_file()  # mid-write
    return proc


def stopped(proc, signum) -> str:
    """Send ``signum`` and return the process's stderr once it exits; a process still running a minute
    later fails the test with its signal state and its threads' stacks."""
    try:
        proc.send_signal(signum)
        try:
            return proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status")
            state = [line for line in status.read_text().splitlines() if line.startswith("Sig")] \
                if status.exists() else []
            proc.send_signal(signal.SIGUSR1)
            try:
                err = proc.communicate(timeout=5)[1]
            except subprocess.TimeoutExpired as e:
                err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"still running a minute after {signal.Signals(signum).name}: {state}\n{err[-4000:]}")
    finally:
        proc.kill()


def test_sigint_mid_write_leaves_nothing(qwen3, tmp_path):
    """Ctrl-C while the output is being written: exit 130, one line, nothing left."""
    out = tmp_path / "out"
    proc = start_slow_convert(qwen3, out)
    err = stopped(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"error: interrupted; nothing was written to {out}"
    nothing_left(out)


def test_sigterm_mid_write_leaves_nothing(qwen3, tmp_path):
    """SIGTERM (a service manager stopping the job) cleans up as Ctrl-C does: exit 143."""
    out = tmp_path / "out"
    proc = start_slow_convert(qwen3, out)
    err = stopped(proc, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == f"error: terminated; nothing was written to {out}"
    nothing_left(out)


def test_sigkill_leftovers_are_removed_at_the_next_start(qwen3, tmp_path):
    """SIGKILL cannot be caught: the temporary folder stays, and the next convert into
    the same --out removes it (its writer is gone) and says so."""
    out = tmp_path / "out"
    proc = start_slow_convert(qwen3, out)
    proc.kill()
    proc.communicate(timeout=60)
    assert len(list(tmp_path.glob(".out.tmp-*"))) == 1
    target_src, drafter_src = qwen3
    said = []
    convert(str(target_src), str(drafter_src), out, validate_output=False, progress=said.append)
    assert list(tmp_path.glob(".out.*")) == [] and (out / MANIFEST).is_file()
    assert any("left by an interrupted run" in s for s in said), said


# -- the converted folder in the CLI ------------------------------------------------------


@pytest.fixture(scope="module")
def converted(qwen3, tmp_path_factory):
    target_src, drafter_src = qwen3
    out = tmp_path_factory.mktemp("converted") / "pair"
    convert(str(target_src), str(drafter_src), out, validate_output=False)
    return out


def run_cli(*args, input=None):
    from dflash_mlx.cli.app import app

    return CliRunner().invoke(app, list(args), input=input)


def test_generate_finds_both_halves(converted):
    result = run_cli("generate", "--model", str(converted), "-p", "Hello", "-m", "8", "--json", "--verify")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["speculative"] is True and stats["block_size"] == 16


def test_verify_names_a_changed_file(converted, tmp_path):
    copy = tmp_path / "copy"
    for part in ("target", "drafter"):
        (copy / part).mkdir(parents=True)
        for f in (converted / part).iterdir():
            (copy / part / f.name).write_bytes(f.read_bytes())
    (copy / MANIFEST).write_bytes((converted / MANIFEST).read_bytes())
    weights = copy / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor: still a readable file
    weights.write_bytes(bytes(data))

    assert run_cli("generate", "--model", str(copy), "-p", "Hello", "-m", "4").exit_code == 0  # hashes only when asked
    result = run_cli("generate", "--model", str(copy), "-p", "Hello", "-m", "4", "--verify")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: {weights}: sha256 differs from {copy / MANIFEST} (changed since it was converted)"


def copy_converted(converted, copy):
    for part in ("target", "drafter"):
        (copy / part).mkdir(parents=True)
        for f in (converted / part).iterdir():
            (copy / part / f.name).write_bytes(f.read_bytes())
    (copy / MANIFEST).write_bytes((converted / MANIFEST).read_bytes())
    return copy


@pytest.mark.parametrize("name", ["target/config.json", "drafter/config.json", "target/tokenizer_config.json",
                                  "target/tokenizer.json"])
def test_verify_covers_configs_and_tokenizer_files(converted, tmp_path, name):
    copy = copy_converted(converted, tmp_path / "copy")
    path = copy / name
    path.write_text(path.read_text().replace("}", ', "x": 1}', 1))
    result = run_cli("generate", "--model", str(copy), "-p", "Hello", "-m", "4", "--verify")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: {path}: sha256 differs from {copy / MANIFEST} (changed since it was converted)"


def test_verify_refuses_an_added_file(converted, tmp_path):
    copy = copy_converted(converted, tmp_path / "copy")
    (copy / "target" / "chat_template.jinja").write_text("{{ 'time ' * 100 }}")  # mlx-lm would load it
    result = run_cli("generate", "--model", str(copy), "-p", "Hello", "-m", "4", "--verify")
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"error: {copy / 'target' / 'chat_template.jinja'}: file not listed in "
                                     f"{copy / MANIFEST}")


def test_verify_of_a_version_1_manifest_checks_the_weights(converted, tmp_path):
    """Folders converted before the manifest covered configs still verify (their weights)."""
    copy = copy_converted(converted, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["dflash_convert"] = 1
    manifest["files"] = {k: v for k, v in manifest["files"].items() if k.endswith(".safetensors")}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    assert run_cli("generate", "--model", str(copy), "-p", "Hello", "-m", "4", "--verify").exit_code == 0


def test_verify_needs_a_converted_folder(qwen3):
    target_src, _ = qwen3
    result = run_cli("generate", "--model", str(target_src), "-p", "Hello", "--verify")
    assert result.exit_code == 1 and "is not a folder written by dflash convert" in result.stderr


def test_chat_finds_both_halves(converted):
    result = run_cli("chat", "--model", str(converted), "-m", "6", input="Hello\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "Acceptance: tau" in result.output, result.output  # the drafter ran


def test_offline_repo_is_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "dflash_mlx.cli.main", "convert", "--model", "Qwen/Qwen3-4B",
                          "--draft-model", "z-lab/Qwen3-4B-DFlash-b16", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert run.returncode == 1
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("error: target model 'Qwen/Qwen3-4B' is neither a local folder nor downloadable")
    assert "pass a local folder instead" in error and "Traceback" not in run.stderr
    nothing_left(out)


def test_cli_convert_prints_the_table(qwen3, tmp_path):
    target_src, drafter_src = qwen3
    out = tmp_path / "pair"
    result = run_cli("convert", "--model", str(target_src), "--draft-model", str(drafter_src), "--out", str(out),
                     "--draft-q-bits", "8")
    assert result.exit_code == 0, result.output
    for name in ("vocabulary", "hidden size", "layers", "target vs unconverted", "DFlash vs target", "drafter logits"):
        assert name in result.stdout
    assert f"wrote {out}" in result.stderr
    again = run_cli("convert", "--model", str(target_src), "--draft-model", str(drafter_src), "--out", str(out))
    assert again.exit_code == 1
    assert again.stderr.strip().splitlines()[-1] == f"error: --out {out} already exists; pass --force to replace it"


@pytest.fixture(scope="module")
def dflash2(tmp_path_factory):
    """(HF qwen3 target folder, a random 1-layer DFlash2 drafter for it in its released
    format, bf16). Initialised like the v1 fixture (nn.Linear's own init, unit norms),
    with the DFlash2 pieces randomised so they matter: conv base kernels and the selector
    codebooks (fresh, they are the identity and zeros)."""
    import dataclasses

    import numpy as np
    from mlx.utils import tree_map_with_path

    from conftest import FORMATS, tiny_drafter_args, tiny_target
    from dflash_mlx import DFlashDrafter

    root = tmp_path_factory.mktemp("dflash2")
    target_dir = write_hf_target(root / "target", "qwen3")
    target = tiny_target("qwen3")[1]
    over = {**FORMATS["dflash2"], "layer_types": ["sliding_attention"]}
    mx.random.seed(1)
    drafter = DFlashDrafter(dataclasses.replace(tiny_drafter_args(target, block_size=8), **over))
    rng = np.random.default_rng(1)

    def randomise(path, p):
        if path.endswith("base_kernel"):
            return mx.array(0.5 * rng.standard_normal(p.shape), dtype=mx.float32)
        if path.endswith("codebook"):
            return mx.array(rng.standard_normal(p.shape) / np.sqrt(p.shape[-1]), dtype=mx.float32)
        return p

    drafter.update(tree_map_with_path(randomise, drafter.parameters()))
    drafter.set_dtype(mx.bfloat16)
    return target_dir, save_drafter(drafter, root / "drafter")


@pytest.mark.parametrize("bits", [None, 8])
def test_dflash2_round_trip(dflash2, tmp_path, bits):
    """A DFlash2 drafter converts through the same code: float within 1e-5, 8-bit within
    1e-2 relative with the selector codebooks and projection kept float; lossless."""
    target_src, drafter_src = dflash2
    out = tmp_path / "pair"
    manifest = convert(str(target_src), str(drafter_src), out, dtype="float32", draft_q_bits=bits).manifest
    assert manifest["drafter"]["format"] == "DFlash2DraftModel" and manifest["drafter"]["block_size"] == 8
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    weights = mx.load(str(out / "drafter" / "model.safetensors"))
    selector = {k: v for k, v in weights.items() if k.startswith("candidate_selector.")}
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= set(selector)
    assert all(mx.issubdtype(v.dtype, mx.floating) for v in selector.values())  # never quantized

    pair = load(str(out))
    _, rel = logit_difference(fixed_logits(out / "drafter", pair.target), fixed_logits(drafter_src, pair.target))
    if bits is None:
        assert rel <= 1e-5
    else:
        assert "layers.0.self_attn.q_proj.scales" in weights and rel <= 1e-2
    reference = mlx_lm_greedy(pair.model, PROMPT, N)
    assert dflash_greedy(pair, PROMPT, N) == reference


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    """(HF qwen3 target folder, a random DSpark drafter for it in DeepSpec's released schema, bf16: a rank-32
    Markov head, a confidence head, copies of the target's embedding and head)."""
    from conftest import tiny_target
    from hf_checkpoints import write_dspark

    root = tmp_path_factory.mktemp("dspark")
    return write_hf_target(root / "target", "qwen3"), write_dspark(root / "drafter", tiny_target("qwen3")[1], markov_rank=32)


@pytest.mark.parametrize("bits,quantize,group", [(None, False, 64), (8, False, 64), (4, True, 64), (8, False, 32)],
                         ids=["float", "8-bit", "4-bit-pair", "8-bit-group-32"])
def test_dspark_round_trip(dspark, tmp_path, bits, quantize, group):
    """A DSpark drafter converts through the same code, in its own format: the confidence head and the embedding
    copies stay float, 8-bit/4-bit quantization takes the layers and the Markov head where its rank is a multiple
    of the group (32 here: only with group 32); the copies equal to the float target's are shared once loaded,
    kept beside a 4-bit target's; DFlash reproduces the target's greedy output."""
    target_src, drafter_src = dspark
    out = tmp_path / "pair"
    manifest = convert(str(target_src), str(drafter_src), out, dtype=None if quantize else "float32",
                       draft_q_bits=bits, draft_q_group_size=group, quantize=quantize).manifest
    assert manifest["drafter"]["format"] == "Qwen3DSparkModel" and manifest["drafter"]["block_size"] == 7
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert [config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head")] == [32, "vanilla", True]
    weights = mx.load(str(out / "drafter" / "model.safetensors"))
    heads = {k: v for k, v in weights.items() if not k.startswith(("layers.", "markov_head."))}
    assert {"embed_tokens.weight", "lm_head.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(heads)
    assert all(mx.issubdtype(v.dtype, mx.floating) for v in heads.values())  # never quantized
    markov = "markov_head.markov_w2.scales" in weights and "markov_head.markov_w1.scales" in weights
    assert markov == (bits is not None and group == 32)
    assert (weights["markov_head.markov_w2.weight"].dtype == mx.uint32) == markov
    assert ("layers.0.self_attn.q_proj.scales" in weights) == bool(bits)

    pair = load(str(out))
    assert ("embed_tokens" in pair.drafter) == quantize and pair.drafter.block_size == 8
    assert drafter_logits(load_drafter(str(drafter_src)), pair.target, PROMPT).shape[0] == 7  # its trained block
    reference = mlx_lm_greedy(pair.model, PROMPT, N)
    assert_varied(reference)
    assert dflash_greedy(pair, PROMPT, N) == reference
