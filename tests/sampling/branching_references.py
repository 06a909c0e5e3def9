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
