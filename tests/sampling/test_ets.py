"""ETS (``treejax.sampling.branching.ets``): the selection rule against the slow reference
(``branching_references.ets_*``) on hand-made and random boundaries, its config checks, the in-loop PRM
(``treejax.sampling.path_scores``) against a direct forward, and tree rollouts with ETS: a tiny transformer with a
PRM end to end, and the path-mass-weighted estimate at the base policy against the exact distribution."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.cluster.hierarchy import fcluster, linkage

from treejax.errors import ConfigError
from treejax.forest import NodeStatus
from treejax.sampling import path_scores, tree
from treejax.sampling.branching import ETS, PathStats
from treejax.sampling.branching import ets as ets_lib
from treejax.sampling.path_scores import PathScorer

from tests.sampling import branching_references as ref


def boundary(scores, live, *, path=None, depth=None, tokens=None, leaves=0, ended=None, S=2, b=None):
    """One prompt's PathStats (P = 1) from hand-made lists; default: every path a child of the root at depth 1."""
    W = len(scores)
    live = np.asarray(live, bool)[None]
    depth = np.ones((1, W), np.int32) if depth is None else np.asarray(depth, np.int32)[None]
    if path is None:
        path = np.full((1, W, 3), -1, np.int32)
        path[0, :, 0], path[0, :, 1] = 0, 1 + np.arange(W)
    path = np.asarray(path, np.int32).reshape(1, W, -1)
    T = path.shape[-1] * S
    toks = np.zeros((1, W, T), np.int32)
    if tokens is not None:
        toks[0, :, :S] = tokens
    ended = np.zeros((1, W), bool) if ended is None else np.asarray(ended, bool)[None]
    z = jnp.zeros((1, W, T))
    return PathStats(
        live_PxW=jnp.asarray(live), ended_PxW=jnp.asarray(ended), status_PxW=jnp.zeros((1, W), jnp.int32),
        depth_PxW=jnp.asarray(depth), length_PxW=jnp.full((1, W), S, jnp.int32),
        segment_start_PxW=jnp.zeros((1, W), jnp.int32), tokens_PxWxT=jnp.asarray(toks), logp_PxWxT=z,
        entropy_PxWxT=z, topk_PxWxTxK=jnp.zeros((1, W, T, 0)), path_PxWxD1=jnp.asarray(path),
        leaves_P=jnp.asarray([leaves], jnp.int32), step=jnp.int32(0), segment=jnp.int32(0), key=jax.random.key(0),
        path_scores_PxW=jnp.asarray([scores], jnp.float32), branch_factor=W if b is None else b, segment_length=S)


def run_jax(rule, stats):
    """One boundary as the sampler runs it: prune, then allocate the sampler's budget (``tree_stages.branch_budget``
    with transfer: ``max(min(W - F, b A + b f), A)``, pruned paths among the ``f`` that ended)."""
    from treejax.sampling.tree_stages import branch_budget

    prune = rule.prune(stats)
    kept = stats.replace(live_PxW=stats.live_PxW & ~prune, ended_PxW=stats.ended_PxW | prune)
    f = jnp.sum(kept.ended_PxW, -1).astype(jnp.int32)
    tc = tree.TreeConfig(num_leaves=stats.live_PxW.shape[-1], branch_factor=stats.branch_factor)
    return prune, rule.allocate(kept, branch_budget(kept.live_PxW, f, stats.leaves_P + f, tc=tc))


@functools.lru_cache(maxsize=None)
def jitted(rule, method=None):
    return jax.jit(functools.partial(run_jax, rule) if method is None else getattr(rule, method))


def run(rule, stats):
    prune, counts = jitted(rule)(stats)
    return np.asarray(prune), np.asarray(counts)


def host(stats):
    return {k: np.asarray(v) for k, v in vars(stats).items() if isinstance(v, jax.Array) and k != "key"}


# ----------------------------------------------------------------------------------------------- hand-made
def test_rebase_by_hand():
    # e = exp((s - 0.9) / 0.2) = 1, 0.2231, 0.1353, 0.0183 (sum 1.3767): ceil(4 / 1.3767) = 3, then
    # ceil(1 * 0.2231 / 0.3767) = 1, then the width is spent
    n = ets_lib.rebase_counts(jnp.asarray([[0.9, 0.6, 0.5, 0.1]]), jnp.ones((1, 4), bool), jnp.asarray([4]), 0.2)
    np.testing.assert_array_equal(np.asarray(n), [[3, 1, 0, 0]])
    assert ref.ets_rebase([0.9, 0.6, 0.5, 0.1], [True] * 4, 4, 0.2) == [3, 1, 0, 0]
    # T = 1: e = 1, .741, .670, .449 (sum 2.860): ceil(8 / 2.86) = 3; ceil(5 * .741 / 1.860) = 2; ceil(3 * .670 /
    # 1.119) = 2; the last takes the 1 left
    n = ets_lib.rebase_counts(jnp.asarray([[0.9, 0.6, 0.5, 0.1]]), jnp.ones((1, 4), bool), jnp.asarray([8]), 1.0)
    np.testing.assert_array_equal(np.asarray(n), [[3, 2, 2, 1]])


def test_ets_by_hand_cost_prunes():
    """W = 8, four live paths scored .9 .6 .5 .1 (4 rows free), T = 0.2, lambda_c = 1, no coverage. REBASE of the
    width 8: e = 1, .2231, .1353, .0183 (sum 1.3767): ceil(8 / 1.3767) = 6, ceil(2 * .2231 / .3767) = 2, then
    nothing: O = (3/4, 1/4, 0, 0). M = 1 (the root), N = 4, kappa = -1/5: f({0}) = .75 - .4 = .35,
    f({0,1}) = 1 - .6 = .4 (the best), f({0,1,2}) = .2. Paths 2, 3 are pruned (2 leaves); the total 8 - 2 = 6
    gives each kept path 1 and REBASE splits the 4 left: ceil(4 / 1.2231) = 4 to path 0."""
    rule = ETS(cost_weight=1.0, coverage_weight=0.0)
    prune, counts = run(rule, boundary([0.9, 0.6, 0.5, 0.1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]))
    np.testing.assert_array_equal(prune[0, :4], [False, False, True, True])
    np.testing.assert_array_equal(counts, [[5, 1, 0, 0, 0, 0, 0, 0]])


def test_ets_by_hand_room_to_grow():
    """W = 8, two live paths (.8, .7), 6 leaves stored: width 2; e = 1, .6065, ceil(2 / 1.6065) = 2 spends it, so
    O = (1, 0); M = 1, N = 2, kappa = -1/3: f({0}) = 1 - 2/3 = 1/3 beats f({0,1}) = 1 - 1 = 0; path 1 is pruned
    and path 0 takes the 2 - 1 = 1 slot left."""
    rule = ETS(cost_weight=1.0, coverage_weight=0.0)
    stats = boundary([0.8, 0.7] + [0.0] * 6, [1, 1] + [0] * 6, leaves=6)
    prune, counts = run(rule, stats)
    np.testing.assert_array_equal(prune[0, :2], [False, True])
    np.testing.assert_array_equal(counts[0], [1] + [0] * 7)


def test_ets_by_hand_coverage_keeps_a_different_step():
    """Scores .9 .85 .3, W = 3, T = 1, lambda_c = 0 (the official guard: +1e-4 per node), lambda_s = 1.5. Paths 0
    and 1 decoded the same step (one cluster), path 2 another: K = 2, covering both is worth 1.5. REBASE: e = 1,
    .951, .549 (sum 2.5): ceil(3 / 2.5) = 2, ceil(1 * .951 / 1.5) = 1, 0 -> O = (2/3, 1/3, 0); the program keeps
    all three (1 + 1.5 + 4e-4 / 4), nothing is pruned, and with no slot to spare each path has 1 child."""
    rule = ETS(temperature=1.0, cost_weight=0.0, coverage_weight=1.5)
    stats = boundary([0.9, 0.85, 0.3], [1, 1, 1], tokens=[[5, 6], [5, 6], [7, 8]])
    keep = np.asarray(jitted(rule, "keep_set")(stats))
    np.testing.assert_array_equal(keep, [[True, True, True]])
    prune, counts = run(rule, stats)
    assert not prune.any()
    np.testing.assert_array_equal(counts, [[1, 1, 1]])
    want = ref.ets_boundary(host(stats), 1.0, 0.0, 1.5, rule.embed_dim, rule.cluster_distance)
    np.testing.assert_array_equal(prune, want[0])
    np.testing.assert_array_equal(counts, want[1])


def test_coverage_changes_the_program():
    """Scores .9 .88 .2, lambda_c = 1, T = 1, W = 3 with 3 free slots. Without coverage the low third path is
    dropped; with lambda_s = 3 and path 2's step unlike the others (K = 2) keeping it is worth 1.5."""
    tokens = [[5, 6], [5, 6], [7, 8]]
    stats = boundary([0.9, 0.88, 0.2], [1, 1, 1], tokens=tokens)
    plain = np.asarray(jitted(ETS(temperature=1.0, cost_weight=1.0, coverage_weight=0.0), "keep_set")(stats))
    cover = np.asarray(jitted(ETS(temperature=1.0, cost_weight=1.0, coverage_weight=3.0), "keep_set")(stats))
    assert not plain[0, 2] and cover[0, 2]


def test_shared_ancestors_are_paid_once():
    """Paths 0, 1 share the depth-1 node 1, path 2 sits under node 2 (depth 2 each): keeping 0 and 1 adds one node
    (the leaf), keeping 2 adds two (node 2 and the leaf)."""
    path = [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    stats = boundary([0.5, 0.5, 0.5], [1, 1, 1], path=path, depth=[2, 2, 2])
    O, live = jnp.asarray([1 / 3] * 3), jnp.ones(3, bool)
    prog = ets_lib.build_program(O, live, jnp.asarray(path), jnp.asarray([2, 2, 2]), jnp.arange(3), 1.0, 0.0)
    v = np.asarray(prog.value(jnp.asarray([[1, 1, 0], [1, 0, 1], [1, 0, 0]], bool)))
    kappa = -1.0 / (3 + 3)  # M = {root, 1, 2}, N = 3
    np.testing.assert_allclose(v, [2 / 3 + kappa * 4, 2 / 3 + kappa * 5, 1 / 3 + kappa * 3], rtol=1e-6)
    # each is worth O = 1/3 < 2 |kappa| for a new branch, but 1/3 > |kappa| next to a kept sibling: keep 0, 1
    np.testing.assert_array_equal(np.asarray(jitted(ETS(coverage_weight=0.0), "keep_set")(stats)), [[1, 1, 0]])


# ----------------------------------------------------------------------------------------------- edge cases
def test_all_rows_dead():
    stats = boundary([0.3, 0.2, 0.1], [0, 0, 0], ended=[1, 1, 1])
    prune, counts = run(ETS(), stats)
    assert not prune.any() and not counts.any()


def test_budget_smaller_than_live_rows():
    """allocate with total < A: every live path still gets >= 1 (the contract: sum <= max(total, A))."""
    stats = boundary([0.9, 0.6, 0.5, 0.1], [1, 1, 1, 1])
    allocate = jax.jit(ETS().allocate)
    counts = np.asarray(allocate(stats, jnp.asarray([2])))
    np.testing.assert_array_equal(counts, [[1, 1, 1, 1]])
    counts = np.asarray(allocate(stats, jnp.asarray([6])))  # 1 each, then REBASE of 2: ceil(2 / 1.377) = 2
    np.testing.assert_array_equal(counts, [[3, 1, 1, 1]])
    stats = boundary([0.9, 0.6, 0.5, 0.1], [1, 1, 1, 1], leaves=2)  # width 2 < A = 4: keeps the best path only
    prune, counts = run(ETS(coverage_weight=0.0), stats)
    assert counts[0, 0] >= 1 and (~prune[0]).sum() >= 1


def test_ties():
    """Equal scores: the first REBASE goes to the lower index first, the final one to the higher (the official
    sorted(reverse=True) and sorted().reverse())."""
    live = jnp.ones((1, 3), bool)
    low = ets_lib.rebase_counts(jnp.full((1, 3), 0.5), live, jnp.asarray([4]), 0.2)
    high = ets_lib.rebase_counts(jnp.full((1, 3), 0.5), live, jnp.asarray([4]), 0.2, ties_high_first=True)
    np.testing.assert_array_equal(np.asarray(low), [[2, 1, 1]])
    np.testing.assert_array_equal(np.asarray(high), [[1, 1, 2]])
    stats = boundary([0.5] * 4, [1] * 4)
    prune, counts = run(ETS(temperature=10.0, cost_weight=0.0, coverage_weight=0.0), stats)
    want = ref.ets_boundary(host(stats), 10.0, 0.0, 0.0, 8192, 0.05)
    np.testing.assert_array_equal(prune, want[0])
    np.testing.assert_array_equal(counts, want[1])


def test_config_checks():
    with pytest.raises(ConfigError, match="ETS.temperature must be > 0"):
        ETS(temperature=0.0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        ETS(cost_weight=-1.0)
    with pytest.raises(ValueError, match="ETS.solver"):
        ETS(solver="cbc")
    with pytest.raises(ConfigError, match="exact_max_paths must be in"):
        ETS(exact_max_paths=20)
    with pytest.raises(ConfigError, match=r"fix: ETS.scorer = @ScorerConfig\(\)"):
        ETS(scorer="policy")
    from treejax.scorers.config import ScorerConfig
    with pytest.raises(ConfigError, match="runs inside the sampler .* fix: ScorerConfig.sharding = 'device'"):
        ETS(scorer=ScorerConfig(sharding="mesh"))
    with pytest.raises(ConfigError, match="fix: TreeConfig.budget_transfer = True"):
        tree.TreeConfig(num_leaves=8, branch_factor=2, budget_transfer=False, branching=ETS())
    with pytest.raises(ConfigError, match="fix: ETS.solver = 'greedy'"):
        tree.TreeConfig(num_leaves=16, branch_factor=16, branching=ETS(solver="exact"))
    with pytest.raises(ValueError, match="cannot use the pruning rule"):
        tree.TreeConfig(num_leaves=4, branch_factor=4, allocation="slots", branching=ETS())
    with pytest.raises(ValueError, match="has no path scorer"):
        tree.make_tree_rollout(AB, tree.TreeConfig(num_leaves=4, branch_factor=4, branching=ETS()))


# ----------------------------------------------------------------------------------------------- random inputs
def random_boundary(rng, W, D=3, S=3, vocab=4):
    """A random consistent boundary: a random tree of live paths (depth 1..D-1), a few ended paths, leaves."""
    n_live = rng.randint(0, W + 1)
    n_leaves = rng.randint(0, W - n_live + 1)
    live = np.zeros(W, bool)
    live[rng.choice(W, n_live, replace=False)] = True
    depth = rng.randint(1, D, W)
    path = np.full((W, D + 1), -1)
    path[:, 0] = 0
    for w in range(W):
        for d in range(1, depth[w] + 1):
            path[w, d] = 1 + (d - 1) * 3 + rng.randint(0, 3) if d < depth[w] else 100 + w
    n_ended = rng.randint(0, W - n_live - n_leaves + 1)
    ended = np.zeros(W, bool)
    ended[rng.choice(np.nonzero(~live)[0], n_ended, replace=False)] = True
    stats = boundary(rng.rand(W).round(2) if rng.rand() < 0.3 else rng.rand(W), live, path=path, depth=depth,
                     tokens=rng.randint(0, vocab, (W, S)), leaves=n_leaves, ended=ended, S=S,
                     b=int(rng.choice([1, 2, W])))
    return stats


@pytest.mark.parametrize("solver", ["exact", "greedy"])
def test_jitted_rule_equals_the_reference_on_random_boundaries(solver):
    rng = np.random.RandomState(0 if solver == "exact" else 1)
    rule = ETS(temperature=0.3, cost_weight=1.0, coverage_weight=1.5, cluster_distance=0.2, solver=solver)
    step = jitted(rule)
    checked = 0
    for _ in range(40):
        stats = random_boundary(rng, W=6)
        prune, counts = step(stats)
        want = ref.ets_boundary(host(stats), 0.3, 1.0, 1.5, rule.embed_dim, 0.2, exact=solver == "exact",
                                b=stats.branch_factor)
        np.testing.assert_array_equal(np.asarray(prune), want[0])
        np.testing.assert_array_equal(np.asarray(counts), want[1])
        checked += int(np.asarray(stats.live_PxW).sum() > 1)
    assert checked >= 20


@pytest.mark.parametrize("threshold", [0.05, 0.2, 0.5])
def test_clusters_equal_scipy_average_linkage(threshold):
    """Random vectors on 8 rows (some repeated), a random subset active: the flat clusters of the active rows equal scipy's
    ``fcluster(linkage(e, 'average', 'cosine'), threshold, 'distance')``; inactive rows stay alone."""
    rng = np.random.RandomState(3)
    W = 8
    clusters = jax.jit(lambda e, a: ets_lib.average_linkage_clusters(e, a, threshold))
    merged = 0
    for trial in range(12):
        emb = rng.rand(W, 5) ** 4  # continuous: no cosine distance sits exactly on the cut
        emb[rng.randint(0, W, 3)] = emb[rng.randint(0, W)]  # a few identical steps
        active = rng.rand(W) < 0.8
        got = np.asarray(clusters(jnp.asarray(emb, jnp.float32), jnp.asarray(active)))
        rows = np.nonzero(active)[0]
        want = np.arange(W)
        if len(rows) >= 2:
            flat = fcluster(linkage(emb[rows], method="average", metric="cosine"), threshold, criterion="distance")
            for k, i in enumerate(rows):
                want[i] = min(rows[j] for j in range(len(rows)) if flat[j] == flat[k])
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")
        merged += int(np.sum(want != np.arange(W)))
    assert merged > 0


# ----------------------------------------------------------------------------------------------- in the rollout
from tests.sampling.test_slot_tree import LP, T_MAX, V_A, V_B, exact_cells, make_ab_policy  # noqa: E402

AB = make_ab_policy()


@dataclasses.dataclass(frozen=True)
class FirstTokenScorer(PathScorer):
    """A scripted PRM (no weights): ``score = a`` if the response starts with A, else ``b``, plus ``per_token``
    times the response length (so it reads what was decoded so far)."""

    a: float = 0.8
    b: float = 0.4
    per_token: float = 0.01

    def score(self, params, prompts_PxL, prompt_len_P, tokens_RxT, length_R, depth_R, segment_length):
        return jnp.where(tokens_RxT[:, 0] == V_A, self.a, self.b) + self.per_token * length_R


def ab_histograms(tc, calls=8, P=64, first_only=False, weighted=True):
    rollout = path_scores.with_scorer(tree.make_tree_rollout(AB, tc), {})
    prompts, lengths = np.full((P, LP), 4, np.int32), np.full((P,), LP)
    out, pruned = [], 0
    for c in range(calls):
        forest, info = rollout({}, prompts, lengths, jax.random.key(2000 + c))
        tok0, length = np.asarray(forest.tokens[:, :, 0]), np.asarray(forest.leaf_length)
        w = np.asarray(forest.leaf_weights())
        np.testing.assert_allclose(w.sum(1), tc.num_leaves, rtol=1e-5)
        w = w if weighted else (length > 0).astype(np.float64)
        pruned += int(info.stops["pruned"])
        h = np.zeros((P, 2, T_MAX + 1))
        for i, tok in enumerate((V_A, V_B)):
            for n in range(T_MAX + 1):
                cell = (n == 0) & (length > 0) if first_only else length == n  # first_only: column 0 only
                h[:, i, n] = np.sum(w * ((tok0 == tok) & cell), axis=1)
        out.append(h / h.sum(axis=(1, 2), keepdims=True))
    return np.concatenate(out), pruned


def z_scores(h, p):
    mean, se = h.mean(axis=0), h.std(axis=0, ddof=1) / np.sqrt(h.shape[0])
    cells = p > 0
    return np.abs(mean[cells] - p[cells]) / np.maximum(se[cells], 1e-12)


@dataclasses.dataclass(frozen=True)
class ETSCountsOnly(ETS):
    """ETS's child counts (the PRM-scored REBASE split of :meth:`ETS.allocate`) with its pruning switched off."""

    prunes = False


AB_ETS = tree.TreeConfig(num_leaves=8, max_depth=4, segment_length=2, branch_factor=8, stop_ids=(1,),
                         row_buckets=1, init_divergence=2, fallback=False,
                         branching=ETSCountsOnly(temperature=0.5, prm=FirstTokenScorer()))


def test_ets_child_counts_are_unbiased_at_the_base_policy():
    """The PRM moves child counts toward A-first paths (they branch more); weighted by path mass, the histogram of
    (first token, length) must still match the policy (|z| < 4 in every cell); counted equally it must not."""
    h, pruned = ab_histograms(AB_ETS)
    assert pruned == 0
    z = z_scores(h, exact_cells())
    assert z.max() < 4.0, z.max()
    counted, _ = ab_histograms(AB_ETS, calls=2, weighted=False)
    assert z_scores(counted, exact_cells()).max() > 6.0  # the counts did move: equal counting is biased


def test_ets_pruning_keeps_the_first_step_unbiased():
    """The official settings prune (T = 0.2, lambda_c = 1): leaves stop early, so lengths are cut, but the first
    segment is decoded before any boundary: its mass-weighted first-token share stays 1/2 each."""
    tc = dataclasses.replace(AB_ETS, branching=ETS(coverage_weight=0.0, prm=FirstTokenScorer()))
    h, pruned = ab_histograms(tc, first_only=True)
    assert pruned > 0
    p = np.zeros_like(exact_cells())
    p[:, 0] = 0.5
    assert np.all(h[:, :, 1:] == 0)
    z = z_scores(h, p)
    assert z.max() < 4.0, z.max()


# ----------------------------------------------------------------------------------------------- the PRM in the loop
def test_tagged_rows_by_hand():
    """Prompt [7, 8] (length 2 of 3), two segments of S = 2 decoded, tag (9,): 7 8 | a b 9 | c d 9."""
    seq, length, end = path_scores.tagged_rows(jnp.asarray([[7, 8, 0]]), jnp.asarray([2]),
                                               jnp.asarray([[11, 12, 13, 14, 0, 0], [21, 22, 0, 0, 0, 0]]),
                                               jnp.asarray([2, 1]), 2, (9,))
    np.testing.assert_array_equal(np.asarray(seq)[0, :8], [7, 8, 11, 12, 9, 13, 14, 9])
    np.testing.assert_array_equal(np.asarray(seq)[1, :5], [7, 8, 21, 22, 9])
    np.testing.assert_array_equal(np.asarray(length), [8, 5])
    np.testing.assert_array_equal(np.asarray(end), [7, 4])


ETS_RECORDS: list = []


@dataclasses.dataclass(frozen=True)
class RecordedETS(ETS):
    """ETS that records each boundary's inputs (PRM scores included) and pruning decision (test only)."""

    def prune(self, stats):
        out = super().prune(stats)
        fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)
                  if f.name != "key" and f.metadata.get("pytree_node", True) and getattr(stats, f.name) is not None}
        jax.debug.callback(lambda f, o: ETS_RECORDS.append((jax.tree.map(np.asarray, f), np.asarray(o))), fields,
                           out)
        return out


@pytest.fixture(scope="module")
def tiny_policy_and_prm(tiny_checkpoint):
    from treejax.models.registry import load_model
    from treejax.scorers import ScorerConfig
    from treejax.scorers.model import load_scorer

    config, params, tok = load_model(tiny_checkpoint)
    prm = load_scorer(ScorerConfig(model="policy", step_tag="\nCorrect?"), policy_model=tiny_checkpoint)
    return config, params, tok, prm


def _direct_prm_score(prm, ids, width):
    from treejax.models import transformer

    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    seg = (np.arange(width) < len(ids)).astype(np.int32)[None]
    h = jax.jit(transformer.forward, static_argnums=1)(prm.params, prm.model_config, jnp.asarray(tokens),
                                                       jnp.arange(width, dtype=jnp.int32)[None], jnp.asarray(seg))
    logp = np.asarray(jax.nn.log_softmax(transformer.logits(prm.params, prm.model_config, h[:, len(ids) - 1]), -1))[0]
    py, pn = np.exp(logp[list(prm.yes_ids)]).sum(), np.exp(logp[list(prm.no_ids)]).sum()
    return py / (py + pn)


def test_ets_tree_rollout_with_a_prm_end_to_end(tiny_policy_and_prm):
    """A tiny transformer policy, its frozen copy as the PRM, ETS with coverage: every boundary's PRM scores equal a
    direct forward of ``prompt seg_1 TAG ... seg_d TAG`` per live row, its pruning equals the reference, and the
    forest keeps W leaves whose path-mass weights sum to W."""
    config, params, tok, prm = tiny_policy_and_prm
    tc = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=3, branch_factor=4, init_divergence=2,
                         fallback=False, row_buckets=1, stop_ids=tuple(tok.eos_ids),
                         branching=RecordedETS(temperature=0.2, cost_weight=1.0, coverage_weight=1.5))
    tc, weights = path_scores.bind_rule(tc, prm, tok)
    assert tc.rule.prm.tag == tuple(tok.encode("\nCorrect?"))
    rollout = path_scores.with_scorer(tree.make_tree_rollout(config, tc), weights)
    texts = ["What is 2 + 3?", "Name a prime."]
    ids = [tok.encode(t) for t in texts]
    prompts = np.zeros((2, max(map(len, ids))), np.int32)
    for i, x in enumerate(ids):
        prompts[i, : len(x)] = x
    ETS_RECORDS.clear()
    forest, info = rollout(params, prompts, np.array([len(x) for x in ids]), jax.random.key(0))
    jax.block_until_ready(forest.tokens)
    assert len(ETS_RECORDS) >= 2, "fewer than 2 boundaries recorded"
    assert int(info.forks) > 0  # the root's 2 free rows went to REBASE's choice
    S, tag = tc.segment_length, list(tc.rule.prm.tag)
    width = 64
    for s, prune in ETS_RECORDS:
        for p, w in zip(*np.nonzero(s["live_PxW"])):
            toks = s["tokens_PxWxT"][p, w][: s["depth_PxW"][p, w] * S].tolist()
            row = ids[p] + sum((toks[k:k + S] + tag for k in range(0, len(toks), S)), [])
            np.testing.assert_allclose(s["path_scores_PxW"][p, w], _direct_prm_score(prm, row, width), rtol=1e-4)
        want, _ = ref.ets_boundary(s, 0.2, 1.0, 1.5, tc.rule.embed_dim, tc.rule.cluster_distance,
                                   b=tc.branch_factor)
        np.testing.assert_array_equal(prune, want)
    weights_PxW = np.asarray(forest.leaf_weights())
    np.testing.assert_allclose(weights_PxW.sum(1), tc.num_leaves, rtol=1e-5)
    assert np.all(np.asarray(forest.leaf_length) > 0)
    assert int(info.stops["pruned"]) == int(np.sum(np.asarray(forest.leaf_status) == NodeStatus.PRUNED))


def test_prm_path_scorer_refuses_another_tokenizer(tiny_policy_and_prm):
    from treejax.testing.tokenizers import CharTokenizer

    *_, prm = tiny_policy_and_prm
    with pytest.raises(ConfigError, match="fix: ScorerConfig.model = 'policy'"):
        path_scores.prm_path_scorer(prm, CharTokenizer())


# ----------------------------------------------------------------------------------------------- gin and the run
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                      "efficacy_ets.gin")


def test_shipped_config_builds_ets_with_its_prm():
    from treejax import train
    from treejax.scorers import ScorerConfig

    cfg = train.parse([CONFIG], [])
    rule = cfg.rollout.rule
    assert isinstance(rule, ETS) and rule.solver == "exact" and rule.exact_max_paths == 16
    assert rule.scorer == ScorerConfig(model="policy") and cfg.rollout.num_leaves == 16
    with pytest.raises(ConfigError, match=r"fix: ETS.scorer = @ScorerConfig\(\)"):
        train.parse([CONFIG], ["ETS.scorer = None"])
    with pytest.raises(ConfigError, match="fix: TreeConfig.budget_transfer = True"):
        train.parse([CONFIG], ["TreeConfig.budget_transfer = False"])


def test_run_binds_the_prm_and_ships_its_weights(tiny_checkpoint, tiny_policy_and_prm):
    """``treejax.rl.setup.path_scored``: the rule's scorer loads once, the rule gets its in-loop PRM, and every
    rollout call's params carry the scorer's weights (the policy's own params are untouched)."""
    from types import SimpleNamespace

    from treejax.rl.setup import path_scored
    from treejax.scorers import ScorerConfig

    *_, tok, prm = tiny_policy_and_prm
    calls = []

    def make(tc):
        def rollout(params, *args):
            calls.append((tc, params))
        rollout.core = rollout.tree_config = rollout.model_fns = rollout.continuations = None
        return rollout

    build = path_scored(SimpleNamespace(model=tiny_checkpoint), tok, make)
    tc = tree.TreeConfig(num_leaves=4, branch_factor=4, branching=ETS(scorer=ScorerConfig(model="policy")))
    build(tc)({"w": 1})
    (bound, params), = calls
    assert isinstance(bound.rule.prm, path_scores.PRMPathScorer) and bound.rule.prm.yes_ids == prm.yes_ids
    rest, weights = path_scores.detach(params)
    assert rest == {"w": 1} and jax.tree.structure(weights) == jax.tree.structure(prm.params)
    plain = tree.TreeConfig(num_leaves=4, branch_factor=2)
    build(plain)({"w": 2})
    assert calls[-1] == (plain, {"w": 2})


@pytest.mark.slow  # one step of the whole loop with ETS and its in-loop PRM on the tiny model (~1-2 min on 2 cores)
def test_one_loop_step_with_ets(tiny_checkpoint, tmp_path):
    from treejax import train

    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.init_divergence = 2", "TreeConfig.max_depth = 3", "TreeConfig.segment_length = 4",
              "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2",
              "RunConfig.eval_every = 0", "RunConfig.mini_batches = 1", "RunConfig.dynamic_sampling = False"]
    summary = train.main(["--gin_file", CONFIG, "--quiet"] + sum((["--gin_param", p] for p in params), []))
    row = summary["history"][0]
    assert np.isfinite(row["update/loss"])
    assert sum(v for k, v in row.items() if k.startswith("rollout/stops/")) == 2 * 4  # W leaves per prompt
    assert 1 <= row["rollout/forks"] <= 2 * (4 - 2)  # ETS spends at most the W - init_divergence free rows
