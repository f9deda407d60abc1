"""Leftovers of killed writers (dflash_mlx.atomic): found by their writer's process id,
removed or restored at the next start; single files renamed into place whole."""

import os
import subprocess
import sys

import numpy as np
import pytest

from dflash_mlx.atomic import WriteError, atomic_file, remove_stale


@pytest.fixture(scope="module")
def dead_pid():
    """The id of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale(tmp_path, dead_pid):
    out = tmp_path / "out"
    dead = tmp_path / f".out.tmp-{dead_pid}-abc"
    legacy = tmp_path / ".out.tmp-k2j3h4g5"  # named before names carried a process id
    live = tmp_path / f".out.tmp-{os.getpid()}-xyz"
    other = tmp_path / f".other.tmp-{dead_pid}-abc"
    for p in (dead, legacy, live, other):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"half")
    old = tmp_path / f".out.old-{dead_pid}"
    old.mkdir()
    (old / "dflash.json").write_text("{}")
    said = []
    done = remove_stale(out, said.append)
    assert sorted(done) == sorted([dead, legacy, old])
    assert not dead.exists() and not legacy.exists() and live.exists() and other.exists()
    assert (out / "dflash.json").is_file() and not old.exists()  # the previous output, moved back
    assert len(said) == 3 and any(f"restored {out}" in s for s in said)


def test_old_folder_removed_when_out_exists(tmp_path, dead_pid):
    out = tmp_path / "out"
    out.mkdir()
    old = tmp_path / f".out.old-{dead_pid}"
    old.mkdir()
    remove_stale(out)
    assert out.is_dir() and not old.exists()


def test_atomic_file(tmp_path):
    path = tmp_path / "shard_00000.npz"
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, a=np.arange(3))
    assert list(np.load(path)["a"]) == [0, 1, 2] and [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(WriteError, match="killed mid-write"):  # MLX's failed save: one exception type
        with atomic_file(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert list(np.load(path)["a"]) == [0, 1, 2] and [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(path) as tmp:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert list(np.load(path)["a"]) == [0, 1, 2] and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_saved_drafter_has_the_mode_open_gives(tmp_path):
    """safetensors writes its files 0600; atomic_file leaves every file as open() would."""
    from conftest import tiny_drafter, tiny_target
    from dflash_mlx import save_drafter

    umask = os.umask(0o022)
    os.umask(umask)
    _, target = tiny_target("qwen3")
    folder = save_drafter(tiny_drafter(target), tmp_path / "drafter")
    for name in ("model.safetensors", "config.json"):
        assert (folder / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
