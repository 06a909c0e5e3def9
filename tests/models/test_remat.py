"""Rematerialisation policies of the training forward change memory and time, never the gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets
from treejax.models import transformer as T


def test_remat_policies_give_identical_gradients():
    cfg = presets.tiny_config("qwen2.5-0.5b")
    params = T.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.sampling_vocab_size)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))

    def loss(p, remat):
        h = T.forward(p, cfg, tokens, positions, remat=remat)
        return jnp.sum(T.token_logprobs(p, cfg, h, jnp.roll(tokens, -1, axis=1), chunk_size=64))

    ref = jax.grad(loss)(params, False)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ref)) > 0
    for remat in (True, "none", "full", "dots"):
        got = jax.grad(loss)(params, remat)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="remat must be"):
        T.forward(params, cfg, tokens, positions, remat="everything")
