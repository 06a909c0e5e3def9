"""Slow, loop-based NumPy (float64) references written straight from each estimator's formula.

Groups and nodes are identified by path *prefixes* (tuples of node ids), as the official TreePO code does
with its "#"-joined path strings, independently of the JAX implementation's node tables.

Discrete decisions ("this subgroup's rewards are all equal", "these children's values are all equal") are
made in exact rational arithmetic (``fractions.Fraction`` of the float32 rewards), never by testing a float
std against 0: a float64 ``np.std`` of equal values can be ~1e-17 instead of 0 (e.g. means of 0.3 over groups
of different sizes), which would flip the decision the float32 kernel makes exactly (it compares rewards, or
values computed so that equal means are bit-equal).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np


def all_equal(values) -> bool:
    """Exact test: every value equal (as rationals; a float converts to Fraction exactly)."""
    return len({Fraction(float(v)) for v in values}) <= 1


def prefixes(row) -> list[tuple]:
    nodes = [int(n) for n in row if n >= 0]
    return [tuple(nodes[: d + 1]) for d in range(len(nodes))]


def leaves_under(paths_W) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(paths_W):
        for key in prefixes(row):
            groups.setdefault(key, []).append(i)
    return groups


def token_mask(lengths_PxW, T):
    return (np.arange(T)[None, None, :] < np.asarray(lengths_PxW)[:, :, None]).astype(np.float64)


def whiten(x, mask, eps=1e-8):
    n = mask.sum()
    if n == 0:
        return np.zeros_like(x)
    mu = (x * mask).sum() / n
    var = (((x - mu) ** 2) * mask).sum() / n
    if n > 1:
        var *= n / (n - 1)
    return np.where(mask > 0, (x - mu) / np.sqrt(var + eps), 0.0)


def leaf_tokens(leaf_PxW, mask):
    return np.where(mask > 0, np.asarray(leaf_PxW, np.float64)[:, :, None], 0.0)


def segment_tokens(seg_PxWxD, mask, S):
    P, W, T = mask.shape
    out = np.zeros((P, W, T))
    for p in range(P):
        for i in range(W):
            for t in range(T):
                if mask[p, i, t] > 0:
                    out[p, i, t] = seg_PxWxD[p, i, t // S]
    return out


def grpo(R, scale_by_std=True, unbiased=True, eps=1e-6, centred=None):
    """``centred`` [P, W]: the centred rewards to scale (default ``R - mean R``; e.g. :func:`other_subtrees`)."""
    R = np.asarray(R, np.float64)
    out = np.zeros_like(R)
    for p in range(R.shape[0]):
        r = R[p]
        dev = r - r.mean() if centred is None else centred[p]
        if scale_by_std:
            std = r.std(ddof=1) if (unbiased and len(r) > 1) else (r.std() if not unbiased else 0.0)
            dev = dev / (std + eps)
        out[p] = dev
    return out


def rloo(R):
    R = np.asarray(R, np.float64)
    P, W = R.shape
    out = np.zeros_like(R)
    for p in range(P):
        for i in range(W):
            others = [R[p, j] for j in range(W) if j != i]
            out[p, i] = R[p, i] - np.mean(others) if others else 0.0
    return out


def other_subtrees(paths, R):
    """``R_i - mean of R_j over leaves j under another depth-1 node`` (0 when there is none)."""
    R = np.asarray(R, np.float64)
    P, W = R.shape
    out = np.zeros_like(R)
    for p in range(P):
        for i in range(W):
            others = [R[p, j] for j in range(W) if paths[p, j, 1] != paths[p, i, 1]]
            out[p, i] = R[p, i] - np.mean(others) if others else 0.0
    return out


def rfpp_raw(R):
    R = np.asarray(R, np.float64)
    return R - R.mean(axis=1, keepdims=True)


def treepo_raw(paths, R, weighting="average", reject_zero_std=False):
    R = np.asarray(R, np.float64)
    P, W, _ = paths.shape
    out = np.zeros((P, W))
    for p in range(P):
        groups = leaves_under(paths[p])
        for i in range(W):
            terms, sizes = [], []
            keys = prefixes(paths[p, i])
            for d, key in enumerate(keys):
                members = groups[key]
                rs = R[p, members]
                if d > 0 and (len(members) <= 1 or d == len(keys) - 1):  # single leaf, or the leaf's own end node
                    continue
                if d > 0 and reject_zero_std and all_equal(rs):
                    continue
                terms.append(R[p, i] - rs.mean())
                sizes.append(len(members))
            terms, sizes = np.array(terms), np.array(sizes, np.float64)
            out[p, i] = terms.mean() if weighting == "average" else (terms * sizes).sum() / sizes.sum()
    return out


def node_values(paths_W, r_W, node_value="leaf_mean", exact=False):
    """{path prefix: V}; ``exact=True`` gives the values as Fractions (for tie decisions), else floats."""
    groups = leaves_under(paths_W)
    ends = {tuple(prefixes(row)[-1]): i for i, row in enumerate(paths_W)}
    num = (lambda x: Fraction(float(x))) if exact else float
    if node_value == "leaf_mean":
        return {key: sum(num(r_W[i]) for i in m) / len(m) for key, m in groups.items()}
    values: dict = {}

    def value(key):
        if key in values:
            return values[key]
        if key in ends:
            v = num(r_W[ends[key]])
        else:
            children = sorted({k for k in groups if len(k) == len(key) + 1 and k[:-1] == key})
            v = sum(value(c) for c in children) / len(children)
        values[key] = v
        return v

    for key in groups:
        value(key)
    return values


def treepo_segment_raw(paths, R, eta=1.0, node_value="leaf_mean", root_value="mean"):
    R = np.asarray(R, np.float64)
    P, W, D1 = paths.shape
    out = np.zeros((P, W, D1 - 1))
    for p in range(P):
        V = node_values(paths[p], R[p], node_value)
        if root_value == "zero":
            V[(0,)] = 0.0
        for i in range(W):
            pre = prefixes(paths[p, i])
            depth = len(pre) - 1
            for k in range(depth):
                out[p, i, k] = V[pre[k + 1]] - eta ** (depth - k) * V[pre[k]]
    return out


def spo_tree_raw(paths, R, normalize=False, eps=1e-6, node_value="leaf_mean"):
    R = np.asarray(R, np.float64)
    P, W, D1 = paths.shape
    out = np.zeros((P, W, D1 - 1))
    for p in range(P):
        V = node_values(paths[p], R[p], node_value)
        exact = node_values(paths[p], R[p], node_value, exact=True) if normalize else None
        for i in range(W):
            pre = prefixes(paths[p, i])
            for k in range(len(pre) - 1):
                a = V[pre[k + 1]] - V[pre[k]]
                if normalize:
                    children = {key for key in V if len(key) == k + 2 and key[:-1] == pre[k]}
                    # std == 0 exactly iff all children's values are equal: decided on exact values
                    std = np.std([V[c] for c in children])
                    a = 0.0 if len({exact[c] for c in children}) == 1 else a / (std + eps)
                out[p, i, k] = a
    return out


def mc_grpo(R, normalize=True, std_fallback=True, eps=1e-6):
    R = np.asarray(R, np.float64)
    P, W = R.shape
    adv = np.zeros((P, W))
    pivot = np.zeros((P, W), bool)
    for p in range(P):
        r = R[p]
        order = sorted(range(W), key=lambda i: (r[i], i))
        piv = order[(W - 1) // 2]
        med = r[piv]
        a = r - med
        if normalize:
            mad = sorted(np.abs(r - med))[(W - 1) // 2]
            scale = mad if (mad > 0 or not std_fallback) else r.std()
            a = a / (scale + eps)
        a[piv] = 0.0
        adv[p], pivot[p, piv] = a, True
    return adv, pivot
