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


def test_backward_keeps_no_attention_scores_and_one_mlp_activation_set_per_layer(capsys):
    """Without remat, the residuals the update's backward keeps (stacked over the layer scan) hold no ``[L, L]``
    attention scores or probabilities (recomputed per layer from q and k: for NudgeRL's update micro-batch on
    SmolLM2-135M, 16 x 384 tokens in fp32, two such ``[30, 16, 3, 3, 384, 384]`` residuals were 5.1 GB of a
    17.6 GB working set) and three ``[B, L, F]`` MLP tensors per layer (gate, up and their product; silu's
    intermediates are recomputed), not six."""
    import re

    import jax.ad_checkpoint

    cfg = presets.tiny_config("smollm2-135m", num_layers=3)  # E = 64, F = 128
    params = T.init_params(cfg, jax.random.key(0))
    B, L = 2, 40
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, cfg.sampling_vocab_size)
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))

    def loss(p):
        h = T.forward(p, cfg, tokens, positions)
        return jnp.sum(T.token_logprobs(p, cfg, h[:, :-1], tokens[:, 1:]))

    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    shapes = [tuple(int(d) for d in m.group(1).split(",") if d)
              for m in (re.match(r"^\w+\[([\d,]*)\]", line) for line in capsys.readouterr().out.splitlines()) if m]
    assert (cfg.num_layers, B, L, cfg.hidden_size) in shapes  # the parse found the stacked residuals
    assert not [s for s in shapes if s[-2:] == (L, L) and len(s) > 3], shapes  # (the [B, L, L] mask is kept once)
    assert shapes.count((cfg.num_layers, B, L, cfg.intermediate_size)) == 3, shapes
