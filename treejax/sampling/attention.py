"""Ragged decode attention: cost follows the longest *live* row, not the allocated cache length.

One decode step of row ``b`` attends its query ``q_b`` to cache slots ``0..pos_b``. With a cache of ``L`` slots
allocated for the longest possible rollout, a plain masked attention reads all ``L`` slots of every row at every
step. Here the slots are visited in blocks of ``C`` with an online (streaming) softmax (Milakov & Gimelshein 2018;
FlashAttention's decode form):

    for blocks i = 0 .. n-1,  n = floor(max_b pos_b / C) + 1   (a dynamic trip count: lax.fori_loop)
        s   = q k_i^T / sqrt(H)          masked to slots <= pos_b
        m'  = max(m, max s);   l = l e^{m - m'} + sum e^{s - m'};   acc = acc e^{m - m'} + e^{s - m'} v_i
    out = acc / l

so the KV bytes read per step are ``n * C`` slots per row instead of ``L``. Rows with ``pos_b >= L`` are *dead*
(their key/value write is dropped by the caller); they are excluded from the bound and return zeros.

The function matches the ``attention_fn`` hook of :func:`treejax.models.transformer.decode_step`:
``fn(q [B, 1, Q, H], k_cache [B, L, K, H], v_cache [B, L, K, H], positions [B]) -> [B, 1, Q, H]``.
Scores and the softmax statistics are fp32; ``L`` must be a multiple of the block size (the sampler allocates
caches that way, :func:`round_cache_length`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax


def round_cache_length(length: int, block_size: int) -> int:
    """Smallest multiple of ``block_size`` that is ``>= length``."""
    return -(-length // block_size) * block_size


def ragged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                            block_size: int = 256) -> jax.Array:
    """Online-softmax decode attention over KV blocks up to the maximum live position (see module docstring)."""
    B, one, Q, H = q.shape
    L, K = k_cache.shape[1], k_cache.shape[2]
    if one != 1:
        raise ValueError(f"decode attention expects one query per row, got q of shape {q.shape}")
    C = min(block_size, L)
    if L % C:
        raise ValueError(f"cache length {L} must be a multiple of the attention block size {C}")
    G = Q // K
    qg = q[:, 0].reshape(B, K, G, H).astype(jnp.float32) / math.sqrt(H)
    live = positions < L
    max_pos = jnp.max(jnp.where(live, positions, 0))
    num_blocks = max_pos // C + 1

    def body(i, carry):
        m, l, acc = carry
        start = i * C
        kb = lax.dynamic_slice_in_dim(k_cache, start, C, axis=1)  # [B, C, K, H]
        vb = lax.dynamic_slice_in_dim(v_cache, start, C, axis=1)
        s = jnp.einsum("bkgh,bckh->bkgc", qg.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
        slot = start + jnp.arange(C)
        valid = (slot[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, C]
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        scale = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgc,bckh->bkgh", p.astype(vb.dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((B, K, G), -jnp.inf, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
            jnp.zeros((B, K, G, H), jnp.float32))
    m, l, acc = lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(B, 1, Q, H).astype(q.dtype)


def make_ragged_attention(block_size: int = 256):
    """``attention_fn`` for ``decode_step`` with a fixed block size."""
    return functools.partial(ragged_decode_attention, block_size=block_size)


def dense_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """Reference: masked attention over the whole cache (reads all ``L`` slots every step)."""
    from treejax.models.transformer import attention

    L = k_cache.shape[1]
    mask = (jnp.arange(L)[None, :] <= positions[:, None])[:, None, :]
    return attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
