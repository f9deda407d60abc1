"""Target adapters: same logits as the mlx-lm model, right features, model untouched."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import generate_step, make_adapter
from dflash_mlx.errors import MismatchError
from dflash_mlx.targets import ADAPTERS
from conftest import WRAPPERS, assert_varied, mlx_lm_greedy, tiny_drafter, tiny_target


def _chunks(target, model, ids, capture, sizes, mlx_lm_cache=False):
    """Run ``ids`` in chunks through the adapter and the model with separate caches.

    With the adapter's cache type on both sides the logits must be bit-identical.
    Against mlx-lm's own caches (``RotatingKVCache`` for sliding layers, which passes
    fewer, already-windowed keys to attention) they agree to float32 rounding of the
    largest logit.
    """
    ca = target.make_cache()
    cm = make_prompt_cache(model) if mlx_lm_cache else target.make_cache()
    start, feats = 0, []
    for n in sizes:
        x = mx.array([ids[start:start + n]])
        h, f = target(x, ca, capture)
        ours, theirs = target.lm_head(h), model(x, cache=cm)
        if mlx_lm_cache:
            assert (mx.abs(ours - theirs).max() <= 1e-5 * mx.abs(theirs).max()).item()
        else:
            assert mx.array_equal(ours, theirs).item()
        feats.append(f)
        start += n
    return mx.concatenate(feats, axis=1)


def test_logits_equal_model_logits(family):
    model, target = tiny_target(family)
    _chunks(target, model, list(range(1, 40)), [0, 2], [7, 1, 16, 1, 14])
    _chunks(target, model, list(range(1, 40)), [0, 2], [7, 1, 16, 1, 14], mlx_lm_cache=True)


def test_features_are_layer_outputs(family):
    if family == "gemma4_text":
        pytest.skip("gemma4 layers need per-layer inputs and shared K/V: its walk is pinned "
                    "by test_logits_equal_model_logits")
    model, target = tiny_target(family)
    ids = mx.array([[4, 8, 15, 16, 23, 42]])
    _, feats = target(ids, target.make_cache(), [0, 2, 3])
    h = target.embed(ids)
    outs = []
    for layer in target.layers:  # each layer on its own, no cache (6 tokens: inside every window)
        h = layer(h, None if getattr(layer, "is_linear", False) else "causal", None)
        outs.append(h)
    # The last layer's feature is taken after the final norm, as Hugging Face's
    # hidden_states[N] is (the layout drafters are trained against elsewhere).
    expect = mx.concatenate([outs[0], outs[2], target.inner.norm(outs[3])], axis=-1)
    assert feats.shape == (1, 6, 3 * target.hidden_size)
    assert mx.allclose(feats, expect, atol=1e-5).item()
    # Not the layer inputs (off by one costs acceptance, spec section 3).
    assert not mx.allclose(feats[..., : target.hidden_size], target.embed(ids), atol=1e-3).item()


def test_model_is_not_mutated(family):
    model, target = tiny_target(family)
    before = [(k, id(v)) for k, v in tree_flatten(model.parameters())]
    layers_before = [id(layer) for layer in target.layers]
    call_before = type(model).__call__
    x = mx.array([[1, 2, 3]])
    cache = target.make_cache(4)
    target(x, cache, [1])
    target.rollback(cache, 2)
    assert [(k, id(v)) for k, v in tree_flatten(model.parameters())] == before
    assert [id(layer) for layer in target.layers] == layers_before
    assert type(model).__call__ is call_before
    assert all(type(layer).__call__ is type(target.layers[0]).__call__ for layer in target.layers)
    assert all("__call__" not in vars(m) for _, m in model.named_modules())  # no instance overrides


def test_rollback_trims_every_layer(family):
    _, target = tiny_target(family)
    cache = target.make_cache(16)  # a Gated-DeltaNet layer rolls back within a verify-sized forward
    target(mx.array([list(range(10))]), cache, None)
    target.rollback(cache, 4)
    assert [c.offset for c in cache] == [6] * len(cache)


def test_llama_sliding_window_layers_match():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        max_position_embeddings=512,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    target = make_adapter(model)
    _chunks(target, model, list(range(1, 30)), [1], [3, 1, 9, 1])
    _chunks(target, model, list(range(1, 30)), [1], [3, 1, 9, 1], mlx_lm_cache=True)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_vision_wrappers(wrapper):
    # The adapter runs the text model inside (``language_model``), bit for bit, and
    # decodes losslessly with a drafter.
    model, target = tiny_target(wrapper)
    assert target.text is model.language_model and target.model is model
    _chunks(target, model, list(range(1, 40)), [0, 2], [7, 1, 16, 1, 14])
    prompt = [1, 17, 33, 2, 9, 100, 42]
    ref = mlx_lm_greedy(model, prompt, 200)
    assert_varied(ref)
    out = [t for s in generate_step(mx.array(prompt), target, tiny_drafter(target), max_tokens=200,
                                    block_size=4) for t in s.tokens]
    assert out == ref


def test_unknown_family_is_refused():
    model, _ = tiny_target("qwen3")
    model.model_type = "mamba"
    with pytest.raises(MismatchError) as e:
        make_adapter(model)
    message = str(e.value)
    assert "'mamba'" in message and "\n" not in message
    assert all(name in message for name in ADAPTERS)  # the supported list


def test_mlx_lm_remapped_types_use_the_model_they_load_as():
    # mlx-lm builds a "mistral" checkpoint as its llama model: the llama adapter fits.
    model, _ = tiny_target("llama")
    model.model_type = "mistral"
    assert type(make_adapter(model)).__name__ == "LlamaAdapter"
