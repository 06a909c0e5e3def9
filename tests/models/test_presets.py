"""Full presets build under jax.eval_shape with the published parameter counts; KV-cached prefill + decode
reproduces the full forward's logits at every position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer


@pytest.mark.parametrize("name", presets.preset_names())
def test_eval_shape_and_published_param_count(name):
    config = presets.get_config(name)
    shapes = jax.eval_shape(lambda k: transformer.init_params(config, k), jax.random.key(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert count == config.num_params()
    published = presets.PUBLISHED_PARAMS[name]
    assert abs(count - published) / published <= 0.01, f"{name}: {count / 1e9:.4f}B vs published {published / 1e9}B"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_cached_decode_matches_full_forward(name):
    """Padded prompts of different lengths are prefilled, then every later token is fed with decode_step
    (attend_len < cache length); the logits at each position must equal the full forward's."""
    config = presets.tiny_config(name)
    params = transformer.init_params(config, jax.random.key(0))
    params["layers"] = {k: (v + 0.1 * jax.random.normal(jax.random.key(1), v.shape) if k.endswith("norm") or
                            k.startswith("b") else v) for k, v in params["layers"].items()}
    B, T, cache_len, attend_len = 3, 12, 32, 16
    prompt_lens = np.array([5, 3, 7])
    toks = jnp.asarray(np.random.RandomState(0).randint(3, config.vocab_size, (B, T)))
    pos_full = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    full = transformer.logits(params, config, transformer.forward(params, config, toks, pos_full))  # [B, T, V]

    Lp = int(prompt_lens.max())
    seg = (np.arange(Lp)[None, :] < prompt_lens[:, None]).astype(np.int32)  # right-padded prompt batch
    cache = transformer.init_cache(config, B, cache_len, dtype=jnp.float32)
    h, cache = transformer.prefill(params, config, toks[:, :Lp] * seg, pos_full[:, :Lp], jnp.asarray(seg), cache)
    got = np.zeros((B, T, config.vocab_size), np.float32)
    prefill_logits = np.asarray(transformer.logits(params, config, h))
    for b in range(B):
        got[b, : prompt_lens[b]] = prefill_logits[b, : prompt_lens[b]]
    step = jax.jit(lambda p, t, pos, c: transformer.decode_step(p, config, t, pos, c, attend_len=attend_len))
    pos = prompt_lens.copy()
    while pos.min() < T:
        feed = np.minimum(pos, T - 1)  # rows already done re-feed their last token at their last slot
        h, cache = step(params, toks[jnp.arange(B), feed], jnp.asarray(feed), cache)
        lg = np.asarray(transformer.logits(params, config, h))
        for b in range(B):
            if pos[b] < T:
                got[b, pos[b]] = lg[b]
        pos = pos + 1
    full = np.asarray(full)
    err = np.abs(got - full).max() / np.abs(full).max()
    assert err <= 1e-5, f"{name}: cached vs full max relative error {err:.2e}"


def test_random_weights_of_a_preset_with_another_models_tokenizer():
    """``random:<preset>@<tokenizer source>``: the preset's shape, random weights, the named model's tokenizer
    (its vocabulary bounds sampling); the memory plan reads the same shape without loading anything."""
    from treejax.memory_plan import model_config_of
    from treejax.models.registry import load_model, load_tokenizer

    name = "random:smollm2-135m@smollm2-135m-instruct"
    config, params, tok = load_model(name, param_dtype="bfloat16")
    want = presets.get_config("smollm2-135m")
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (want.num_layers, want.hidden_size,
                                                                          want.vocab_size)
    assert params["layers"]["wq"].shape[0] == want.num_layers and params["embed"].dtype == jnp.bfloat16
    assert tok.vocab_size == load_tokenizer(name).vocab_size == 49152  # SmolLM2's tokenizer
    assert model_config_of(name).num_layers == want.num_layers


@pytest.mark.parametrize("name, message", [
    ("random:qwen2.5-7b", "random weights need a tokenizer"), ("random:nope@smollm2-135m-instruct", "unknown preset"),
])
def test_malformed_random_model_names_say_the_form(name, message):
    from treejax.errors import ModelFileError
    from treejax.models.registry import load_tokenizer

    with pytest.raises(ModelFileError, match=message):
        load_tokenizer(name)
