"""Dense (materialised-mask) attention shared by the transformer's forward passes, the tree-packed forward
(:mod:`treejax.models.tree_attention`) and the decode samplers' reference attention: grouped-query attention
under a boolean mask, the masks it takes, and the windowed decode attention over a KV cache.

Grouped-query: query head ``j`` reads KV head ``j // (Q / K)``; scores are ``q·k / sqrt(H)``; scores and softmax
run in fp32, and masked scores are set to :data:`NEG_INF` (finite, so a fully masked padding row stays NaN-free).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30  # finite "minus infinity": keeps fully-masked (padding) rows NaN-free


def causal_mask(L: int) -> jax.Array:
    """``[L, L]`` bool: query ``i`` may see key ``j`` iff ``j <= i``."""
    return jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]


def segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """``[B, L, L]`` bool mask of padded / packed rows: token ``i`` sees token ``j`` iff ``j <= i`` and
    ``seg[j] == seg[i] != 0`` (0 = padding)."""
    seg = segment_ids_BxL
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return causal_mask(seg.shape[1])[None] & same


@jax.checkpoint
def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention. ``q: [B, Lq, Q, H]``, ``k, v: [B, Lk, K, H]``, ``mask: [B, Lq, Lk]`` (True =
    attend). Scores and softmax in fp32; returns ``[B, Lq, Q, H]`` in ``q``'s dtype.

    Checkpointed (``jax.checkpoint``): a backward pass recomputes the ``[B, K, Q/K, Lq, Lk]`` fp32 scores and
    probabilities from ``q``, ``k``, ``v`` instead of keeping them, so under the layer scan they exist for one
    layer at a time, not stacked over all layers (NudgeRL's CPU update on SmolLM2-135M, 16 rows x 384 tokens:
    two stacked ``[30, 16, 3, 3, 384, 384]`` fp32 residuals, 5.1 GB). The forward is unchanged."""
    B, Lq, Q, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, Lq, K, Q // K, H)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(H)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, Lq, Q, H).astype(q.dtype)


def windowed_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                              window: int | None = None) -> jax.Array:
    """Masked decode attention of ``q: [B, 1, Q, H]`` over the first ``window`` slots of ``k/v_cache:
    [B, K, L, H]`` (slot ``t`` visible to row ``b`` iff ``t <= positions[b]``). Scores/softmax in fp32."""
    B, _, Q, H = q.shape
    K, L = k_cache.shape[1], k_cache.shape[2]
    window = L if window is None else min(window, L)
    kw = lax.slice_in_dim(k_cache, 0, window, axis=2)
    vw = lax.slice_in_dim(v_cache, 0, window, axis=2)
    qg = q[:, 0].reshape(B, K, Q // K, H)
    scores = jnp.einsum("bkgh,bksh->bkgs", qg.astype(kw.dtype), kw, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(H)
    visible = (jnp.arange(window)[None, :] <= positions[:, None])[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(visible, scores, NEG_INF), axis=-1)
    out = jnp.einsum("bkgs,bksh->bkgh", probs.astype(vw.dtype), vw, preferred_element_type=jnp.float32)
    return out.reshape(B, 1, Q, H).astype(q.dtype)
