"""ETS (Hooper et al. 2025, "ETS: Efficient Tree Search for Inference-Time Scaling", arXiv 2502.13575; official
code ``SqueezeAILab/ETS``, ``rebase.py``, ``Tree.select_softmax_costmodel``): PRM-scored selection at every step
boundary that trades the search's coverage against its KV-cache footprint.

At a boundary a prompt has ``A`` live paths ``i`` with PRM scores ``s_i`` of the step just decoded (the scorer's
per-step score in ``PathStats.path_scores_PxW``, :mod:`treejax.sampling.path_scores`) and a width ``w``: the
sampler's budget ``max(min(W - F, b (A + f)), A)`` (TreePO's budget transfer; ``F`` the leaves so far, ``f`` those
of this boundary). With ``b = W`` it is the official width, the leaf slots not yet used ``W - F``; a smaller ``b``
lets the tree widen at most ``b``-fold per boundary. ETS then

1. **REBASE outcome scores.** Paths in descending ``s`` (ties: lower index first, as Python's ``sorted(...,
   reverse=True)``) take ``n_k = ceil(w_k e_k / sum_{j >= k} e_j)`` with ``e = exp(s / T)`` and ``w_k`` the width
   the paths before ``k`` left; ``O_i = n_i / sum n``.
2. **The integer program** over ``x_i`` (keep path ``i``), ``y_j`` (keep ancestor node ``j``: the ``M`` distinct
   nodes above the candidates, the root included) and ``z_k`` (cluster ``k`` of the ``K`` clusters of the
   candidates' last steps is covered)::

       max  sum_i O_i x_i  -  lambda_c / (M + N) (sum_j y_j + sum_i x_i)  +  lambda_s / K sum_k z_k
       s.t. y_j = OR_{i below j} x_i,  z_k <= sum_{i in k} x_i,  sum_i x_i >= 1      (N = A)

   The KV term pays for every node the kept paths hold in the cache (a shared ancestor once), the coverage term
   rewards keeping paths whose steps differ. ``lambda_c = 0`` is replaced by a reward ``+1e-4`` per node, as the
   official code's guard does.
3. **REBASE over the kept paths**: the same sequential ``ceil`` split with ties to the higher index first (the
   official ``sorted(...)`` then ``reverse()``), of the slots left once each kept path has one (below); the paths
   the program dropped are pruned.

Reproduced exactly: the REBASE split (``T = softmax_temperature``, both tie orders), the objective with the
official unit costs ``1/(M+N)`` and the ``lambda_c = 0`` guard, ``lambda_s / K``, and average-linkage clustering
with the cosine distance cut at ``cluster_distance`` (scipy's ``fcluster(linkage(e, "average", "cosine"), 0.05,
"distance")``; average linkage never inverts, so merging the closest pair while it is within the cut gives the same
flat clusters; tested against scipy).

Changed, and why:
  * **the solver.** The official code solves the program with CBC. Here ``solver="exact"`` enumerates every subset
    of the ``W`` rows (``2^W`` objective values, one batched evaluation, the first best subset in binary order: any
    optimum is CBC's answer too, ties aside), for ``W <= exact_max_paths`` (16 at most); ``"greedy"`` starts from
    all live paths and drops, one at a time, the path whose removal raises the objective most until none does
    (``W`` rounds, jittable for any ``W``: a heuristic, not always the optimum); ``"auto"`` is exact up to
    ``exact_max_paths`` and greedy above.
  * **the step embeddings.** The official code embeds each step's *text* with a sentence transformer
    (``math-similarity/Bert-MLM_arXiv-MP-class_zbMath``), which cannot run here; each step is embedded as the
    count vector of its token ids (ids hashed modulo ``embed_dim``; no collisions when ``embed_dim`` is at least
    the vocabulary), so "similar" means "made of the same tokens".
  * **pruned paths keep a leaf.** treejax keeps ``W`` leaves per prompt and a pruned path is stored as a
    ``PRUNED`` leaf (as for every pruning rule), so it still holds a slot: after pruning the sampler's budget is
    ``total = max(min(W - F', b (A + f)), A')`` (``F'``, ``A'`` after pruning; a pruned path's ``b`` share moves
    to the kept ones while ``W - F'`` allows, as the official code re-spends a dropped node's width). Step 3 gives
    each kept path 1 child plus its REBASE share of ``total - A'``: the official implicit pruning of a kept node
    whose ``ceil`` share of the whole width is 0 is not reproduced (here it would free no slot, and with no slack
    it would prune every path but one). Every path ends in one leaf, so a tree creates ``W - init_divergence``
    paths in all: ETS needs ``init_divergence < W`` to branch, and ``b`` decides how fast it may spend them.
  * ``ceil`` is taken of ``x - 1e-5`` (float32 products that should be integers); the official step is one
    reasoning step (a stop string), here it is a segment of ``S`` tokens.

Unbiasedness: the keep set and the child counts read only the scores and tokens decoded so far, so leaf weights
``W m(l)`` (path masses) stay exact for ``"transfer"`` trees without fallback (``tests/sampling/test_ets.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from treejax.choices import check_choice
from treejax.errors import ConfigError
from treejax.sampling.branching.base import BranchingRule, PathStats, register

SOLVERS = ("auto", "exact", "greedy")
EXACT_LIMIT = 16  # 2^16 subsets per prompt: the largest enumeration the exact solver accepts
CEIL_EPS = 1e-5
LAMBDA_C_GUARD = 1e-4  # the official code's objective weight per node when lambda_c = 0


# ----------------------------------------------------------------------------------------------- REBASE
def rebase_counts(score_PxW: jax.Array, keep_PxW: jax.Array, width_P: jax.Array, temperature: float,
                  ties_high_first: bool = False) -> jax.Array:
    """int32[P, W]: REBASE's sequential split of ``width`` over the kept paths (module docstring, step 1/3).

    Kept paths in descending score (ties: lower index first, or higher with ``ties_high_first``) take
    ``ceil(w_k e_k / sum_{j >= k} e_j)`` (at most ``w_k``), ``e = exp((s - max s) / T)``; 0 elsewhere."""
    P, W = score_PxW.shape
    keep = keep_PxW.astype(bool)
    s = jnp.where(keep, score_PxW.astype(jnp.float32) / temperature, -jnp.inf)
    idx = jnp.arange(W)
    tie = idx[::-1] if ties_high_first else idx
    order = jnp.lexsort((jnp.broadcast_to(tie, (P, W)), -s), axis=-1)  # last key primary
    s_sorted = jnp.take_along_axis(s, order, axis=-1)
    top = jnp.max(jnp.where(jnp.isfinite(s_sorted), s_sorted, -1e30), axis=-1, keepdims=True)
    e = jnp.where(jnp.isfinite(s_sorted), jnp.exp(s_sorted - top), 0.0)
    suffix = jnp.cumsum(e[:, ::-1], axis=-1)[:, ::-1]

    def step(left, k):
        x = left.astype(jnp.float32) * e[:, k] / jnp.maximum(suffix[:, k], 1e-30)
        n = jnp.where(e[:, k] > 0, jnp.clip(jnp.ceil(x - CEIL_EPS), 0, left), 0).astype(jnp.int32)
        return left - n, n

    _, n_WxP = lax.scan(step, jnp.maximum(width_P.astype(jnp.int32), 0), jnp.arange(W))
    counts = jnp.zeros((P, W), jnp.int32).at[jnp.arange(P)[:, None], order].set(n_WxP.T)
    return jnp.where(keep, counts, 0)


# ----------------------------------------------------------------------------------------------- coverage
def step_embeddings(seg_tokens_PxWxS: jax.Array, dim: int) -> jax.Array:
    """float32[P, W, dim]: the count vector of each step's token ids (``id mod dim``; ``-1`` entries skipped)."""
    P, W, S = seg_tokens_PxWxS.shape
    valid = seg_tokens_PxWxS >= 0
    slot = jnp.where(valid, seg_tokens_PxWxS % dim, 0)
    p = jnp.broadcast_to(jnp.arange(P)[:, None, None], (P, W, S))
    w = jnp.broadcast_to(jnp.arange(W)[None, :, None], (P, W, S))
    return jnp.zeros((P, W, dim), jnp.float32).at[p, w, slot].add(valid.astype(jnp.float32))


def average_linkage_clusters(emb_WxE: jax.Array, active_W: jax.Array, threshold: float) -> jax.Array:
    """int32[W]: flat clusters of the active rows (average linkage, cosine distance, merged while the closest
    pair of clusters is ``<= threshold``); a cluster is labelled by its lowest row, inactive rows by themselves."""
    W = emb_WxE.shape[0]
    unit = emb_WxE / jnp.maximum(jnp.linalg.norm(emb_WxE, axis=-1, keepdims=True), 1e-12)
    dist = jnp.clip(1.0 - unit @ unit.T, 0.0, 2.0)
    idx = jnp.arange(W)

    def merge(_, carry):
        dist, alive, size, label = carry
        masked = jnp.where(alive[:, None] & alive[None, :] & (idx[None, :] > idx[:, None]), dist, jnp.inf)
        flat = jnp.argmin(masked)
        a, b = flat // W, flat % W
        go = masked[a, b] <= threshold
        na, nb = size[a].astype(jnp.float32), size[b].astype(jnp.float32)
        row = (na * dist[a] + nb * dist[b]) / (na + nb)
        new = dist.at[a, :].set(row).at[:, a].set(row).at[a, a].set(0.0)
        return (jnp.where(go, new, dist), jnp.where(go, alive.at[b].set(False), alive),
                jnp.where(go, size.at[a].add(size[b]), size), jnp.where(go & (label == b), a, label))

    init = (dist, active_W.astype(bool), jnp.ones((W,), jnp.int32), idx.astype(jnp.int32))
    return lax.fori_loop(0, max(W - 1, 0), merge, init)[3]


# ----------------------------------------------------------------------------------------------- the program
def _first_of_class(same_CxWxW: jax.Array, x_BxW: jax.Array, member_CxW: jax.Array) -> jax.Array:
    """float[B]: distinct classes among the chosen rows: ``sum_c sum_i x_i member[c, i] [no chosen j < i in i's
    class]``; ``same[c, i, j]``: rows ``j < i`` share ``i``'s class in partition ``c``."""
    earlier = jnp.einsum("cij,bj->bci", same_CxWxW, x_BxW)
    return jnp.sum(x_BxW[:, None, :] * member_CxW[None] * (earlier == 0), axis=(1, 2))


@dataclasses.dataclass(frozen=True)
class Program:
    """One prompt's integer program (module docstring, step 2) as arrays: ``O_W`` outcome scores, ``live_W``,
    ``anc_same_DxWxW`` / ``anc_member_DxW`` (ancestor at depth ``d`` shared with an earlier row / present),
    ``lab_same_1xWxW`` (same cluster as an earlier row), ``kappa`` (per-node weight), ``lam`` (``lambda_s / K``)."""

    O_W: jax.Array
    live_W: jax.Array
    anc_same_DxWxW: jax.Array
    anc_member_DxW: jax.Array
    lab_same_1xWxW: jax.Array
    kappa: jax.Array
    lam: jax.Array

    def value(self, x_BxW: jax.Array) -> jax.Array:
        """float[B]: the objective of each 0/1 choice ``x`` (rows of a batch)."""
        x = x_BxW.astype(jnp.float32)
        nodes = jnp.sum(x, -1) + _first_of_class(self.anc_same_DxWxW, x, self.anc_member_DxW)
        covered = _first_of_class(self.lab_same_1xWxW, x, jnp.ones((1, x.shape[-1]), jnp.float32))
        return x @ self.O_W + self.kappa * nodes + self.lam * covered


def build_program(O_W, live_W, path_WxD1, depth_W, label_W, cost_weight: float, coverage_weight: float) -> Program:
    """The :class:`Program` of one prompt's candidates (``path`` node ids per depth; ancestors: depths
    ``0 .. depth - 1``, the root included; ``label`` the candidates' clusters)."""
    W, D1 = path_WxD1.shape
    live = live_W.astype(bool)
    lower = jnp.arange(W)[None, :] < jnp.arange(W)[:, None]  # [i, j]: j < i
    member = (jnp.arange(D1)[:, None] < depth_W[None, :]) & live[None, :]  # [D1, W]
    node = path_WxD1.T  # [D1, W]
    same = member[:, :, None] & member[:, None, :] & (node[:, :, None] == node[:, None, :]) & lower[None]
    lab_same = (label_W[:, None] == label_W[None, :]) & live[:, None] & live[None, :] & lower
    f = lambda a: a.astype(jnp.float32)  # noqa: E731
    liv = f(live)[None, :]
    M = _first_of_class(f(same), liv, f(member))[0]
    K = _first_of_class(f(lab_same)[None], liv, jnp.ones((1, W), jnp.float32))[0]
    per_node = -cost_weight if cost_weight > 0 else LAMBDA_C_GUARD
    kappa = per_node / jnp.maximum(M + jnp.sum(liv), 1.0)
    lam = coverage_weight / jnp.maximum(K, 1.0)
    return Program(O_W.astype(jnp.float32), live, f(same), f(member), f(lab_same)[None], kappa, lam)


def solve_exact(prog: Program) -> jax.Array:
    """bool[W]: the first best non-empty subset of the live rows, subsets in binary order (bit ``i`` = row ``i``)."""
    W = prog.live_W.shape[0]
    x = ((jnp.arange(2 ** W)[:, None] >> jnp.arange(W)[None, :]) & 1).astype(bool)
    ok = jnp.any(x, -1) & ~jnp.any(x & ~prog.live_W[None, :], -1)
    best = jnp.argmax(jnp.where(ok, prog.value(x), -jnp.inf))
    return x[best] & jnp.any(prog.live_W)


def solve_greedy(prog: Program) -> jax.Array:
    """bool[W]: from all live rows, drop the row whose removal raises the objective most, while one does."""
    W = prog.live_W.shape[0]
    eye = jnp.eye(W, dtype=bool)

    def body(_, x):
        drop = x[None, :] & ~eye  # row i: x without i
        gain = jnp.where(x & (jnp.sum(x) > 1), prog.value(drop), -jnp.inf) - prog.value(x[None, :])[0]
        i = jnp.argmax(gain)
        return jnp.where(gain[i] > 0, drop[i], x)

    return lax.fori_loop(0, W, body, prog.live_W)


# ----------------------------------------------------------------------------------------------- the rule
@register("ets")
@dataclasses.dataclass(frozen=True)
class ETS(BranchingRule):
    """ETS's selection at segment boundaries (module docstring). ``temperature``: REBASE's softmax temperature
    (official ``softmax_temperature``); ``cost_weight``: ``lambda_c``; ``coverage_weight``: ``lambda_s``
    (0: no clustering); ``cluster_distance``: the cosine-distance cut; ``embed_dim``: the step embedding's size;
    ``solver`` / ``exact_max_paths``: how the program is solved. ``scorer``: the PRM's
    :class:`~treejax.scorers.ScorerConfig` (the run loads it); ``prm``: the loaded in-loop scorer
    (:class:`~treejax.sampling.path_scores.PathScorer`, filled in when the run is built, never by hand in gin).
    Defaults: the official ``ets_*_math500.yaml`` (``T = 0.2``, ``lambda_c = 1``, ``lambda_s = 1.5``)."""

    temperature: float = 0.2
    cost_weight: float = 1.0
    coverage_weight: float = 1.5
    cluster_distance: float = 0.05
    embed_dim: int = 8192
    solver: str = "auto"
    exact_max_paths: int = 12
    scorer: Any = None
    prm: Any = None

    prunes = True
    needs_path_scores = True

    def __post_init__(self):
        check_choice("ETS.solver", self.solver, SOLVERS)
        if not self.temperature > 0:
            raise ConfigError(f"ETS.temperature must be > 0, got {self.temperature}; fix: ETS.temperature = 0.2")
        if self.cost_weight < 0 or self.coverage_weight < 0:
            raise ConfigError(f"ETS.cost_weight and ETS.coverage_weight must be >= 0, got {self.cost_weight}, "
                              f"{self.coverage_weight}; fix: the official 1.0 and 1.5")
        if not 0.0 <= self.cluster_distance <= 2.0 or self.embed_dim < 1:
            raise ConfigError(f"ETS.cluster_distance must be in [0, 2] (a cosine distance) and ETS.embed_dim >= 1, "
                              f"got {self.cluster_distance}, {self.embed_dim}; fix: 0.05 and 8192")
        if not 1 <= self.exact_max_paths <= EXACT_LIMIT:
            raise ConfigError(f"ETS.exact_max_paths must be in [1, {EXACT_LIMIT}] (2^W subsets are enumerated), got "
                              f"{self.exact_max_paths}; fix: ETS.exact_max_paths = 12")
        from treejax.scorers.config import ScorerConfig

        if self.scorer is not None and not isinstance(self.scorer, ScorerConfig):
            raise ConfigError(f"ETS.scorer must be a ScorerConfig (the PRM), got {self.scorer!r}; fix: "
                              "ETS.scorer = @ScorerConfig()")
        if self.scorer is not None and self.scorer.sharding != "device":
            raise ConfigError("ETS.scorer: the branching rule's PRM runs inside the sampler on its devices; "
                              "ScorerConfig.sharding = 'mesh' is for judge stages; fix: ScorerConfig.sharding = "
                              "'device'")

    @property
    def path_scorer(self):  # type: ignore[override]
        return self.prm

    def check_tree(self, tc) -> None:
        W = tc.num_leaves
        if not tc.budget_transfer:
            raise ConfigError("ETS's width is the sampler's budget with TreePO's budget transfer (a pruned path's "
                              "share goes to the kept ones); fix: TreeConfig.budget_transfer = True")
        if self.solver == "exact" and W > self.exact_max_paths:
            raise ConfigError(f"ETS.solver = 'exact' enumerates 2^W subsets, W = {W} > ETS.exact_max_paths = "
                              f"{self.exact_max_paths}; fix: ETS.solver = 'greedy' (or 'auto')")

    def uses_exact(self, W: int) -> bool:
        return self.solver == "exact" or (self.solver == "auto" and W <= self.exact_max_paths)

    def scores(self, stats: PathStats) -> jax.Array:
        if stats.path_scores_PxW is None:
            raise ValueError("ETS reads PRM scores (PathStats.path_scores_PxW), which this rollout did not compute: "
                             "give the rule a path scorer (ETS.prm; a run builds it from ETS.scorer)")
        return jnp.where(stats.live_PxW, stats.path_scores_PxW.astype(jnp.float32), 0.0)

    def width(self, stats: PathStats) -> jax.Array:
        """int32[P]: the sampler's budget before pruning, ``max(min(W - F, b (A + f)), A)`` (``F``: stored leaves
        and the ``f`` paths that ended in this segment; pruning leaves ``b (A + f)`` unchanged)."""
        W, b = stats.live_PxW.shape[-1], stats.branch_factor
        A, f = jnp.sum(stats.live_PxW, -1), jnp.sum(stats.ended_PxW, -1)
        return jnp.maximum(jnp.minimum(W - stats.leaves_P - f, b * (A + f)), A).astype(jnp.int32)

    def keep_set(self, stats: PathStats) -> jax.Array:
        """bool[P, W]: the program's kept paths (module docstring, steps 1-2)."""
        live, s = stats.live_PxW, self.scores(stats)
        n = rebase_counts(s, live, self.width(stats), self.temperature)
        O = n / jnp.maximum(jnp.sum(n, -1, keepdims=True), 1)
        if self.coverage_weight > 0:
            emb = step_embeddings(stats.segment_tokens(), self.embed_dim)
            labels = jax.vmap(lambda e, a: average_linkage_clusters(e, a, self.cluster_distance))(emb, live)
        else:
            labels = jnp.broadcast_to(jnp.arange(live.shape[-1]), live.shape)
        solve = solve_exact if self.uses_exact(live.shape[-1]) else solve_greedy

        def one(O_W, live_W, path, depth, label):
            return solve(build_program(O_W, live_W, path, depth, label, self.cost_weight, self.coverage_weight))

        return jax.vmap(one)(O, live, stats.path_PxWxD1, stats.depth_PxW, labels)

    def prune(self, stats: PathStats) -> jax.Array:
        return stats.live_PxW & ~self.keep_set(stats)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        """1 child per surviving path, plus its REBASE share of the ``total - A`` slots left (step 3)."""
        live = stats.live_PxW
        extra = rebase_counts(self.scores(stats), live, total_P - jnp.sum(live, -1), self.temperature,
                              ties_high_first=True)
        return jnp.where(live, 1 + extra, 0).astype(jnp.int32)
