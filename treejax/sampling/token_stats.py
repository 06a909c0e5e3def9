"""Per-token statistics a branching rule may ask the decode step for, beyond entropy and top-k log-probs.

A rule names them in ``BranchingRule.token_stats``; the decode step computes exactly those, one channel each, into
``Paths.extra_RxTxC`` (channel ``c`` = ``token_stats[c]``), and the rule reads them at a boundary with
:meth:`treejax.sampling.branching.base.PathStats.token_stat`. Nothing is computed when no rule asks.

  ``probe``                the quality probe's logit ``w . h_t + b`` on the last layer's hidden state ``h_t`` (after
                           the final norm) of the state that sampled token ``t``; ``w``, ``b`` come from a stateful
                           shaper that trains them (:class:`treejax.rl.shaping.QualityHead`, ARRoL) and reach the
                           sampler as the rollout's ``probe`` (:mod:`treejax.sampling.probe`);
  ``semantic_similarity``  ROSE's semantic-similarity term of the next-token distribution,
                           ``F_t = || sum_i p_i e_i ||^2 - sum_i p_i^2 = sum_{i != j} p_i p_j cos(e_i, e_j)``
                           over the ``k = 20`` most likely tokens ``i`` (probabilities ``p_i`` of the full softmax,
                           not renormalised) with ``e_i`` their unit-normalised **input** embeddings
                           (``ZiqiZhao1/ROSE-rl`` at 2142dc7, ``vllm_rollout_spmd.py::generate_sequences_loop_entropy``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

TOKEN_STATS = ("probe", "semantic_similarity")
SEMANTIC_TOP_K = 20


def check_token_stats(names) -> tuple[str, ...]:
    names = tuple(names)
    bad = [n for n in names if n not in TOKEN_STATS]
    if bad:
        raise ValueError(f"unknown per-token statistics {bad}; known: {TOKEN_STATS}")
    return names


def semantic_similarity(logits_RxV: jax.Array, embed_VxE: jax.Array, k: int = SEMANTIC_TOP_K) -> jax.Array:
    """``[R]``: ``F = ||sum_i p_i e_i||^2 - sum_i p_i^2`` over the ``k`` most likely tokens (module docstring)."""
    logits = logits_RxV.astype(jnp.float32)
    k = min(k, logits.shape[-1])
    top, ids = lax.top_k(logits, k)
    p = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))  # [R, k]
    e = jnp.take(embed_VxE, ids, axis=0).astype(jnp.float32)  # [R, k, E]
    e = e * lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(e), -1, keepdims=True), 1e-12))
    mean = jnp.einsum("rk,rke->re", p, e)
    return jnp.sum(jnp.square(mean), -1) - jnp.sum(jnp.square(p), -1)


def probe_logit(hidden_RxE: jax.Array, probe: Any) -> jax.Array:
    """``[R]``: ``w . h + b`` in fp32."""
    return jnp.einsum("re,e->r", hidden_RxE.astype(jnp.float32), probe["w"].astype(jnp.float32)) + probe["b"]


def compute(names: tuple[str, ...], *, logits_RxV: jax.Array, hidden_RxE: jax.Array | None, params: Any,
            probe: Any) -> jax.Array:
    """``[R, C]``: the channels ``names`` for one decode step (``C = 0``: an empty array)."""
    cols = []
    for name in names:
        if name == "probe":
            if probe is None:
                raise ValueError("a branching rule reads the quality probe ('probe' statistic) but the rollout got "
                                 "none: add the shaper that trains it, e.g. RunConfig.shapers = [@QualityHead()]")
            cols.append(probe_logit(hidden_RxE, probe))
        elif name == "semantic_similarity":
            cols.append(semantic_similarity(logits_RxV, params["embed"]))
        else:
            raise ValueError(f"unknown per-token statistic {name!r}; known: {TOKEN_STATS}")
    if not cols:
        return jnp.zeros((logits_RxV.shape[0], 0), jnp.float32)
    return jnp.stack(cols, axis=-1)
