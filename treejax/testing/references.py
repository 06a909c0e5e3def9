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


def assert_tree_attention_matches_dense(attend, lo_BxL, hi_BxL, q, k, v, cotangent, atol: float = 1e-5) -> None:
    """A tree-attention kernel ``attend(q, k, v)`` against the dense masked path
    (:func:`treejax.models.tree_attention.tree_mask` + :func:`treejax.models.transformer.attention`) on rows with
    intervals ``lo / hi``: the output and the three input gradients (pulled back from ``cotangent``) within
    ``atol``."""
    from treejax.models import tree_attention

    mask = tree_attention.tree_mask(lo_BxL, hi_BxL)
    out_d, vjp_d = jax.vjp(lambda q, k, v: transformer.attention(q, k, v, mask), q, k, v)
    out_k, vjp_k = jax.vjp(attend, q, k, v)
    np.testing.assert_allclose(np.asarray(out_k), np.asarray(out_d), atol=atol)
    for name, a, b in zip("qkv", vjp_k(cotangent), vjp_d(cotangent)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, err_msg=f"d{name}")


def assert_decode_lse_matches_reference(o_BxKxGxH, lse_BxKxG, q, k, v, rows_and_lengths, atol: float = 1e-5) -> None:
    """A decode kernel's ``(o, lse)`` on cache rows ``b`` of live length ``n`` (``rows_and_lengths``: ``(b, n)``
    pairs) against float64 NumPy: ``lse = log sum_{j < n} e^{q.k_j / sqrt(H)}`` (natural base) and ``o = softmax .
    v``; ``q: [B, K, G, H]``, ``k, v: [B, K, L, H]``."""
    H = q.shape[-1]
    o, lse = np.asarray(o_BxKxGxH), np.asarray(lse_BxKxG)
    s = np.einsum("bkgh,bklh->bkgl", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(H)
    for b, n in rows_and_lengths:
        np.testing.assert_allclose(lse[b], np.log(np.exp(s[b, ..., :n]).sum(-1)), rtol=0, atol=atol)
        w = np.exp(s[b, ..., :n] - lse[b][..., None].astype(np.float64))
        want = np.einsum("kgl,klh->kgh", w, np.asarray(v, np.float64)[b, :, :n])
        np.testing.assert_allclose(o[b], want, rtol=0, atol=atol)
