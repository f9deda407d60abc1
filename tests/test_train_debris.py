"""Nothing half-written in training (issue 23): feature caches and the final drafter are
renamed into place whole, and what an older or killed run left truncated (a feature
``.npy``, a data shard, the final drafter) is detected on load and made again, or named
in one line."""

import zipfile

import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx.core as mx

from conftest import needs_shared, tiny_training_set
from dflash_mlx import load_drafter
from dflash_mlx.errors import InputError
from dflash_mlx.train.data import MANIFEST, TrainSequence, _write_shard, load_sequences, read_shard, regenerate
from dflash_mlx.train.features import FeatureStore
from dflash_mlx.train.loss import FeatureCache
from dflash_mlx.train.trainer import TrainConfig, Trainer
from dflash_mlx.train.start import init_drafter


@pytest.fixture(scope="module")
def setup():
    _, target, seqs = tiny_training_set(6, 24)
    return target, seqs


def drafter(target):
    return init_drafter(target, mask_token_id=63, layers=1, block_size=4, seed=0)


def test_truncated_feature_file_is_computed_again(setup, tmp_path):
    target, seqs = setup
    FeatureCache(target, [1, 2], tmp_path, hidden=True).get(seqs[0], mx.float32)
    path = FeatureStore(tmp_path, target, [1, 2]).path(seqs[0].tokens)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # what np.save writing in place left when killed
    cache = FeatureCache(target, [1, 2], tmp_path, hidden=True)
    feats, _ = cache.get(seqs[0], mx.float32)
    assert cache.rebuilt == [path] and path.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.stem + ".hidden.npy", "manifest.json"])


def test_kept_features_are_read_again_not_held_in_memory(setup, tmp_path):
    """What the folder keeps is read at each visit (a file changed on disk is what the next visit gets), and
    nothing the cache holds grows with the visits. The sequences are 1,028 tokens (128 KB of features each), so
    that what the interpreter allocates meanwhile for other reasons (a few KB, from whatever ran before in the
    worker) stays far below one sequence's features."""
    import gc
    import tracemalloc

    target, _ = setup
    rng = np.random.default_rng(1)
    seqs = [TrainSequence(rng.integers(3, 64, size=1028).astype(np.int32), 4) for _ in range(6)]
    for seq in seqs:  # computed, then kept in the folder (the forwards' own allocations stay out of the count)
        FeatureCache(target, [1, 2], tmp_path).get(seq, mx.float32)
    cache = FeatureCache(target, [1, 2], tmp_path)
    cache.get(seqs[0], mx.float32)  # the first read from the folder, before counting
    one = np.load(FeatureStore(tmp_path, target, [1, 2]).path(seqs[0].tokens))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for seq in seqs[1:]:
        cache.get(seq, mx.float32)
    gc.collect()
    held = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename") if s.size_diff > 0)
    tracemalloc.stop()
    assert held < one.nbytes, f"{held} bytes held after {len(seqs) - 1} visits ({one.nbytes} a sequence)"
    path = FeatureStore(tmp_path, target, [1, 2]).path(seqs[1].tokens)
    np.save(path, np.zeros_like(np.load(path)))
    assert not np.array(cache.get(seqs[1], mx.float32)[0]).any()


def test_truncated_shard(tmp_path):
    (tmp_path / MANIFEST).write_text("{}")
    _write_shard(tmp_path / "shard_00000.npz", [[1, 2]], [[3, 4, 5]])
    _write_shard(tmp_path / "shard_00001.npz", [[6]], [[7]])
    assert len(load_sequences(tmp_path)) == 2
    with zipfile.ZipFile(tmp_path / "shard_00000.npz") as z:  # stored deflated, not as raw int32
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
    bad = tmp_path / "shard_00001.npz"
    bad.write_bytes(bad.read_bytes()[:-40])
    assert read_shard(bad) is None
    with pytest.raises(InputError, match=r"shard_00001.npz: truncated or corrupt data shard"):
        load_sequences(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_final_drafter_is_rewritten_on_resume(setup, tmp_path, damage):
    target, seqs = setup
    config = TrainConfig(steps=2, anchors=4, save_every=2)
    list(Trainer(drafter(target), target, seqs, config, tmp_path).run())
    weights = tmp_path / "model.safetensors"
    whole = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(whole[: len(whole) // 2])
    elif damage == "flip":
        weights.write_bytes(whole[:-8] + bytes(b ^ 0xFF for b in whole[-8:]))
    else:
        weights.unlink()
    resumed = Trainer.resume(target, seqs, config, tmp_path)
    assert "model.safetensors" in resumed.rebuilding and resumed.step == 2
    list(resumed.run())
    assert weights.read_bytes() == whole
    assert [p.name for p in tmp_path.glob(".*")] == [".dflash-mlx"]  # the run's mark; no temporary file left
    load_drafter(str(tmp_path))
    with pytest.raises(InputError, match="already finished its 2 steps"):  # whole again
        Trainer.resume(target, seqs, config, tmp_path)


@needs_shared
def test_data_rerun_makes_a_truncated_shard_anew(stories, tmp_path):
    """`dflash data` run again over a folder with a truncated shard makes that shard
    anew (byte for byte the first run's: same seed) and leaves the others alone; then
    `dflash train` reads the folder."""
    from test_train_cli import regenerate

    data = tmp_path / "data"
    regenerate(stories, data)
    shards = sorted(data.glob("shard_*.npz"))
    before = {p.name: p.read_bytes() for p in shards}
    shards[0].write_bytes(before[shards[0].name][:100])
    with pytest.raises(InputError, match="truncated or corrupt"):
        load_sequences(data)
    regenerate(stories, data)
    assert {p.name: p.read_bytes() for p in sorted(data.glob("shard_*.npz"))} == before
    assert load_sequences(data)


def test_truncated_manifests_are_named(setup, tmp_path):
    target, seqs = setup
    FeatureCache(target, [1, 2], tmp_path / "f")
    manifest = tmp_path / "f" / "manifest.json"
    manifest.write_text(manifest.read_text()[:10])
    with pytest.raises(InputError, match=r"f/manifest.json: not valid JSON .*delete the features folder"):
        FeatureCache(target, [1, 2], tmp_path / "f")
    data = tmp_path / "data"
    data.mkdir()
    (data / MANIFEST).write_text('{"version": 1, "num_pro')  # cut short by an older version's kill
    with pytest.raises(InputError, match=r"data/manifest.json: not valid JSON .*pass a new --out"):
        regenerate(None, None, [[1, 2, 3]], data, max_tokens=4, max_length=16)
