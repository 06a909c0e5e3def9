"""Slow, loop-based NumPy (float64) references for the multi-turn estimators (:mod:`treejax.rl.advantages.agentic`
and ``agentic_tree``), written from each docstring's formula, independently of the JAX code.

Nodes are identified by path *prefixes* (tuples of node ids); states are compared by their actual observation
token tuples (never by hashes); every leaf slot is one sample. Everything works on one prompt at a time; the
``*_all`` drivers loop over prompts and return [P, W, D] segments or [P, W] leaf values.
"""

from __future__ import annotations

import numpy as np


class Prompt:
    """One prompt's host arrays and the per-node content read from the tokens of the slots."""

    def __init__(self, forest, p: int):
        self.paths = np.asarray(forest.leaf_path)[p]
        self.W, D1 = self.paths.shape
        self.D = D1 - 1
        tokens = np.asarray(forest.tokens)[p]
        seg = np.asarray(forest.segment_index)[p]
        pm = np.ones(tokens.shape) if forest.policy_mask is None else np.asarray(forest.policy_mask)[p]
        self.depth = [int(np.sum(self.paths[w, 1:] >= 0)) for w in range(self.W)]
        self.obs, self.all = {}, {}  # (w, d) -> token tuple of slot w's depth-d node
        for w in range(self.W):
            self.obs[(w, 0)] = self.all[(w, 0)] = ()
            for d in range(1, self.depth[w] + 1):
                at = seg[w] == d - 1
                self.all[(w, d)] = tuple(int(x) for x in tokens[w][at])
                self.obs[(w, d)] = tuple(int(x) for x in tokens[w][at & (pm[w] == 0)])

    def prefix(self, w, d):
        return tuple(int(x) for x in self.paths[w, : d + 1])

    def steps(self):
        return [(w, d) for w in range(self.W) for d in range(1, self.depth[w] + 1)]

    def state(self, w, d):
        """Observation content of the depth-d node of slot w, or its identity when it has none."""
        o = self.obs[(w, d)]
        return ("obs", o) if o else ("node", self.prefix(w, d))

    def content(self, w, d):
        return ("all", self.all[(w, d)])

    def through(self, key):
        """Slots whose path passes the node with path prefix ``key``."""
        d = len(key) - 1
        return [w for w in range(self.W) if self.depth[w] >= d and self.prefix(w, d) == key]


def z(values, scale_by_std, unbiased, eps):
    """Group-relative values: ``x - mean`` (/ (std + eps)); a group of one gives 0."""
    x = np.asarray(values, np.float64)
    if len(x) <= 1:
        return np.zeros_like(x)
    out = x - x.mean()
    if scale_by_std:
        out = out / (x.std(ddof=1 if unbiased else 0) + eps)
    return out


def grpo(R, scale_by_std=True, unbiased=True, eps=1e-6):
    return z(R, scale_by_std, unbiased, eps)


def step_return(pr: Prompt, R, gamma):
    """{path prefix: mean over the slots through it of gamma^(D_w - d) R_w}."""
    out = {}
    for w, d in pr.steps():
        key = pr.prefix(w, d)
        if key not in out:
            slots = pr.through(key)
            out[key] = np.mean([gamma ** (pr.depth[v] - d) * R[v] for v in slots])
    return out


def grouped(keys: dict):
    """{step: [steps with the same key]} for the steps whose key is not None."""
    by = {}
    for s, k in keys.items():
        if k is not None:
            by.setdefault(k, []).append(s)
    return {s: by[k] for s, k in keys.items() if k is not None}


def gigpo(pr: Prompt, R, mode="mean_norm", omega=1.0, gamma=0.95, match_observations=True, eps=1e-6):
    std = mode == "mean_std_norm"
    episode = grpo(R, std, True, eps)
    G = step_return(pr, R, gamma)
    keys = {(w, d): (pr.state(w, d - 1) if match_observations else ("node", pr.prefix(w, d - 1)))
            for w, d in pr.steps()}
    groups = grouped(keys)
    seg = np.zeros((pr.W, pr.D))
    for (w, d), members in groups.items():
        vals = [G[pr.prefix(v, e)] for v, e in members]
        a = z(vals, std, True, eps)[members.index((w, d))]
        seg[w, d - 1] = episode[w] + omega * a
    return seg


def hgpo(pr: Prompt, R, max_observations=3, alpha=1.0, weight_offset=0, gamma=0.95, scale_by_std=False,
         skip_zero=True, trajectory_weight=0.0, eps=1e-6):
    G = step_return(pr, R, gamma)
    num = {s: 0.0 for s in pr.steps()}
    den = {s: 0.0 for s in pr.steps()}
    for k in range(1, max_observations + 1):
        keys = {(w, d): (tuple(pr.state(w, d - j) for j in range(1, k + 1)) if d >= k else None)
                for w, d in pr.steps()}
        for s, members in grouped(keys).items():
            if len(members) < 2:
                continue
            a = z([G[pr.prefix(v, e)] for v, e in members], scale_by_std, False, eps)[members.index(s)]
            if skip_zero and abs(a) < 1e-7:
                continue
            wk = (k + weight_offset) ** alpha
            num[s] += wk * a
            den[s] += wk
    if trajectory_weight > 0:
        episode = grpo(R, scale_by_std, True, eps)
        for w, d in pr.steps():
            num[(w, d)] += trajectory_weight * episode[w]
            den[(w, d)] += trajectory_weight
    seg = np.zeros((pr.W, pr.D))
    for (w, d) in pr.steps():
        seg[w, d - 1] = num[(w, d)] / den[(w, d)] if den[(w, d)] > 0 else 0.0
    return seg


def salt(pr: Prompt, R, merge="node", scale_by_std=True, unbiased_std=True, eps=1e-6):
    A = grpo(R, scale_by_std, unbiased_std, eps)
    key = {"node": lambda w, d: pr.prefix(w, d), "observation": lambda w, d: (d, pr.state(w, d)),
           "content": lambda w, d: (d, pr.content(w, d))}[merge]
    groups = grouped({(w, d): key(w, d) for w, d in pr.steps()})
    seg = np.zeros((pr.W, pr.D))
    for (w, d), members in groups.items():
        seg[w, d - 1] = np.mean([A[v] for v, _ in members])
    return seg


def tree_grpo(pr: Prompt, R, mode="sum", scale_by_std=True, unbiased_std=True, eps=1e-6):
    inter = z(R, scale_by_std, unbiased_std, eps)
    out = np.zeros(pr.W)
    for w in range(pr.W):
        tree = [v for v in range(pr.W) if pr.paths[v, 1] == pr.paths[w, 1]]
        src = inter if mode == "two_stage" else R
        intra = z([src[v] for v in tree], scale_by_std, unbiased_std, eps)[tree.index(w)]
        out[w] = intra if mode == "two_stage" else inter[w] + intra
    return out


def mc_value(pr: Prompt, key, R):
    return np.mean([R[v] for v in pr.through(key)])


def treeps(pr: Prompt, R, normalize=False, episode_weight=0.0, eps=1e-6):
    episode = grpo(R, True, True, eps)
    scale = 1.0 / (np.std(R, ddof=1) + eps) if normalize else 1.0
    seg = np.zeros((pr.W, pr.D))
    for w, d in pr.steps():
        proc = mc_value(pr, pr.prefix(w, d), R) - mc_value(pr, pr.prefix(w, d - 1), R)
        seg[w, d - 1] = proc * scale + episode_weight * episode[w]
    return seg


def portool(pr: Prompt, R, beta=0.5, unbiased_std=True, eps=1e-6, success=None, tool_weight=0.0):
    def s(w, e):
        if success is None:
            return 0.0
        x = success[pr.paths[w, e]]
        return float(x) if np.isfinite(x) and x >= 0 else 0.0

    def ret(w, d):
        return R[w] + tool_weight * sum(s(w, e) for e in range(d, pr.depth[w] + 1))

    def value(key):
        d = len(key) - 1
        return np.mean([ret(v, d) for v in pr.through(key)])

    traj = grpo([ret(w, 1) if pr.depth[w] >= 1 else R[w] for w in range(pr.W)], True, unbiased_std, eps)
    seg = np.zeros((pr.W, pr.D))
    for w, d in pr.steps():
        parent = pr.prefix(w, d - 1)
        children = sorted({pr.prefix(v, d) for v in pr.through(parent) if pr.depth[v] >= d})
        fork = 0.0
        if len(children) >= 2:
            vals = [value(c) for c in children]
            fork = z(vals, True, unbiased_std, eps)[children.index(pr.prefix(w, d))]
        seg[w, d - 1] = (1 - beta) * traj[w] + beta * fork
    return seg


SEGMENT_REFS = {"gigpo": gigpo, "hgpo": hgpo, "salt": salt, "treeps": treeps, "portool": portool}


def expected(name, options, forest, R, **inputs):
    """(kind, values): "segments" [P, W, D] or "leaves" [P, W] for estimator ``name`` with ``options``."""
    R = np.asarray(R, np.float64)
    P = R.shape[0]
    kw = {f.name: getattr(options, f.name) for f in options.__dataclass_fields__.values()}
    if name == "tree_grpo":
        return "leaves", np.stack([tree_grpo(Prompt(forest, p), R[p], **kw) for p in range(P)])
    if name == "portool_tool":
        succ = np.asarray(inputs["tool_success_PxN"], np.float64)
        return "segments", np.stack([portool(Prompt(forest, p), R[p], success=succ[p], **kw) for p in range(P)])
    return "segments", np.stack([SEGMENT_REFS[name](Prompt(forest, p), R[p], **kw) for p in range(P)])


def to_tokens(forest, kind, values):
    """Per-token values: each policy token of a slot takes its node's (or its leaf's) value; 0 elsewhere."""
    seg = np.asarray(forest.segment_index)
    P, W, T = seg.shape
    pm = np.ones((P, W, T)) if forest.policy_mask is None else np.asarray(forest.policy_mask)
    out = np.zeros((P, W, T))
    for p in range(P):
        for w in range(W):
            for t in range(T):
                if seg[p, w, t] >= 0 and pm[p, w, t] > 0:
                    out[p, w, t] = values[p, w] if kind == "leaves" else values[p, w, seg[p, w, t]]
    return out
