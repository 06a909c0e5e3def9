"""LATR (lookahead tree rollouts; starreeze/latr ``model/sample_filter.py``, ``model/metrics.py``): branch where the
top-2 probabilities are close, prune a new branch whose continuation stays too similar to its sibling.

LATR works at the token: at step ``t`` it forks onto candidate ``k`` when ``p_k > p_min`` and ``p_1 - p_k < gap``
(``0.15``, ``0.25``), lets each new branch run for a lookahead window and, at steps ``{20, 30, 50}`` after the
fork, deletes it if its continuation ``a`` is too similar to the original's ``b``: suffix match ``> 0.2`` or
ROUGE-L ``> 0.5``, with (equal-length windows of ``l`` tokens)

    suffix match ``= max(|longest suffix of a found in b|, |longest suffix of b found in a|) / l``,
    ROUGE-L      ``= F(LCS(a, b) / l, LCS(a, b) / l) = LCS(a, b) / l``.

**Adaptation to segment boundaries** (forks happen only there):
  * branching: a live path's *uncertain tokens* are the tokens of its last segment whose policy top-2 satisfy
    ``p_2 > p_min and p_1 - p_2 < gap``; paths with ``n >= 1`` uncertain tokens may take ``min(n, max_new)``
    extra children, most uncertain tokens first (:func:`capped_allocation`); with ``spill`` the rest of the
    budget is spread evenly (so LATR spends the same budget as TreePO), without it the rest waits;
  * pruning: siblings are children of one branch point (paths whose node at ``depth - 1`` is the same, below the
    root: depth-1 paths are independent initial samples, like LATR's roots). The segment after the fork is the
    lookahead: among a branch point's live children the one with the lowest node id is the reference
    ("original": children are exchangeable here, since they are sampled, not forced onto distinct tokens), and
    each other child is pruned if, over the first ``l`` tokens of the segment for any ``l`` in ``lookahead``
    (clipped to ``S``), suffix match or ROUGE-L exceeds its threshold. Pruned paths end as ``PRUNED`` leaves.
  * not ported: LATR's forced distinct first token of a branch, the annealed share of LATR rollouts.
Per-token statistic: top-2 log-probs (``top_k = 2``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from treejax.sampling.branching.base import BranchingRule, PathStats, capped_allocation, register


def similarity_curves(a_BxL: jax.Array, b_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(suffix_len, lcs)``, each int32[B, L]: for every prefix length ``l = i + 1`` of the two windows,
    ``suffix_len[:, i]`` = the longest suffix of ``a[:l]`` occurring (contiguously) in ``b[:l]``, or of ``b[:l]``
    in ``a[:l]``, whichever is longer; ``lcs[:, i] = LCS(a[:l], b[:l])``. Entries ``< 0`` match nothing.

    One scan over the positions ``i`` of ``a`` with two dynamic programmes on ``[B, L]`` rows: the common-run
    length ``run[i, j] = [a_i = b_j] (run[i-1, j-1] + 1)`` (a suffix of ``a[:i+1]`` found in ``b`` ends at some
    ``j``; one of ``b[:j+1]`` found in ``a`` is a column maximum), and the LCS row
    ``L[i, j] = max_{k <= j} max(L[i-1, k], L[i-1, k-1] + [a_i = b_k])`` (a cumulative max).
    """
    B, L = a_BxL.shape
    a = a_BxL.astype(jnp.int32)
    b = b_BxL.astype(jnp.int32)
    upto = jnp.arange(L)

    def row(carry, i):
        lcs_prev, run_prev, col_max = carry
        m = (a[:, i][:, None] == b) & (b >= 0) & (a[:, i] >= 0)[:, None]
        shifted_lcs = jnp.pad(lcs_prev, ((0, 0), (1, 0)))[:, :L]
        lcs = lax.cummax(jnp.maximum(lcs_prev, shifted_lcs + m.astype(jnp.int32)), axis=1)
        run = jnp.where(m, jnp.pad(run_prev, ((0, 0), (1, 0)))[:, :L] + 1, 0)
        col_max = jnp.maximum(col_max, run)
        row_best = jnp.max(jnp.where(upto[None, :] <= i, run, 0), axis=1)
        suffix = jnp.maximum(row_best, col_max[:, i])
        return (lcs, run, col_max), (suffix, lcs[:, i])

    zeros = jnp.zeros((B, L), jnp.int32)
    _, (suffix_LxB, lcs_LxB) = lax.scan(row, (zeros, zeros, zeros), jnp.arange(L))
    return suffix_LxB.T, lcs_LxB.T


@register("latr")
@dataclasses.dataclass(frozen=True)
class LATR(BranchingRule):
    """LATR at segment boundaries (module docstring): ``p_min``, ``gap`` the top-2 test, ``max_new`` extra
    children per path, ``lookahead`` window lengths, ``suffix_threshold`` / ``rouge_threshold`` (``None``
    disables that test; both ``None``: no pruning)."""

    p_min: float = 0.15
    gap: float = 0.25
    max_new: int = 2
    lookahead: tuple[int, ...] = (20, 30, 50)
    suffix_threshold: float | None = 0.2
    rouge_threshold: float | None = 0.5
    spill: bool = True

    top_k = 2
    prunes = True

    def __post_init__(self):
        if self.max_new < 0:
            raise ValueError(f"LATR.max_new must be >= 0, got {self.max_new}")
        if not self.lookahead or min(self.lookahead) < 1:
            raise ValueError(f"LATR.lookahead must be a non-empty tuple of lengths >= 1, got {self.lookahead}")

    def uncertain_tokens(self, stats: PathStats) -> jax.Array:
        """int32[P, W]: tokens of the last segment with ``p_2 > p_min`` and ``p_1 - p_2 < gap``."""
        p1, p2 = jnp.exp(stats.topk_PxWxTxK[..., 0]), jnp.exp(stats.topk_PxWxTxK[..., 1])
        close = (p2 > self.p_min) & (p1 - p2 < self.gap) & stats.segment_mask()
        return jnp.sum(close, axis=-1).astype(jnp.int32)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        n = self.uncertain_tokens(stats)
        return capped_allocation(n.astype(jnp.float32), jnp.minimum(n, self.max_new), stats.live_PxW, total_P,
                                 spill=self.spill)

    def reference_sibling(self, stats: PathStats) -> tuple[jax.Array, jax.Array]:
        """``(eligible_PxW, ref_PxW)``: live paths below depth 1, and the index of each one's reference sibling
        (the eligible path with the same branch point and the lowest node id; itself when alone)."""
        P, W = stats.live_PxW.shape
        eligible = stats.live_PxW & (stats.depth_PxW >= 2)
        parent = stats.parent_node()
        node = jnp.take_along_axis(stats.path_PxWxD1, stats.depth_PxW[:, :, None], axis=-1)[:, :, 0]
        same = (parent[:, :, None] == parent[:, None, :]) & eligible[:, :, None] & eligible[:, None, :]
        ref = jnp.argmin(jnp.where(same, node[:, None, :], jnp.iinfo(jnp.int32).max), axis=-1)
        return eligible, jnp.where(eligible, ref, jnp.arange(W)[None, :])

    def prune(self, stats: PathStats) -> jax.Array:
        if self.suffix_threshold is None and self.rouge_threshold is None:
            return jnp.zeros_like(stats.live_PxW)
        P, W = stats.live_PxW.shape
        windows = sorted({min(l, stats.segment_length) for l in self.lookahead})
        eligible, ref = self.reference_sibling(stats)
        a = stats.segment_tokens()[:, :, : windows[-1]]
        b = jnp.take_along_axis(a, ref[:, :, None], axis=1)
        suffix, lcs = similarity_curves(a.reshape(P * W, -1), b.reshape(P * W, -1))
        similar = jnp.zeros((P * W,), bool)
        for l in windows:
            if self.suffix_threshold is not None:
                similar = similar | (suffix[:, l - 1] / l > self.suffix_threshold)
            if self.rouge_threshold is not None:
                similar = similar | (lcs[:, l - 1] / l > self.rouge_threshold)
        return eligible & (ref != jnp.arange(W)[None, :]) & similar.reshape(P, W)
