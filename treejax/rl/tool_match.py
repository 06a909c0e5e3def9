"""MatchTIR's turn rewards on the host: each episode's predicted tool calls matched one-to-one against the task's
reference calls by maximum-weight bipartite matching (``scipy.optimize.linear_sum_assignment``).

A tool call is ``{"name": str, "args": {argument: text}}`` (what the retrieval world's parser gives,
:func:`treejax.envs.retrieval.parse_call`; the reference calls are ``example.metadata["reference_calls"]``).

Per-call score of a predicted call ``p`` against a reference call ``g`` (``lambda`` = ``name_weight``)::

    s(p, g) = 1[name_p = name_g] * (lambda + (1 - lambda) * mean_{k in K} F1(p.args[k], g.args[k]))

with ``K`` the union of both calls' argument names (a missing argument is the empty text; no arguments: the
mean is 1) and ``F1`` the token F1 of the two texts (lower-case ``\\w+`` tokens; two empty texts: 1). So a call
of the wrong tool scores 0, the right tool with the right arguments 1, the right tool with other arguments
``lambda`` plus its share of overlapping words.

Matching, with ``S[i, j] = s(p_i, g_j)`` over an episode's ``m`` predicted and ``n`` reference calls:

* ``"hard"`` (default; MatchTIR's Kuhn-Munkres assignment): the assignment ``sigma`` (a partial one-to-one map,
  ``min(m, n)`` pairs) maximises ``sum_i S[i, sigma(i)]``; predicted call ``i``'s turn reward is
  ``S[i, sigma(i)]``, 0 when it is unmatched (more predictions than references: the extra calls earn nothing).
  Ties between optimal assignments are broken by scipy's deterministic solver.
* ``"soft"`` (MatchTIR's optimal-transport assignment, *reconstructed*: the paper's exact cost, marginals and
  regularisation were not available): the entropic optimal-transport plan ``pi`` between uniform masses ``1/m``
  on the predicted and ``1/n`` on the reference calls with cost ``1 - S`` and regularisation ``epsilon``
  (Sinkhorn iterations in the log domain, to a marginal error below 1e-9), and the reward
  ``r_i = m sum_j pi[i, j] S[i, j]`` (the plan-weighted score of the call, its row rescaled to mass 1).

:func:`tool_match_rewards` gives the multi-turn source's estimator input ``tool_match_PxWxD`` (``[P, W, D]``: slot
``w``'s turn at depth ``d + 1``; NaN where the turn made no call or does not exist). The matching runs per *slot*
(each slot's whole trajectory is one predicted sequence; ``assignment`` / ``epsilon`` as above), so a turn shared by several slots of a tree can get
different rewards on different slots; the estimator keeps them per slot (:mod:`treejax.rl.advantages.matchtir`).
"""

from __future__ import annotations

import collections
import re

import numpy as np


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", str(text).lower())


def multiset_f1(ta: list, tb: list) -> float:
    """F1 of two token lists counted with multiplicity: ``2 p r / (p + r)`` with ``p = common / |ta|``, ``r = common
    / |tb|``; 0 when they share no token (an empty list included)."""
    common = sum((collections.Counter(ta) & collections.Counter(tb)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


def token_f1(a: str, b: str) -> float:
    """Token F1 of two texts (lower-case ``\\w+`` tokens, counted with multiplicity); 1 for two empty texts, 0
    when one is empty."""
    ta, tb = _tokens(a), _tokens(b)
    if not ta and not tb:
        return 1.0
    return multiset_f1(ta, tb)


def check_call(call, where: str) -> dict:
    """``call`` if it is a tool call (``{"name": str, "args": dict}``), else a ``ValueError`` naming ``where``."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("args", {}), dict)):
        raise ValueError(f"{where}: a tool call is {{'name': str, 'args': dict}}, got {call!r}")
    return call


def call_score(pred: dict, ref: dict, name_weight: float = 0.5) -> float:
    """``s(p, g)`` of the module docstring."""
    if pred["name"] != ref["name"]:
        return 0.0
    pa, ra = pred.get("args", {}), ref.get("args", {})
    keys = sorted(set(pa) | set(ra))
    arg = float(np.mean([token_f1(pa.get(k, ""), ra.get(k, "")) for k in keys])) if keys else 1.0
    return name_weight + (1.0 - name_weight) * arg


#: ``MultiTurnConfig.tool_match_assignment`` values (module docstring).
ASSIGNMENTS = ("hard", "soft")


def sinkhorn_plan(S: np.ndarray, epsilon: float, max_iters: int = 10_000, tol: float = 1e-9) -> np.ndarray:
    """The entropic optimal-transport plan ``[m, n]`` between uniform masses (``1/m`` per row, ``1/n`` per column)
    with cost ``1 - S`` and regularisation ``epsilon`` (log-domain Sinkhorn, until both marginals are within
    ``tol``)."""
    from scipy.special import logsumexp

    m, n = S.shape
    log_k = -(1.0 - np.asarray(S, np.float64)) / epsilon
    f, g = np.zeros(m), np.zeros(n)
    for _ in range(max_iters):
        f = -np.log(m) - logsumexp(log_k + g[None, :], axis=1)
        g = -np.log(n) - logsumexp(log_k + f[:, None], axis=0)
        plan = np.exp(f[:, None] + log_k + g[None, :])
        if np.max(np.abs(plan.sum(axis=1) - 1.0 / m)) < tol:
            break
    return plan


def match_calls(predicted: list, reference: list, name_weight: float = 0.5, assignment: str = "hard",
                epsilon: float = 0.1) -> tuple[np.ndarray, list]:
    """``(rewards [m], pairs)``: each predicted call's turn reward under the ``assignment`` (module docstring) and,
    for ``"hard"``, the matched ``(predicted index, reference index)`` pairs (``"soft"``: the pairs where the
    plan puts most of each predicted call's mass)."""
    from scipy.optimize import linear_sum_assignment

    if not 0.0 <= name_weight <= 1.0:
        raise ValueError(f"match_calls: name_weight must be in [0, 1], got {name_weight!r}")
    if assignment not in ASSIGNMENTS or not epsilon > 0:
        raise ValueError(f"match_calls: assignment must be one of {ASSIGNMENTS} and epsilon > 0, got "
                         f"{assignment!r}, {epsilon!r}")
    pred = [check_call(c, f"predicted call {i}") for i, c in enumerate(predicted)]
    ref = [check_call(c, f"reference call {j}") for j, c in enumerate(reference)]
    out = np.zeros(len(pred), np.float64)
    if not pred or not ref:
        return out, []
    S = np.array([[call_score(p, g, name_weight) for g in ref] for p in pred])
    if assignment == "soft":
        plan = sinkhorn_plan(S, epsilon)
        return len(pred) * np.sum(plan * S, axis=1), [(i, int(np.argmax(plan[i]))) for i in range(len(pred))]
    rows, cols = linear_sum_assignment(S, maximize=True)
    out[rows] = S[rows, cols]
    return out, [(int(i), int(j)) for i, j in zip(rows, cols)]


def reference_calls(example) -> list:
    """The reference tool calls an example ships (``metadata["reference_calls"]``); a ``ValueError`` saying what to
    use when it has none."""
    meta = getattr(example, "metadata", None)
    calls = meta.get("reference_calls") if isinstance(meta, dict) else None
    if not isinstance(calls, list):
        raise ValueError("MatchTIR needs reference tool calls in example.metadata['reference_calls'], and this "
                         "example has none; fix: a task that ships them (RunConfig.task = 'retrieval_multihop')")
    return calls


def evidence_pages(example) -> set:
    """The titles of a question's evidence pages: the queries of its reference searches (entity names, which are
    the pages' titles; the retrieval world's); a ``ValueError`` as :func:`reference_calls` when it ships none."""
    return {c["args"]["query"] for c in reference_calls(example) if c.get("name") == "search"}


def tool_match_rewards(trees, examples, depth: int, name_weight: float = 0.5, assignment: str = "hard",
                       epsilon: float = 0.1) -> np.ndarray:
    """float32[P, W, D]: per leaf slot, the matched score of its turn at depth ``d + 1`` when that turn made a tool
    call (``info["tool_call"]``), NaN otherwise (module docstring). ``trees``: the multi-turn sampler's turn trees
    (``slot_episode`` per slot, ``infos`` per turn); ``examples``: one per tree."""
    W = len(trees[0].slot_episode) if trees else 0
    out = np.full((len(trees), W, depth), np.nan, np.float32)
    for p, (tr, ex) in enumerate(zip(trees, examples)):
        ref = reference_calls(ex)
        for w, ep in enumerate(tr.slot_episode):
            turns = [d for d, info in enumerate(ep.infos[:depth]) if "tool_call" in info]
            rewards, _ = match_calls([ep.infos[d]["tool_call"] for d in turns], ref, name_weight, assignment, epsilon)
            out[p, w, turns] = rewards
    return out


__all__ = ["ASSIGNMENTS", "call_score", "check_call", "evidence_pages", "match_calls", "multiset_f1", "reference_calls",
           "sinkhorn_plan", "token_f1", "tool_match_rewards"]
