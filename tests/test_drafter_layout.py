"""scripts/convert/drafter_layout.py: the older drafter layout to the released one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import ROOT
from dflash_mlx import ConfigError, load_drafter
from dflash_mlx.pair.convert import convert
from hf_checkpoints import write_drafter, write_hf_target

SCRIPT = ROOT / "scripts" / "convert" / "drafter_layout.py"
spec = importlib.util.spec_from_file_location("drafter_layout", SCRIPT)
drafter_layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drafter_layout)


@pytest.fixture
def layouts(tmp_path):
    """(released drafter, the same drafter in the older layout)."""
    released = write_drafter(tmp_path / "released", layers=2, layer_ids=[0, 2])
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_bytes((released / "model.safetensors").read_bytes())
    config = json.loads((released / "config.json").read_text())
    config.update(config.pop("dflash_config"))
    (old / "config.json").write_text(json.dumps(config))
    return released, old


def test_older_layout_becomes_the_released_one(layouts, tmp_path):
    released, old = layouts
    out = drafter_layout.convert_layout(old, tmp_path / "new")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": 255}
    assert "target_layer_ids" not in config and "mask_token_id" not in config
    assert config["block_size"] == 16
    assert (out / "model.safetensors").read_bytes() == (old / "model.safetensors").read_bytes()
    a, b = load_drafter(str(out)), load_drafter(str(released))
    assert a.args == b.args
    wa, wb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]) for k in wa)


def test_dflash_convert_takes_the_result(layouts, tmp_path):
    _, old = layouts
    new = drafter_layout.convert_layout(old, tmp_path / "new")
    target = write_hf_target(tmp_path / "target")
    manifest = convert(str(target), str(new), tmp_path / "pair", validate_output=False).manifest
    assert manifest["drafter"]["target_layer_ids"] == [0, 2]


def test_derived_ids_are_printed(layouts, tmp_path, capsys):
    """Without target_layer_ids the evenly spread ids are used and printed (here they
    are wrong: [1, 1] for 4 target layers, so --target-layer-ids is needed)."""
    _, old = layouts
    config = json.loads((old / "config.json").read_text())
    del config["target_layer_ids"]
    (old / "config.json").write_text(json.dumps(config))
    out = drafter_layout.convert_layout(old, tmp_path / "spread")
    assert "using the evenly spread [1, 1]" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 1]
    out = drafter_layout.convert_layout(old, tmp_path / "given", target_layer_ids=[0, 2])
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]


def test_refusals(layouts, tmp_path):
    released, old = layouts
    with pytest.raises(ConfigError, match="already in the released layout"):
        drafter_layout.convert_layout(released, tmp_path / "new")
    config = json.loads((old / "config.json").read_text())
    del config["mask_token_id"]
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="missing key 'mask_token_id'; pass --mask-token-id"):
        drafter_layout.convert_layout(old, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_command_line(layouts, tmp_path):
    _, old = layouts
    run = subprocess.run([sys.executable, str(SCRIPT), str(old), str(tmp_path / "new")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    again = subprocess.run([sys.executable, str(SCRIPT), str(old), str(tmp_path / "new")],
                           capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == f"error: OUT {tmp_path / 'new'} already exists; pass --force to replace it"
