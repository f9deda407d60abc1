"""benchmarks/heldout_tau.py's paired comparison: each sequence's blocks and accepted drafts from
evaluate_block_sizes, and the difference of two drafters' tau with a bootstrap interval over sequences."""

import importlib.util
import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx.train.evaluate as evaluate
from conftest import ROOT, mlx_lm_greedy, tiny_drafter, tiny_target
from dflash_mlx.train.data import TrainSequence
from dflash_mlx.train.evaluate import evaluate_block_sizes

spec = importlib.util.spec_from_file_location("heldout_tau", ROOT / "benchmarks" / "heldout_tau.py")
heldout_tau = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heldout_tau)


def test_per_sequence_adds_up_to_the_pooled_tau():
    model, target = tiny_target("qwen3")
    seqs = [TrainSequence(np.array(p + mlx_lm_greedy(model, p, 40), dtype=np.int32), len(p))
            for p in ([1, 17, 33, 2, 9], [5, 6, 7, 8, 100, 42])]
    drafter = tiny_drafter(target, block_size=8)
    both = evaluate_block_sizes(drafter, target, seqs, [8, 4], chained=False)
    for b, r in both.items():
        blocks, accepted = np.array(r["per_sequence"]).sum(0)
        assert blocks == r["blocks"] and all(n > 0 for n, _ in r["per_sequence"])
        assert r["tau"] == round(1 + accepted / blocks, 4)
    # a sequence's anchors depend on its index alone: the first scores the same without the second
    assert evaluate_block_sizes(drafter, target, seqs[:1], [8], chained=False)[8]["per_sequence"] == \
        both[8]["per_sequence"][:1]


def test_paired_difference_by_hand():
    # pooled tau: first 1 + 10/20 both, other 1 + 10/20; a draw of sequence 0 twice gives 1.8 - 1.5 = +0.3,
    # of 1 twice 1.2 - 1.5 = -0.3, one of each 0: a quarter, a half and a quarter of the draws
    out = heldout_tau.paired_difference([[10, 5], [10, 5]], [[10, 8], [10, 2]])
    assert out == {"difference": 0.0, "low": -0.3, "high": 0.3}
    same = heldout_tau.paired_difference([[10, 5], [20, 3]], [[10, 5], [20, 3]])
    assert same == {"difference": 0.0, "low": 0.0, "high": 0.0}
    better = heldout_tau.paired_difference([[10, 5], [20, 3]], [[10, 6], [20, 5]])
    assert better["difference"] == pytest.approx(3 / 30, abs=1e-4) and better["low"] > 0


def test_paired_difference_refuses_other_blocks():
    with pytest.raises(ValueError, match="same blocks"):
        heldout_tau.paired_difference([[10, 5], [10, 5]], [[10, 5], [12, 5]])
    with pytest.raises(ValueError, match="same blocks"):
        heldout_tau.paired_difference([[10, 5]], [[10, 5], [10, 5]])


def test_drafters_alike_share_the_targets_features(monkeypatch, capsys):
    # the target runs once per sequence for drafters of the same target_layer_ids, each drafter's figures as alone
    model, target = tiny_target("qwen3")
    seqs = [TrainSequence(np.array(p + mlx_lm_greedy(model, p, 30), dtype=np.int32), len(p))
            for p in ([1, 17, 33, 2, 9], [5, 6, 7, 8, 100, 42], [3, 4, 5])]
    drafters = {"a": tiny_drafter(target, block_size=8), "b": tiny_drafter(target, seed=3, block_size=8),
                "c": tiny_drafter(target, block_size=8, layer_ids=[0, 2])}
    alone = {k: evaluate_block_sizes(d, target, seqs, [8, 4], chained=False) for k, d in drafters.items()}
    calls = []
    real = evaluate.target_features
    monkeypatch.setattr(evaluate, "target_features", lambda *a: calls.append(a[2]) or real(*a))
    monkeypatch.setattr(heldout_tau, "load", lambda model, path: SimpleNamespace(drafter=drafters[path], target=target))
    monkeypatch.setattr(heldout_tau, "load_sequences", lambda folder: seqs)
    monkeypatch.setattr(heldout_tau, "resolve_model_path", lambda path, *a, **k: path)
    assert heldout_tau.main(["--model", "T", "--data", "D", "--drafter", "a", "--drafter", "b", "--drafter", "c",
                             "--block-sizes", "8,4", "--no-generation", "--json"]) == 0
    assert calls == [[1, 3]] * len(seqs) + [[0, 2]] * len(seqs)
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for line, k in zip(got, "abc"):
        assert {b: line[str(b)] for b in (8, 4)} == alone[k]


def test_a_missing_drafter_is_named_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        heldout_tau.main(["--model", str(tmp_path), "--data", str(tmp_path), "--drafter", str(tmp_path),
                          "--drafter", str(tmp_path / "gone")])
    assert exit.value.code == 2
    assert f"{tmp_path / 'gone'}: drafter folder not found" in capsys.readouterr().err
