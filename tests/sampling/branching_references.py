"""Slow, obviously-correct Python references of the branching rules (``treejax.sampling.branching``).

Every function takes host (NumPy) copies of one boundary's :class:`PathStats` fields as a dict ``s`` (keys are the
field names) and loops over prompts, paths and tokens in plain Python (float64)."""

from __future__ import annotations

import math

import numpy as np


def budget(s, W, b, transfer=True):
    """TreePO's ``total = max(min(W - F, b A + b f), A)`` per prompt (F counts this boundary's ended paths)."""
    out = []
    for p in range(len(s["leaves_P"])):
        A = int(s["live_PxW"][p].sum())
        f = int(s["ended_PxW"][p].sum())
        F = int(s["leaves_P"][p]) + f
        out.append(max(min(W - F, b * A + (b * f if transfer else 0)), A))
    return np.array(out)


def fixed_average(live, total, remainder):
    counts = np.zeros(live.shape, int)
    for p in range(live.shape[0]):
        idx = [w for w in range(live.shape[1]) if live[p, w]]
        if not idx:
            continue
        tot = max(int(total[p]), len(idx))
        base, rem = divmod(tot, len(idx))
        for k, w in enumerate(idx):
            counts[p, w] = base + (rem if remainder == "last" and k == len(idx) - 1 else 0)
            counts[p, w] += 1 if remainder == "first" and k < rem else 0
    return counts


def capped(score, cap, live, total, spill):
    """1 per live path; extra ``total - A`` down the score ranking (ties: lower index), ``cap`` each; the rest
    evenly (one more each to the first paths) when ``spill``."""
    counts = np.zeros(live.shape, int)
    for p in range(live.shape[0]):
        idx = [w for w in range(live.shape[1]) if live[p, w]]
        extra = max(int(total[p]) - len(idx), 0)
        for w in idx:
            counts[p, w] = 1
        for w in sorted(idx, key=lambda w: (-score[p, w], w)):
            take = min(int(max(cap[p, w], 0)), extra)
            counts[p, w] += take
            extra -= take
        if spill and idx:
            base, rem = divmod(extra, len(idx))
            for k, w in enumerate(idx):
                counts[p, w] += base + (1 if k < rem else 0)
    return counts


def _segment(s, p, w):
    return range(int(s["segment_start_PxW"][p, w]), int(s["length_PxW"][p, w]))


def entropy_scores(s, statistic, reduce):
    P, W = s["live_PxW"].shape
    out = np.full((P, W), -np.inf)
    for p in range(P):
        for w in range(W):
            h = [float(s["entropy_PxWxT"][p, w, t]) if statistic == "entropy" else -float(s["logp_PxWxT"][p, w, t])
                 for t in _segment(s, p, w)]
            if h:
                out[p, w] = sum(h) / len(h) if reduce == "mean" else max(h)
            elif reduce == "mean":
                out[p, w] = 0.0
    return out


# ----------------------------------------------------------------------------------------------- LATR
def latr_uncertain(s, p_min, gap):
    P, W = s["live_PxW"].shape
    n = np.zeros((P, W), int)
    for p in range(P):
        for w in range(W):
            for t in _segment(s, p, w):
                p1, p2 = math.exp(s["topk_PxWxTxK"][p, w, t, 0]), math.exp(s["topk_PxWxTxK"][p, w, t, 1])
                n[p, w] += int(p2 > p_min and p1 - p2 < gap)
    return n


def suffix_match(a, b):
    """LATR's ``suffix_match_score``: longest suffix of one found contiguously in the other, over the length."""
    def longest(x, y):
        best = 0
        for L in range(1, len(x) + 1):
            suf = x[len(x) - L:]
            if any(y[i:i + L] == suf for i in range(len(y) - L + 1)):
                best = L
        return best
    return max(longest(a, b), longest(b, a)) / len(a)


def rouge_l(a, b):
    m, n = len(a), len(b)
    L = [[0] * (n + 1) for _ in range(m + 1)]
    for i in range(m):
        for j in range(n):
            L[i + 1][j + 1] = L[i][j] + 1 if a[i] == b[j] else max(L[i][j + 1], L[i + 1][j])
    lcs = L[m][n]
    prec, rec = lcs / m, lcs / n
    return 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)


def latr_prune(s, lookahead, suffix_threshold, rouge_threshold, S):
    P, W = s["live_PxW"].shape
    prune = np.zeros((P, W), bool)
    windows = sorted({min(x, S) for x in lookahead})
    for p in range(P):
        groups = {}
        for w in range(W):
            d = int(s["depth_PxW"][p, w])
            if s["live_PxW"][p, w] and d >= 2:
                groups.setdefault(int(s["path_PxWxD1"][p, w, d - 1]), []).append(w)
        for members in groups.values():
            ref = min(members, key=lambda w: int(s["path_PxWxD1"][p, w, s["depth_PxW"][p, w]]))
            for w in members:
                if w == ref:
                    continue
                seg_w = [int(s["tokens_PxWxT"][p, w, t]) for t in _segment(s, p, w)]
                seg_r = [int(s["tokens_PxWxT"][p, ref, t]) for t in _segment(s, p, ref)]
                for l in windows:
                    a, b = seg_w[:l], seg_r[:l]
                    if ((suffix_threshold is not None and suffix_match(a, b) > suffix_threshold)
                            or (rouge_threshold is not None and rouge_l(a, b) > rouge_threshold)):
                        prune[p, w] = True
    return prune


# ----------------------------------------------------------------------------------------------- ECHO
def echo_signals(s, p, w, rule):
    """``DeepConfBranchController._compute_step_stats`` on one path's tokens (full-vocabulary H and top-k)."""
    n = int(s["length_PxW"][p, w])
    H, C, out = [], [], []
    for t in range(n):
        h = float(s["entropy_PxWxT"][p, w, t])
        c = -float(np.mean([math.log(math.exp(x) + 1e-9) for x in s["topk_PxWxTxK"][p, w, t]]))
        H.append(h)
        C.append(c)
        tail = float(np.mean(C[max(0, len(C) - rule.tail_window):]))
        group = float(np.mean(C[max(0, len(C) - rule.group_window):]))
        prev = H[max(0, len(H) - rule.entropy_window - 1): len(H) - 1]
        dh = h - (float(np.mean(prev)) if prev else h)
        out.append(dict(entropy=h, tail=tail, group=group, delta=dh))
    return out


def echo_width(rule, h, g):
    raw = (1 + rule.alpha * (h - rule.entropy_low) / (rule.entropy_high - rule.entropy_low)
           - rule.beta * (g - rule.branch_threshold) / abs(rule.branch_threshold))
    return int(np.clip(np.round(raw), 1, rule.max_branches))


def echo_widths(s, rule):
    P, W = s["live_PxW"].shape
    out = np.ones((P, W), int)
    for p in range(P):
        for w in range(W):
            st = echo_signals(s, p, w, rule)
            for t in _segment(s, p, w):
                x = st[t]
                if (t >= rule.min_depth and x["entropy"] >= rule.entropy_high and x["group"] <= rule.branch_threshold
                        and x["delta"] >= rule.entropy_delta_threshold):
                    out[p, w] = echo_width(rule, x["entropy"], x["group"])
                    break
    return out


def echo_prune(s, rule):
    """``DeepConfBranchController.should_prune`` on every path's tokens so far."""
    P, W = s["live_PxW"].shape
    out = np.zeros((P, W), bool)
    for p in range(P):
        for w in range(W):
            run_min, prev_tail, decline, rise = np.inf, None, 0, 0
            for x in echo_signals(s, p, w, rule):
                run_min = min(run_min, x["group"])
                decline = decline + 1 if prev_tail is not None and x["tail"] < prev_tail else 0
                prev_tail = x["tail"]
                rise = rise + 1 if x["delta"] > 0 else 0
                if (run_min < rule.prune_threshold
                        or (decline >= rule.tail_decline_steps and x["tail"] <= rule.tail_threshold)
                        or (rise >= rule.delta_rise_steps and x["delta"] > rule.delta_upper)):
                    out[p, w] = True
                    break
    return out


# ----------------------------------------------------------------------------------------------- ETS
def ets_rebase(scores, keep, width, T, ties_high_first=False):
    """REBASE's sequential ceil split of ``width`` over the kept entries of one prompt (list of ints)."""
    idx = [i for i in range(len(scores)) if keep[i]]
    idx.sort(key=lambda i: (-scores[i], -i if ties_high_first else i))
    top = max((scores[i] / T for i in idx), default=0.0)
    e = {i: math.exp(scores[i] / T - top) for i in idx}
    out, left = [0] * len(scores), max(int(width), 0)
    for k, i in enumerate(idx):
        rest = sum(e[j] for j in idx[k:])
        n = min(max(math.ceil(left * e[i] / rest - 1e-5), 0), left)
        out[i], left = n, left - n
    return out


def ets_clusters(seg_tokens, live, dim, threshold):
    """Cluster label (lowest member row) of each live row: scipy's average linkage on cosine distances of the
    rows' token-count vectors, cut at ``threshold`` (``fcluster(..., 'distance')``)."""
    from scipy.cluster.hierarchy import fcluster, linkage

    rows = [w for w in range(len(live)) if live[w]]
    labels = list(range(len(live)))
    if len(rows) < 2:
        return labels
    emb = np.zeros((len(rows), dim))
    for k, w in enumerate(rows):
        for t in seg_tokens[w]:
            if t >= 0:
                emb[k, t % dim] += 1
    flat = fcluster(linkage(emb, method="average", metric="cosine"), threshold, criterion="distance")
    for k, w in enumerate(rows):
        labels[w] = min(rows[j] for j in range(len(rows)) if flat[j] == flat[k])
    return labels


def ets_objective(chosen, O, live, path, depth, labels, cost_weight, coverage_weight):
    """The ETS program's objective of the set ``chosen`` of rows (sets of ancestors and clusters, float64)."""
    cand = [w for w in range(len(live)) if live[w]]

    def anc(rows):
        return {(d, int(path[w][d])) for w in rows for d in range(int(depth[w]))}

    M, K = len(anc(cand)), len({labels[w] for w in cand})
    kappa = (-cost_weight if cost_weight > 0 else 1e-4) / max(M + len(cand), 1)
    return (sum(O[w] for w in chosen) + kappa * (len(chosen) + len(anc(chosen)))
            + coverage_weight / max(K, 1) * len({labels[w] for w in chosen}))


def ets_solve(O, live, path, depth, labels, cost_weight, coverage_weight, exact=True):
    """The kept rows: every non-empty subset in binary order (first best), or greedy backward elimination."""
    W = len(live)
    f = lambda rows: ets_objective(rows, O, live, path, depth, labels, cost_weight, coverage_weight)  # noqa: E731
    cand = [w for w in range(W) if live[w]]
    if not cand:
        return set()
    if exact:
        subsets = [{w for w in range(W) if m >> w & 1} for m in range(1, 2 ** W)]
        subsets = [s for s in subsets if s <= set(cand)]
        values = [f(s) for s in subsets]
        return subsets[int(np.argmax(values))]
    x = set(cand)
    for _ in range(W):
        if len(x) == 1:
            break
        gains = [(f(x - {w}) - f(x), -w) for w in sorted(x)]
        g, w = max(gains)
        if g <= 0:
            break
        x = x - {-w}
    return x


def ets_boundary(s, T, cost_weight, coverage_weight, dim, threshold, exact=True, b=None):
    """``(prune_PxW, counts_PxW)`` of ETS at one boundary (module docstring of treejax.sampling.branching.ets):
    the width is the sampler's budget with transfer and branch factor ``b`` (default ``W``), the program's dropped
    paths are pruned, each kept path gets 1 child plus its REBASE share of the budget after pruning minus one per
    kept path."""
    live, P, W = s["live_PxW"], *s["live_PxW"].shape
    b = W if b is None else b
    prune, counts = np.zeros((P, W), bool), np.zeros((P, W), int)
    for p in range(P):
        lv, sc = [bool(x) for x in live[p]], [float(x) for x in s["path_scores_PxW"][p]]
        A = sum(lv)
        if A == 0:
            continue
        f = int(s["ended_PxW"][p].sum())
        width = max(min(W - int(s["leaves_P"][p]) - f, b * (A + f)), A)  # the sampler's budget, transfer
        n = ets_rebase(sc, lv, width, T)
        O = [x / max(sum(n), 1) for x in n]
        seg = [[int(s["tokens_PxWxT"][p, w, t]) for t in range(int(s["segment_start_PxW"][p, w]),
                                                               int(s["length_PxW"][p, w]))] for w in range(W)]
        labels = ets_clusters(seg, lv, dim, threshold) if coverage_weight > 0 else list(range(W))
        keep = ets_solve(O, lv, s["path_PxWxD1"][p], s["depth_PxW"][p], labels, cost_weight, coverage_weight, exact)
        prune[p] = [lv[w] and w not in keep for w in range(W)]
        pruned = A - len(keep)  # leaves now: the sampler's budget after pruning
        total = max(min(W - int(s["leaves_P"][p]) - f - pruned, b * (A + f)), len(keep))
        extra = ets_rebase(sc, [w in keep for w in range(W)], total - len(keep), T, ties_high_first=True)
        counts[p] = [1 + extra[w] if w in keep else 0 for w in range(W)]
    return prune, counts
