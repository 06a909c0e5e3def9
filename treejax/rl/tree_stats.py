"""Does a tree pay? Host-side statistics of a rollout forest: weighted leaf means, sibling correlation, effective
sample size (used by the loop's ``rollout/*`` metrics and by ``experiments/compare_rollouts.py``).

A tree decodes shared prefixes once, so it costs fewer tokens per leaf than independent sampling, but leaves that
share a prefix are correlated and carry less information than independent samples. Both effects are measured here
on the leaf *slots* of a forest with their weights ``w_i`` (``Forest.leaf_weight``: 1 per slot for slot trees and
independent samples, ``W`` x path mass for TreePO's ``"transfer"`` trees).

Sibling correlation of a per-leaf quantity ``x`` (reward, length). Two leaves of one prompt are *siblings* when
they share their depth-1 node (a slot tree's copies of one path included), *across* otherwise. With
``gamma = E[(x_i - x_j)^2] / 2`` over pairs of one prompt (weighted by ``w_i w_j``), ``gamma_across = sigma^2``
when the depth-1 subtrees are independent draws (slot trees, independent samples) and ``gamma_sib = sigma^2 (1 -
rho)``, so::

    rho = 1 - gamma_sib / gamma_across

(half squared differences need no prompt mean, so prompts of different difficulty do not inflate ``rho``).

Effective sample size of the prompt's weighted mean ``sum_i w_i x_i / sum_i w_i`` with that ``rho`` (pairs
across subtrees uncorrelated)::

    ESS = (sum_i w_i)^2 / (sum_i w_i^2 + rho * sum_{i != j siblings} w_i w_j)

``W`` for ``W`` independent samples, ``k`` for a slot tree whose ``k`` depth-1 subtrees are each one answer
repeated (``rho = 1``). ESS per decoded token against independent sampling's says whether the tree's token saving
outweighs its correlation.
"""

from __future__ import annotations

import numpy as np


def _pairs(leaf_path_PxWxD1: np.ndarray, weight_PxW: np.ndarray):
    """Per prompt: pair weights ``w_i w_j`` (i != j, both used) and the sibling mask (same depth-1 node)."""
    w = np.asarray(weight_PxW, np.float64)
    first = np.asarray(leaf_path_PxWxD1)[:, :, 1]
    used = np.asarray(leaf_path_PxWxD1)[:, :, 0] >= 0
    W = w.shape[1]
    pair_w = w[:, :, None] * w[:, None, :] * (used[:, :, None] & used[:, None, :]) * (1 - np.eye(W))[None]
    sib = (first[:, :, None] == first[:, None, :]) & (first[:, :, None] >= 0)
    return pair_w, sib


def sibling_sums(leaf_path_PxWxD1, weight_PxW, x_PxW) -> dict:
    """Sums of ``w_i w_j (x_i - x_j)^2 / 2`` and of ``w_i w_j`` over sibling and across pairs (to pool over
    batches before :func:`sibling_correlation`)."""
    pair_w, sib = _pairs(leaf_path_PxWxD1, weight_PxW)
    x = np.asarray(x_PxW, np.float64)
    half_sq = 0.5 * (x[:, :, None] - x[:, None, :]) ** 2
    return {"sib": float(np.sum(pair_w * sib * half_sq)), "sib_w": float(np.sum(pair_w * sib)),
            "across": float(np.sum(pair_w * ~sib * half_sq)), "across_w": float(np.sum(pair_w * ~sib))}


def add_sums(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {k: a[k] + b[k] for k in a}


def sibling_correlation(sums: dict) -> float:
    """``rho = 1 - gamma_sib / gamma_across`` (module docstring); NaN without sibling pairs, across pairs or spread
    across subtrees."""
    if sums["sib_w"] <= 0 or sums["across_w"] <= 0 or sums["across"] <= 0:
        return float("nan")
    return 1.0 - (sums["sib"] / sums["sib_w"]) / (sums["across"] / sums["across_w"])


def effective_samples(leaf_path_PxWxD1, weight_PxW, rho: float) -> np.ndarray:
    """float[P]: ESS of each prompt's weighted leaf mean under sibling correlation ``rho`` (module docstring);
    ``rho`` is clipped to ``[0, 1]`` (NaN, undefined, is taken as 0): a negative estimate is noise around 0 for
    leaves that share a prefix, and would make the variance formula meaningless near ``rho = -1 / (m - 1)``."""
    rho = float(np.clip(rho, 0.0, 1.0)) if np.isfinite(rho) else 0.0
    pair_w, sib = _pairs(leaf_path_PxWxD1, weight_PxW)
    w = np.asarray(weight_PxW, np.float64) * (np.asarray(leaf_path_PxWxD1)[:, :, 0] >= 0)
    denom = np.sum(w * w, axis=1) + rho * np.sum(pair_w * sib, axis=(1, 2))
    return np.sum(w, axis=1) ** 2 / np.maximum(denom, 1e-12)


def weighted_mean(x_PxW, weight_PxW) -> float:
    w = np.asarray(weight_PxW, np.float64)
    return float(np.sum(w * np.asarray(x_PxW, np.float64)) / max(np.sum(w), 1e-12))
