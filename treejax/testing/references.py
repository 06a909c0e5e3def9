"""Slow references for tests: one full forward of the model over a whole sequence."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import transformer
from treejax.models.config import ModelConfig


@functools.partial(jax.jit, static_argnums=(1,))
def _padded_logp(params, config: ModelConfig, tokens_1xL, segment_ids_1xL):
    L = tokens_1xL.shape[1]
    h = transformer.forward(params, config, tokens_1xL, jnp.arange(L)[None, :], segment_ids_1xL)
    return jax.nn.log_softmax(transformer.logits(params, config, h[0]).astype(jnp.float32), axis=-1)


def full_forward_logp(params, config: ModelConfig, seq, width: int) -> np.ndarray:
    """Log-probs ``[len(seq), V]`` at every position of one full forward over ``seq``, right-padded to ``width``
    with segment id 0 (padding attends to nothing and nothing attends to it, so the real tokens' forward is the
    unpadded one): one jitted program per width serves every sequence instead of an eager forward per length."""
    if len(seq) > width:
        raise ValueError(f"a sequence of {len(seq)} tokens does not fit the reference width {width}")
    t, seg = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
    t[0, :len(seq)], seg[0, :len(seq)] = seq, 1
    return np.asarray(_padded_logp(params, config, jnp.asarray(t), jnp.asarray(seg)))[:len(seq)]
