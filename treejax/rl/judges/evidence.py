"""Search-R2's evidence-density reward term: the share of an episode's searches that brought useful, new evidence.

He et al. 2026, *Search-R2: Enhancing Search-Integrated Reasoning via Actor-Refiner Collaboration*, arXiv
2602.03647 (no official code found; the method is read from the paper, its Appendix K). Two forms:

**Collections** (``density = "collections"``, the paper's): the top-k documents one search call returns are one
*collection*; the paper's judge (a 7B model shown the question and the gold answer) marks a collection useful when
it "contains information or clues that help identify the correct answer" and not when it only repeats earlier
collections, and ``r_process = (1 / M) sum_i u_i`` over the episode's ``M`` search calls. Offline here, the judge is
replaced by an exact rule from the problem's own ground truth (``useful``):

    u_i  = 1[ collection i holds a useful document that no earlier collection of the episode returned ]
    useful(d) = d's title is one of the question's evidence pages (``"evidence"``: the pages its reference
                searches name, the hops of the retrieval world), or d's text holds the normalised gold answer
                (``"answer"``: any task)
    rho  = sum_i u_i / M            (rho = 0 when M = 0; a search that returned nothing or an error counts in M)

:func:`collection_usage` is the host text part, :func:`collection_density` the jitted mean.

**Documents** (``density = "documents"``, this project's earlier reconstruction, kept as an option: it needs no
ground truth): did the later reasoning use each retrieved document?

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
searches lower the density. :func:`chunk_usage` is the host text part, :func:`evidence_density` the jitted ratio.

**The coupling** (both forms): ``R' = R + coef * rho * g``. The paper's ``R = r_outcome (1 + r_process)`` with a 0/1
outcome is this with ``RunConfig.reward_style = "01"``, ``coef = 1`` and ``g = 1[correct]`` (``gate = "correct"``):
a wrong answer gets 0 whatever it retrieved, a right one 1 to 2. ``gate = "none"`` adds the term to every episode.
:func:`hybrid_rewards` is jitted (``tests/rl/test_search_r2.py`` checks every part against slow pure-Python
references on hand-made cases).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError

#: the retrieval world's document lines (treejax.envs.retrieval.RetrievalEnv.run_tool): ``[rank] Title: text``
DEFAULT_EVIDENCE_PATTERN = r"^\s*\[\d+\]\s*(.+?)\s*$"
GATES = ("correct", "none")
DENSITIES = ("collections", "documents")
USEFUL = ("evidence", "answer")
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


def collection_usage(turns: list[tuple[str, str]], useful, pattern: str = DEFAULT_EVIDENCE_PATTERN) -> list[bool]:
    """``u_i`` of each search call of one episode, in order (module docstring, "Collections"): ``turns`` are its
    ``(policy text, observation text)`` pairs; a turn whose action ends with a ``<search>`` call is a collection,
    its observation's lines matching ``pattern`` its documents; ``useful(text) -> bool`` judges one document."""
    from treejax.envs.retrieval import parse_call

    rx, seen, out = re.compile(pattern), set(), []
    for action, obs in turns:
        call = parse_call(action)
        if call is None or call["name"] != "search":
            continue
        docs = [m.group(1) for m in map(rx.match, obs.splitlines()) if m is not None]
        out.append(any(useful(d) and d not in seen for d in docs))
        seen.update(docs)
    return out


def useful_document(kind: str, example):
    """``useful(text)`` for one problem (module docstring): ``"evidence"``, a document (``Title: text``) whose title
    is one of its evidence pages (:func:`treejax.rl.tool_match.evidence_pages`, as CoSearch's relevance);
    ``"answer"``, one whose text holds its gold answer, both normalised as the retrieval world's verifier does
    (:func:`treejax.envs.retrieval_corpus.normalize_answer`)."""
    from treejax.envs.retrieval_corpus import normalize_answer
    from treejax.rl.tool_match import evidence_pages

    if kind == "evidence":
        try:
            titles = evidence_pages(example)
        except ValueError:
            titles = set()
        if not titles:
            raise ConfigError("SearchR2Config.useful = 'evidence' needs each problem's evidence pages (the search "
                              "calls of metadata['reference_calls']), and this one names none; fix: "
                              "SearchR2Config.useful = 'answer' (or RunConfig.task = 'retrieval_multihop')")
        return lambda text: text.split(":", 1)[0].strip() in titles
    gold = normalize_answer(str(example.ground_truth))
    if not gold:
        raise ConfigError("SearchR2Config.useful = 'answer' needs each problem's gold answer, and this one's is empty; "
                          "fix: SearchR2Config.useful = 'evidence' (a task whose records ship reference searches)")
    return lambda text: f" {gold} " in f" {normalize_answer(text)} "


@jax.jit
def collection_density(useful_PxWxM, valid_PxWxM) -> jax.Array:
    """float32 ``[P, W]``: ``rho = sum_i u_i / M`` over each slot's ``M`` valid collections (0 when ``M = 0``)."""
    n = valid_PxWxM.sum(-1)
    hits = (useful_PxWxM & valid_PxWxM).sum(-1)
    return jnp.where(n > 0, hits / jnp.maximum(n, 1), 0.0).astype(jnp.float32)


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


__all__ = ["DEFAULT_EVIDENCE_PATTERN", "DENSITIES", "GATES", "USEFUL", "chunk_usage", "collection_density",
           "collection_usage", "evidence_density", "hybrid_rewards", "usage_arrays", "useful_document",
           "words"]
