"""Search-R2's evidence-density reward term: how much of the evidence an episode retrieved its later reasoning used.

He et al. 2026, *Search-R2: Enhancing Search-Integrated Reasoning via Actor-Refiner Collaboration*, arXiv
2602.03647 (no official code found). The paper couples outcome correctness with "a dense process reward
quantifying the information density of retrieved evidence"; its exact formula could not be read (only the
abstract and summaries were reachable), so the form below is **our reconstruction**, chosen to be computable
offline from the episode's own text, to reward evidence that the reasoning goes on to use, and to penalise
redundant retrieval:

    chunks    c_1 .. c_M   every retrieved document of the episode, in order: each observation line that matches
                           ``pattern`` (the retrieval world's ``[rank] Title: text``), a repeated document counted
                           again; tool errors and calculator outputs are not evidence
    V(s)      the distinct lower-case words of text ``s`` (letters and digits, >= 3 characters, a few English
              stop words removed)
    used(c_j) = 1[ |(V(c_j) - V(q_j)) & V(a_j)| >= min_overlap ]
              q_j: the policy's turn that retrieved c_j (restating the query is not using the evidence);
              a_j: the policy's turns after c_j's observation (its later reasoning, queries and the final answer)
    rho       = #{ distinct documents d : some copy of d is used } / M          (rho = 0 when M = 0)
    R'        = R + coef * rho * g,   g = 1[correct] (gate = "correct") or 1 (gate = "none")

``rho`` is in ``[0, 1]``; a document retrieved twice counts twice in ``M`` but at most once above, so redundant
searches lower the density. Gated (the default), a correct answer reached without evidence (``M = 0``: a guess)
gets the plain outcome reward and one grounded in the evidence it retrieved gets up to ``coef`` more: the
abstract's distinction between "high-quality reasoning and fortuitous guesses". :func:`chunk_usage` is the host
text part; :func:`evidence_density` and :func:`hybrid_rewards` are pure jitted functions of arrays
(``tests/rl/test_search_r2.py`` checks them against a slow pure-Python reference on a hand-made case).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

#: the retrieval world's document lines (treejax.envs.retrieval.RetrievalEnv.run_tool): ``[rank] Title: text``
DEFAULT_EVIDENCE_PATTERN = r"^\s*\[\d+\]\s*(.+?)\s*$"
GATES = ("correct", "none")
_STOP = frozenset("the and for was were with from that this which what who whom whose when where how are has had "
                  "have its into than then them they their there these those not but all any can did does our out "
                  "one two answer search output calculate".split())


def words(text: str) -> frozenset[str]:
    """``V(text)`` (module docstring)."""
    return frozenset(w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) >= 3 and w not in _STOP)


def chunk_usage(turns: list[tuple[str, str]], pattern: str = DEFAULT_EVIDENCE_PATTERN, min_overlap: int = 1
                ) -> tuple[list[bool], list[int]]:
    """``(used, doc)`` of every retrieved chunk of one episode, in order (module docstring): ``turns`` are its
    ``(policy text, observation text)`` pairs; ``doc[j]`` numbers the distinct documents by first appearance."""
    rx = re.compile(pattern)
    used, doc, ids = [], [], {}
    for i, (action, obs) in enumerate(turns):
        after = words(" ".join(a for a, _ in turns[i + 1:]))
        query = words(action)
        for line in obs.splitlines():
            m = rx.match(line)
            if m is None:
                continue
            text = m.group(1)
            used.append(len((words(text) - query) & after) >= min_overlap)
            doc.append(ids.setdefault(text, len(ids)))
    return used, doc


def usage_arrays(usages: list[list[tuple[list[bool], list[int]]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(used_PxWxM, doc_PxWxM, valid_PxWxM)`` of :func:`chunk_usage` results ``[P][W]``, padded to the most
    chunks ``M`` (at least 1)."""
    P, W = len(usages), len(usages[0]) if usages else 0
    M = max([len(u) for row in usages for u, _ in row] + [1])
    used, doc, valid = np.zeros((P, W, M), bool), np.full((P, W, M), -1, np.int32), np.zeros((P, W, M), bool)
    for p, row in enumerate(usages):
        for w, (u, d) in enumerate(row):
            used[p, w, :len(u)], doc[p, w, :len(d)], valid[p, w, :len(u)] = u, d, True
    return used, doc, valid


@jax.jit
def evidence_density(used_PxWxM, doc_PxWxM, valid_PxWxM) -> jax.Array:
    """float32 ``[P, W]``: ``rho`` (module docstring): distinct used documents over retrieved chunks. A chunk
    counts above iff it is used and no earlier chunk of the same document is."""
    used = used_PxWxM & valid_PxWxM
    M = used.shape[-1]
    earlier = jnp.tril(jnp.ones((M, M), bool), k=-1)[None, None]  # [1, 1, j, k]: k < j
    same = doc_PxWxM[..., :, None] == doc_PxWxM[..., None, :]  # [P, W, j, k]
    seen = jnp.any(same & used[..., None, :] & earlier, axis=-1)
    first = used & ~seen
    n = valid_PxWxM.sum(-1)
    return jnp.where(n > 0, first.sum(-1) / jnp.maximum(n, 1), 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("gate",))
def hybrid_rewards(rewards_PxW, correct_PxW, density_PxW, coef, gate: str = "correct") -> jax.Array:
    """``R' = R + coef * rho * g`` (module docstring); ``gate``: ``"correct"`` (only correct episodes get the term)
    or ``"none"``."""
    g = correct_PxW.astype(jnp.float32) if gate == "correct" else jnp.ones_like(density_PxW)
    return (rewards_PxW + coef * density_PxW * g).astype(jnp.float32)


__all__ = ["DEFAULT_EVIDENCE_PATTERN", "GATES", "chunk_usage", "evidence_density", "hybrid_rewards",
           "usage_arrays", "words"]
