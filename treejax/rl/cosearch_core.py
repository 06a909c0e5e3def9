"""CoSearch's ranker as pure host functions (Zeng et al. 2026, "CoSearch: Joint Training of Reasoning and Document
Ranking via Reinforcement Learning for Agentic Search", arXiv 2604.17555; official code ``snap-research/CoSearch``).
The rollout side that calls them is :mod:`treejax.rl.cosearch`.

**Semantic grouping** (official code, ``uid_group_functions.group_by_muid_ans_in_doc_subq_rougeL1``). The ranker's
inputs (a sub-query and its candidates) differ across the policy's trajectories, so GRPO has no natural group of
"the same input". A ranker call ``a`` belongs to question ``q_a`` and has evidence flag ``e_a`` (some candidate is
relevant). Calls are first split by ``(q_a, e_a)``; within each split, in call order, a call's normalised sub-query
(:func:`normalize_subquery`: lower case, no articles, punctuation to spaces, single spaces) joins the *first*
existing cluster whose representative (its first member) has ROUGE-1 F1 >= ``threshold`` (0.8) with it, else it
starts a cluster and is its representative::

    ROUGE-1 F1(x, y) = 2 P R / (P + R),  P = |x & y| / |x|,  R = |x & y| / |y|   (unigram multisets; empty: 0)

``grouping = "exact"`` clusters equal normalised sub-queries, ``"question"`` only ``(q_a, e_a)`` (the official
code's two other grouping functions). Clusters never cross questions.

**Composite reward** (official code, ``score_assign_functions.sum_tool_agent_score_with_cond_threshold``, the
training script's choice). With ``h_a`` the ranking's mean Hit@k over the cutoffs (1 when a relevant document is
among the first ``k`` shown; ``h_a = 0`` when no candidate is relevant) and ``o_a = 1[episode score >= tau_o]``
the outcome of the trajectory the call belongs to::

    R_a = h_a + o_a   if not e_a or h_a >= tau_c         (tau_o = tau_c = 0.8)
    R_a = h_a         otherwise

(a ranking that buried available evidence earns no credit from the outcome). ``reward = "hit"`` is ``h_a`` only,
``"outcome"`` ``o_a`` only. The official code's format penalty (-0.2 for an unparseable ranking) has no analogue:
the ranker here always produces a valid ranking.

**Group advantage** (verl's GRPO, which the official code trains with): over the ``n_c`` calls of cluster ``c``::

    A_a = (R_a - mean_c R) / (std_c R + eps)        std with Bessel's correction (torch.std), eps = 1e-6

Clusters with fewer than ``min_group`` calls (2) get ``A = 0`` and no weight in the loss; ``min_group = 1`` keeps
verl's rule for a singleton (mean 0, std 1: ``A = R / (1 + eps)``).

**The ranker (reconstructed).** The paper's ranker is a second LLM (Qwen2.5-7B-Instruct) that reads the top-50
passages of a dense retriever and generates ``[i] > [j] > ...`` for the top 5. Here it is a small trainable
Plackett-Luce policy over the BM25 candidates of the retrieval world (a second LM decode inside every search call,
with its own learner, is not built): candidate ``i`` of a call gets the score ``s_i = theta . phi_i`` from the
features :data:`FEATURES` (:func:`candidate_features`), and an ordered choice ``o = (o_1 .. o_M)`` of ``M`` of the
``n`` candidates has the exact log-probability::

    log pi(o) = sum_{j=1..M} [ s_{o_j} - log sum_{i not in o_<j} exp(s_i) ]

sampled exactly by Gumbel-top-M (:func:`sample_order`); the held-out evaluation shows the greedy order. The loss
is GRPO's clipped surrogate with the behaviour log-probs recorded at sampling (``rho = pi / pi_old``)::

    L(theta) = - sum_a w_a min(rho_a A_a, clip(rho_a, 1 - eps_c, 1 + eps_c) A_a) / sum_a w_a

(``w_a`` = 1 in a cluster of at least ``min_group`` calls), with its exact gradient
``grad log pi(o) = sum_j [phi_{o_j} - sum_{i in R_j} p_ij phi_i]`` (``p_ij`` the softmax over the remaining
candidates ``R_j``) and Adam (:func:`adam_step`). No KL term (the official run's 0.001 KL to a reference ranker is
left out).
"""

from __future__ import annotations

import collections
import re

import numpy as np

from treejax.rl.tool_match import multiset_f1

#: Per-candidate features (:func:`candidate_features`), in order.
FEATURES = ("bm25", "bm25_reciprocal_rank", "title_recall", "query_coverage", "kind_country", "kind_city",
            "kind_person", "kind_company")
#: Document kinds of the retrieval world (:class:`treejax.envs.retrieval_corpus.Document`), one-hot in the features.
KINDS = ("country", "city", "person", "company")
#: ``CoSearchConfig.grouping`` values.
GROUPINGS = ("rouge1", "exact", "question")
#: ``CoSearchConfig.reward`` values.
REWARDS = ("composite", "hit", "outcome")


def normalize_subquery(text: str) -> str:
    """Lower case, the articles a / an / the removed, punctuation to spaces, single spaces (the official code's
    normalisation, in its order)."""
    s = re.sub(r"\b(a|an|the)\b", " ", str(text).lower())
    s = re.sub(r"[^\w\s]", " ", s)
    return " ".join(s.split())


def rouge1_f1(a: str, b: str) -> float:
    """ROUGE-1 F1 of two normalised texts (whitespace tokens, counted with multiplicity); 0 when either is empty."""
    return multiset_f1(a.split(), b.split())


def cluster_subqueries(questions: list, evidence_A, queries: list[str], grouping: str = "rouge1",
                       threshold: float = 0.8) -> np.ndarray:
    """int32[A]: each call's cluster id (module docstring), ids numbered by first appearance in call order.
    ``questions``: each call's question key; ``evidence_A``: its evidence flag; ``queries``: its sub-query (raw)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"cluster_subqueries: grouping must be one of {GROUPINGS}, got {grouping!r}")
    ids: dict = {}
    reps: dict = collections.defaultdict(list)  # (question, evidence) -> [(representative, cluster key)]
    out = np.zeros(len(queries), np.int32)
    for a, (q, e, text) in enumerate(zip(questions, np.asarray(evidence_A, bool), queries)):
        base, norm = (q, bool(e)), normalize_subquery(text)
        if grouping == "question":
            key = base
        elif grouping == "exact":
            key = base + (norm,)
        else:
            key = next((k for rep, k in reps[base] if rouge1_f1(norm, rep) >= threshold), None)
            if key is None:
                key = base + (len(reps[base]),)
                reps[base].append((norm, key))
        out[a] = ids.setdefault(key, len(ids))
    return out


def hit_at_ks(relevant_ranked, cutoffs) -> float:
    """Mean over ``k`` in ``cutoffs`` of 1[a relevant document among the first ``k`` shown] (``relevant_ranked``:
    the shown documents' relevance, in the shown order)."""
    rel = np.asarray(relevant_ranked, bool)
    return float(np.mean([rel[:k].any() for k in cutoffs]))


def ranker_rewards(hit_A, evidence_A, outcome_A, reward: str = "composite", outcome_threshold: float = 0.8,
                   cond_threshold: float = 0.8) -> np.ndarray:
    """float32[A]: each ranker call's reward ``R_a`` (module docstring) from its mean Hit@k, evidence flag and the
    score of the episode it belongs to."""
    if reward not in REWARDS:
        raise ValueError(f"ranker_rewards: reward must be one of {REWARDS}, got {reward!r}")
    e = np.asarray(evidence_A, bool)
    h = np.where(e, np.asarray(hit_A, np.float64), 0.0)
    o = (np.asarray(outcome_A, np.float64) >= outcome_threshold).astype(np.float64)
    if reward == "hit":
        return h.astype(np.float32)
    if reward == "outcome":
        return o.astype(np.float32)
    return (h + o * ((~e) | (h >= cond_threshold))).astype(np.float32)


def cluster_advantages(rewards_A, cluster_A, min_group: int = 2, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """``(adv_A, weight_A)``: GRPO's advantage of each call within its cluster and its loss weight (1 in a cluster of
    at least ``min_group`` calls, else 0 with ``A = 0``; ``min_group = 1``: a singleton's ``A = R / (1 + eps)``,
    verl's rule). Module docstring."""
    r = np.asarray(rewards_A, np.float64)
    c = np.asarray(cluster_A, np.int64)
    if r.size == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    n = np.bincount(c).astype(np.float64)
    mean = np.bincount(c, weights=r) / np.maximum(n, 1)
    sq = np.bincount(c, weights=(r - mean[c]) ** 2)
    std = np.sqrt(sq / np.maximum(n - 1, 1))
    mean, std = np.where(n == 1, 0.0, mean), np.where(n == 1, 1.0, std)
    keep = n[c] >= min_group
    adv = np.where(keep, (r - mean[c]) / (std[c] + eps), 0.0)
    return adv.astype(np.float32), keep.astype(np.float32)


def _tokens(text: str) -> set:
    return set(re.findall(r"\w+", str(text).lower()))


def candidate_features(query: str, docs, bm25) -> np.ndarray:
    """float32[n, F]: the features :data:`FEATURES` of the ``n`` candidates ``docs`` (objects with ``title``,
    ``text``, ``kind``; in BM25 order) of ``query``, whose BM25 scores are ``bm25`` (positive): the score over the
    best one's, ``1 / (BM25 rank)``, the share of the title's words in the query, the share of the query's words in
    the document (lower-case ``\\w+`` word sets), and the kind one-hot (:data:`KINDS`)."""
    s = np.asarray(bm25, np.float64)
    q = _tokens(query)
    out = np.zeros((len(docs), len(FEATURES)), np.float32)
    for i, d in enumerate(docs):
        title = _tokens(d.title)
        out[i, 0] = s[i] / s.max() if s.size and s.max() > 0 else 0.0
        out[i, 1] = 1.0 / (i + 1)
        out[i, 2] = len(title & q) / len(title) if title else 0.0
        out[i, 3] = len(q & (title | _tokens(d.text))) / len(q) if q else 0.0
        if d.kind in KINDS:
            out[i, 4 + KINDS.index(d.kind)] = 1.0
    return out


def _logsumexp(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    x = np.where(mask, x, -np.inf)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)))[..., 0]


def plackett_luce_logp(scores_AxN, valid_AxN, order_AxM) -> np.ndarray:
    """float64[A]: ``log pi(o)`` of each ordered choice ``order_AxM`` (candidate indices, ``-1`` past its end) under
    the Plackett-Luce policy of ``scores_AxN`` over the ``valid_AxN`` candidates (module docstring)."""
    s = np.asarray(scores_AxN, np.float64)
    remaining = np.asarray(valid_AxN, bool).copy()
    order = np.asarray(order_AxM, np.int64)
    rows = np.arange(s.shape[0])
    out = np.zeros(s.shape[0])
    for j in range(order.shape[1]):
        o, live = order[:, j], order[:, j] >= 0
        lse = _logsumexp(s, remaining)
        out += np.where(live, s[rows, np.maximum(o, 0)] - lse, 0.0)
        remaining[rows[live], o[live]] = False
    return out


def sample_order(scores_N, m: int, rng: np.random.Generator) -> np.ndarray:
    """int64[m]: an exact Plackett-Luce sample of ``m`` of the candidates, in order (Gumbel-top-m: the ``m`` largest
    ``s_i + G_i``, ``G_i`` standard Gumbel noise)."""
    s = np.asarray(scores_N, np.float64)
    g = s + rng.gumbel(size=s.shape)
    return np.lexsort((np.arange(s.size), -g))[:m]


def greedy_order(scores_N, m: int) -> np.ndarray:
    """int64[m]: the ``m`` best-scored candidates in order (ties by BM25 order)."""
    s = np.asarray(scores_N, np.float64)
    return np.lexsort((np.arange(s.size), -s))[:m]


def _grad_logp(theta_F, feats_AxNxF, valid_AxN, order_AxM) -> np.ndarray:
    """float64[A, F]: ``grad_theta log pi(o_a)`` (module docstring)."""
    f = np.asarray(feats_AxNxF, np.float64)
    s = f @ np.asarray(theta_F, np.float64)
    remaining = np.asarray(valid_AxN, bool).copy()
    order = np.asarray(order_AxM, np.int64)
    rows = np.arange(f.shape[0])
    grad = np.zeros((f.shape[0], f.shape[2]))
    for j in range(order.shape[1]):
        o, live = order[:, j], order[:, j] >= 0
        p = np.where(remaining, np.exp(s - _logsumexp(s, remaining)[:, None]), 0.0)
        step = f[rows, np.maximum(o, 0)] - np.einsum("an,anf->af", p, f)
        grad += np.where(live[:, None], step, 0.0)
        remaining[rows[live], o[live]] = False
    return grad


def ranker_loss_grad(theta_F, feats_AxNxF, valid_AxN, order_AxM, adv_A, logp_old_A, weight_A,
                     clip_eps: float = 0.2) -> tuple[float, np.ndarray, float]:
    """``(loss, grad_F, clipped share)``: GRPO's clipped surrogate of the ranker and its exact gradient (module
    docstring); the clipped share counts the weighted calls whose gradient the clip stopped."""
    theta = np.asarray(theta_F, np.float64)
    f = np.asarray(feats_AxNxF, np.float64)
    w, adv = np.asarray(weight_A, np.float64), np.asarray(adv_A, np.float64)
    total = w.sum()
    if total <= 0:
        return 0.0, np.zeros_like(theta), 0.0
    logp = plackett_luce_logp(f @ theta, valid_AxN, order_AxM)
    rho = np.exp(logp - np.asarray(logp_old_A, np.float64))
    plain, clipped = rho * adv, np.clip(rho, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    active = plain <= clipped  # the min picks the unclipped term: the gradient flows through rho
    loss = -float(np.sum(w * np.minimum(plain, clipped)) / total)
    coef = np.where(active, w * rho * adv, 0.0)
    grad = -(coef[:, None] * _grad_logp(theta, f, valid_AxN, order_AxM)).sum(0) / total
    stopped = float(np.sum(w * (~active)) / total)
    return loss, grad, stopped


def adam_step(theta_F, grad_F, state: dict, learning_rate: float, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8) -> tuple[np.ndarray, dict]:
    """One bias-corrected Adam step: ``(theta', state')``; ``state`` holds ``m``, ``v`` and the step count ``t``
    (``{}``: the first step)."""
    g = np.asarray(grad_F, np.float64)
    t = state.get("t", 0) + 1
    m = b1 * state.get("m", np.zeros_like(g)) + (1 - b1) * g
    v = b2 * state.get("v", np.zeros_like(g)) + (1 - b2) * g * g
    update = learning_rate * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return np.asarray(theta_F, np.float64) - update, {"m": m, "v": v, "t": t}


__all__ = ["FEATURES", "GROUPINGS", "KINDS", "REWARDS", "adam_step", "candidate_features", "cluster_advantages",
           "cluster_subqueries", "greedy_order", "hit_at_ks", "normalize_subquery", "plackett_luce_logp",
           "ranker_loss_grad", "ranker_rewards", "rouge1_f1", "sample_order"]
