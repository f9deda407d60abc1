"""scripts/smollm2/target_layers.py on stories260K (a Llama in interleaved rotary order), as it is and with its
attention quantized to 8 bits: the top/ drafter's layers are the target's last ones (dequantized by mlx-lm), and
its Q and K rows, rotated the drafter's way (half split), give the same attention scores as the target's rows
rotated its own way (MLX's rope is the reference)."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.utils import dequantize_model, quantize_model, save

from dflash_mlx.drafter.checkpoint import load_drafter

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("target_layers", ROOT / "scripts/smollm2/target_layers.py")
target_layers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(target_layers)


@pytest.mark.parametrize("quantized", [False, True])
def test_top_layers_are_the_targets_with_the_same_attention_scores(stories, tmp_path, quantized):
    path = stories
    if quantized:
        model, tokenizer, config = load(str(stories), return_config=True)
        model, config = quantize_model(model, config, 64, 8, quant_predicate=lambda p, m: "self_attn" in p)
        save(tmp_path / "q", stories, model, tokenizer, config)
        path = tmp_path / "q"
    out = tmp_path / "init"
    assert target_layers.main(["--model", str(path), "--out", str(out), "--target-layer-ids", "1,3",
                               "--mask-token-id", "3"]) == 0
    model, _ = load(str(path))
    assert quantized == ("scales" in model.model.layers[-1].self_attn.q_proj)
    theirs = dequantize_model(model).model.layers[-2:]
    fresh, top = load_drafter(str(out / "fresh")), load_drafter(str(out / "top"))
    assert not mx.array_equal(fresh.layers[0].mlp.gate_proj.weight, top.layers[0].mlp.gate_proj.weight)
    assert mx.array_equal(fresh.fc.weight, top.fc.weight)  # only the layers differ
    hd = top.args.head_dim
    x = mx.random.normal((1, 1, 5, top.args.hidden_size), key=mx.random.key(0))
    for mine, t in zip(top.layers, theirs):
        assert mx.array_equal(mine.mlp.down_proj.weight, t.mlp.down_proj.weight)
        assert mx.array_equal(mine.self_attn.v_proj.weight, t.self_attn.v_proj.weight)
        assert mx.array_equal(mine.input_layernorm.weight, t.input_layernorm.weight)
        assert not mx.array_equal(mine.self_attn.q_proj.weight, t.self_attn.q_proj.weight)  # rows reordered

        def scores(attn, traditional):
            q = (x @ attn.q_proj.weight.T).reshape(1, 5, -1, hd).transpose(0, 2, 1, 3)
            k = (x @ attn.k_proj.weight.T).reshape(1, 5, -1, hd).transpose(0, 2, 1, 3)
            q, k = (mx.fast.rope(y, hd, traditional=traditional, base=10000.0, scale=1.0, offset=3) for y in (q, k))
            return q[:, : k.shape[1]] @ k.transpose(0, 1, 3, 2)  # each KV head against its first query head

        np.testing.assert_allclose(scores(mine.self_attn, False), scores(t.self_attn, True), rtol=1e-4, atol=1e-4)
