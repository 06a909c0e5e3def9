"""The chunked log-prob head (custom backward) against a full log-softmax and its autodiff gradients.

Precision: fp32 (``highest`` matmul precision on a GPU, tests/conftest.py): log-probs 2e-6, entropies 5e-6,
gradients 1e-6 of their largest entry; bf16 compute: gradients within 5% of the largest fp32 gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets
from treejax.models import transformer as T


def _setup():
    cfg = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=200)  # 256 embedding rows, 56 padded ids
    params = T.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 5 if x.ndim >= 2 else x, params)  # peaky logits
    h = jax.random.normal(jax.random.key(1), (3, 7, cfg.hidden_size))
    targets = jax.random.randint(jax.random.key(2), (3, 7), 0, 200)
    return cfg, params, h, targets


def _objective(logp, ent):
    """A non-trivial scalar of both outputs (distinct weights per position, nonlinear in the entropy)."""
    return jnp.sum(logp * jnp.arange(21.0).reshape(3, 7)) + jnp.sum(jnp.sin(3 * ent))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_full_softmax(temperature):
    cfg, params, h, targets = _setup()

    def reference(params, h):
        z = T.logits(params, cfg, h, mask_padded_vocab=False)[..., : cfg.sampling_vocab_size] / temperature
        lp = jax.nn.log_softmax(z, -1)
        ent = -jnp.sum(jnp.exp(lp) * lp, -1)
        return jnp.take_along_axis(lp, targets[..., None], -1)[..., 0], ent

    ref = reference(params, h)
    g_ref = jax.grad(lambda p, x: _objective(*reference(p, x)), argnums=(0, 1))(params, h)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_ref))
    assert scale > 1.0  # the objective really depends on the inputs
    for chunk in (64, 100, 4096):  # several chunks, a ragged last chunk (pads), one chunk
        def ours(p, x, chunk=chunk):
            return T.token_logprobs(p, cfg, x, targets, chunk_size=chunk, with_entropy=True, temperature=temperature)

        logp, ent = ours(params, h)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref[0]), atol=2e-6)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(ref[1]), atol=5e-6)
        g = jax.grad(lambda p, x: _objective(*ours(p, x)), argnums=(0, 1))(params, h)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6 * scale)


def test_bf16_compute_gradients_stay_close_to_fp32():
    """bf16 compute (the backward matmuls take a bf16 cotangent) stays within bf16 rounding of the fp32 result."""
    cfg, params, h, targets = _setup()
    cfg16 = cfg.replace(compute_dtype="bfloat16")

    def grads(c, x):
        f = lambda p, x: _objective(*T.token_logprobs(p, c, x, targets, chunk_size=64, with_entropy=True))  # noqa
        return jax.jit(jax.grad(f, argnums=(0, 1)))(params, x)

    g32 = grads(cfg, h)
    g16 = grads(cfg16, h.astype(jnp.bfloat16))
    for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
        assert a.dtype == b.dtype or a.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
        assert err <= 0.05 * float(jnp.max(jnp.abs(b))) + 1e-6
