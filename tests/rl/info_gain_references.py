"""Slow, loop-based references of the ground-truth scoring pass and the IGPO / A2TGPO estimators (float64 NumPy,
one leaf / turn / node at a time), written from the formulas in the modules' docstrings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import transformer as T


def node_ends(leaf_path: np.ndarray, node_length: np.ndarray) -> dict:
    """{(p, n): end of node n's span} from the paths and the node lengths (the root ends at 0)."""
    ends = {}
    P, W, D1 = leaf_path.shape
    for p in range(P):
        ends[(p, 0)] = 0
        for w in range(W):
            total = 0
            for d in range(1, D1):
                n = int(leaf_path[p, w, d])
                if n < 0:
                    break
                total += int(node_length[p, n])
                ends[(p, n)] = total
    return ends


def truth_logp(params, config, prompts, prompt_lengths, leaf_path, node_length, tokens, answers, answer_lengths,
               scored, num_nodes, width: int = 32) -> np.ndarray:
    """[P, N]: one direct forward per (prompt, node on a path) of prompt ++ response through n ++ answer, scored with
    a full-vocabulary log-softmax. Each sequence runs alone, zero-padded on the right to ``width`` (one compilation;
    plain causal attention, so the padding never reaches the sequence's own positions)."""
    P = prompts.shape[0]
    out = np.zeros((P, num_nodes))
    ends = node_ends(leaf_path, node_length)

    @jax.jit
    def seq_logp(x):
        h = T.forward(params, config, x, jnp.arange(width, dtype=jnp.int32)[None])
        return jax.nn.log_softmax(T.logits(params, config, h).astype(jnp.float32), axis=-1)[0]

    for (p, n), end in ends.items():
        w = next(w for w in range(leaf_path.shape[1]) if n in set(leaf_path[p, w].tolist()))
        ans = list(answers[p, :answer_lengths[p]])
        seq = list(prompts[p, :prompt_lengths[p]]) + list(tokens[p, w, :end]) + ans
        assert len(seq) <= width
        logp = np.asarray(seq_logp(jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)), np.float64)
        start = prompt_lengths[p] + end
        vals = [float(logp[start + j - 1, ans[j]]) for j in range(len(ans)) if scored[p, j] > 0]
        out[p, n] = sum(vals) / len(vals) if vals else 0.0
    return out


def _turns(leaf_path, p, w):
    return [int(n) for n in leaf_path[p, w, 1:] if n >= 0] if leaf_path[p, w, 0] >= 0 else []


def _parent_on_path(leaf_path, p, w, t):
    return int(leaf_path[p, w, t])  # the path entry before turn t's node (depth t)


def _value(truth, p, n, kind):
    return math.exp(truth[p, n]) if kind == "prob_diff" else float(truth[p, n])


def _normalize(entries, scale_by_std, eps):
    """entries: list of (key, x, weight) -> {key: normalised x} (weighted mean / population std, official rule)."""
    if not entries:
        return {}
    sw = sum(e[2] for e in entries)
    mean = sum(e[1] * e[2] for e in entries) / sw
    var = sum(e[2] * (e[1] - mean) ** 2 for e in entries) / sw
    std = 1.0 if len(entries) <= 1 else math.sqrt(var + 1e-8)
    return {k: ((x - mean) / (std + eps) if scale_by_std else x - mean) for k, x, _ in entries}


def igpo_turns(leaf_path, R, truth, weight, o) -> np.ndarray:
    """[P, W, D] IGPO turn advantages."""
    P, W, D1 = leaf_path.shape
    out = np.zeros((P, W, D1 - 1))
    for p in range(P):
        kinds = {"final": [], "ig": []}
        for w in range(W):
            nodes = _turns(leaf_path, p, w)
            for t, n in enumerate(nodes):
                if t == len(nodes) - 1:
                    kinds["final"].append(((w, t), o.outcome_coef * float(R[p, w]), float(weight[p, w])))
                else:
                    ig = _value(truth, p, n, o.info_gain) - _value(truth, p, _parent_on_path(leaf_path, p, w, t),
                                                                      o.info_gain)
                    kinds["ig"].append(((w, t), o.info_gain_coef * ig, float(weight[p, w])))
        if o.normalization == "joint":
            r_hat = _normalize(kinds["final"] + kinds["ig"], o.scale_by_std, o.eps)
        else:
            r_hat = {**_normalize(kinds["final"], o.scale_by_std, o.eps), **_normalize(kinds["ig"], o.scale_by_std,
                                                                                       o.eps)}
        for w in range(W):
            K = len(_turns(leaf_path, p, w))
            for t in range(K):
                out[p, w, t] = sum(o.gamma ** (k - t) * r_hat[(w, k)] for k in range(t, K))
    return out


def a2tgpo_turns(leaf_path, R, truth, weight, o) -> tuple[np.ndarray, np.ndarray]:
    """([P, W, D] advantages, [P, W, D] clip scales) of A2TGPO."""
    P, W, D1 = leaf_path.shape
    adv = np.zeros((P, W, D1 - 1))
    clip = np.ones((P, W, D1 - 1))
    for p in range(P):
        used = [w for w in range(W) if leaf_path[p, w, 0] >= 0]
        outcome = _normalize([(w, float(R[p, w]), float(weight[p, w])) for w in used], o.scale_by_std, o.eps)
        z = {}
        for t in range(D1 - 1):
            entries = []
            for w in used:
                nodes = _turns(leaf_path, p, w)
                if t < len(nodes) - 1:
                    ig = (_value(truth, p, nodes[t], o.info_gain)
                          - _value(truth, p, _parent_on_path(leaf_path, p, w, t), o.info_gain))
                    entries.append(((w, t), ig, float(weight[p, w])))
            z.update(_normalize(entries, o.scale_by_std, o.eps))
        for w in used:
            K = len(_turns(leaf_path, p, w))
            for t in range(K):
                if t == K - 1:
                    adv[p, w, t] = outcome[w]
                else:
                    D = sum(o.gamma ** (k - t) * z[(w, k)] for k in range(t, K - 1)) / math.sqrt(K - 1 - t)
                    adv[p, w, t] = outcome[w] + o.alpha * D
                    clip[p, w, t] = 1.0 + o.clip_beta * (2.0 / (1.0 + math.exp(-z[(w, t)])) - 1.0)
    return adv, clip


def turn_tokens(leaf_path, node_length, policy_mask, turns, T_len, fill=0.0) -> np.ndarray:
    """Per-turn values -> [P, W, T]: a turn's value on its policy tokens, ``fill`` on observations and padding."""
    P, W, _ = leaf_path.shape
    out = np.full((P, W, T_len), fill)
    for p in range(P):
        for w in range(W):
            pos = 0
            for t, n in enumerate(_turns(leaf_path, p, w)):
                for i in range(pos, pos + int(node_length[p, n])):
                    if policy_mask[p, w, i] > 0:
                        out[p, w, i] = turns[p, w, t]
                pos += int(node_length[p, n])
    return out
