"""Branching rules (``treejax.sampling.branching``) inside the tree rollout, against slow Python references.

A recording wrapper captures what each rule saw and decided at every segment boundary of real rollouts of
scripted toy policies (``jax.debug.callback``); on the host each decision is recomputed by the references in
``branching_references.py`` and must match exactly: which paths branch (child counts) and which are pruned. The
rollout must also apply them (forks = extra children; PRUNED leaves = pruned paths), keep the budget (counts
within TreePO's total) and end with exactly W leaves per prompt, without recompiling between steps."""

from __future__ import annotations

import dataclasses
import functools

import branching_references as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tree import _TABLE, TOY_EOS, TOY_M, TOY_V, _prompts

from treejax.forest import NodeStatus, forest_from_paths
from treejax.sampling import branching as B
from treejax.sampling import decode, tree
from treejax.sampling.branching.latr import similarity_curves

# ----------------------------------------------------------------------------------------------- scripted policy
def make_scaled_toy() -> decode.ModelFns:
    """test_tree's toy policy with its logits scaled by ``params["scale"]`` (sharp > 1 > flat): the logits depend
    on a hash of the whole cached prefix, so siblings diverge unless the policy is sharp."""
    table = jnp.asarray(_TABLE)

    def init_cache(rows, length):
        return {"tok": jnp.zeros((rows, 1, length), jnp.int32)}

    def prefill(params, tokens, positions, segment_ids, cache, rows):
        slots = jnp.where(segment_ids != 0, positions, cache["tok"].shape[2])
        return {"tok": cache["tok"].at[rows[:, None], 0, slots].set(tokens, mode="drop")}

    def step(params, tokens, positions, cache):
        R, L = cache["tok"].shape[0], cache["tok"].shape[2]
        c = cache["tok"].at[jnp.arange(R), 0, positions].set(tokens, mode="drop")
        slot = jnp.arange(L)[None, :]
        h = jnp.sum(jnp.where(slot <= positions[:, None], c[:, 0] * (slot + 1), 0), axis=-1) % TOY_M
        z = table[h] * params["scale"] + jnp.where(jnp.arange(TOY_V) == TOY_EOS, params["eos_bias"], 0.0)[None, :]
        return z, {"tok": c}

    return decode.ModelFns(init_cache, prefill, step, TOY_V, TOY_V, name="scaled_toy")


TOY = make_scaled_toy()
BASE = tree.TreeConfig(num_leaves=7, max_depth=4, segment_length=4, branch_factor=2, stop_ids=(TOY_EOS,),
                       max_response_length=14, row_buckets=2)

# ----------------------------------------------------------------------------------------------- recording
RECORDS: dict[int, list] = {}


def _record(tag, kind, segment, fields, out, total=None):
    RECORDS.setdefault(tag, []).append(dict(kind=kind, segment=int(segment), s=fields, out=np.asarray(out),
                                            total=None if total is None else np.asarray(total)))


def _host_fields(stats: B.PathStats) -> dict:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "key"
            and f.metadata.get("pytree_node", True)}


@dataclasses.dataclass(frozen=True)
class Recorded(B.BranchingRule):
    """Runs ``inner`` and records its inputs and decisions (test only)."""

    inner: B.BranchingRule
    tag: int

    @property
    def needs_entropy(self):
        return self.inner.needs_entropy

    @property
    def top_k(self):
        return self.inner.top_k

    @property
    def prunes(self):
        return self.inner.prunes

    def prune(self, stats):
        out = self.inner.prune(stats)
        jax.debug.callback(functools.partial(_record, self.tag, "prune"), stats.segment, _host_fields(stats), out)
        return out

    def allocate(self, stats, total_P):
        out = self.inner.allocate(stats, total_P)
        jax.debug.callback(functools.partial(_record, self.tag, "allocate"), stats.segment, _host_fields(stats), out,
                           total_P)
        return out


# ------------------------------------------------------------------------------------ docs/extending.md's example rule
@B.register("readme_confident")
@dataclasses.dataclass(frozen=True)
class Confident(B.BranchingRule):
    """Extra children to the most confident paths (mean log-prob of the last segment); prune below `floor`."""
    floor: float = -3.0
    prunes = True      # static: rules that never prune skip the stage
    top_k = 0          # per-token statistics it reads (needs_entropy = True for the entropy)

    def score(self, stats):
        return stats.masked_mean(stats.logp_PxWxT, stats.segment_mask())

    def prune(self, stats):
        return self.score(stats) < self.floor

    def allocate(self, stats, total_P):
        cap = jnp.full(stats.live_PxW.shape, stats.branch_factor - 1)
        return B.capped_allocation(self.score(stats), cap, stats.live_PxW, total_P)


def _confident_score(s):
    P, W = s["live_PxW"].shape
    out = np.zeros((P, W))
    for p in range(P):
        for w in range(W):
            lp = [float(s["logp_PxWxT"][p, w, t]) for t in range(s["segment_start_PxW"][p, w], s["length_PxW"][p, w])]
            out[p, w] = sum(lp) / max(len(lp), 1)
    return out


# ----------------------------------------------------------------------------------------------- references per rule
def _reference_counts(rule, s, total, S):
    live = s["live_PxW"]
    if isinstance(rule, B.FixedAverage):
        return ref.fixed_average(live, total, rule.remainder)
    if isinstance(rule, Confident):
        return ref.capped(_confident_score(s), np.full(live.shape, BASE.branch_factor - 1), live, total, True)
    if isinstance(rule, B.EntropyGuided):
        cap = np.full(live.shape, (BASE.branch_factor if rule.branches is None else rule.branches) - 1)
        return ref.capped(ref.entropy_scores(s, rule.statistic, rule.reduce), cap, live, total, rule.spill)
    if isinstance(rule, B.LATR):
        n = ref.latr_uncertain(s, rule.p_min, rule.gap)
        return ref.capped(n, np.minimum(n, rule.max_new), live, total, rule.spill)
    if isinstance(rule, B.ECHO):
        w = ref.echo_widths(s, rule)
        return ref.capped(w, w - 1, live, total, rule.spill)
    raise NotImplementedError(rule)


def _reference_prune(rule, s, S):
    if isinstance(rule, B.LATR):
        return ref.latr_prune(s, rule.lookahead, rule.suffix_threshold, rule.rouge_threshold, S)
    if isinstance(rule, B.ECHO):
        return ref.echo_prune(s, rule) & s["live_PxW"]
    if isinstance(rule, Confident):
        return (_confident_score(s) < rule.floor) & s["live_PxW"]
    return np.zeros(s["live_PxW"].shape, bool)


def _check_structure(forest, info, tc, P):
    """Exactly W leaves per prompt; nodes agree with a rebuild from the leaf paths; leaves sharing a node share its
    tokens; pruned leaves end in a PRUNED node; decoded tokens = unique tree tokens."""
    W, S = tc.num_leaves, tc.segment_length
    path, llen = np.asarray(forest.leaf_path), np.asarray(forest.leaf_length)
    status, toks = np.asarray(forest.leaf_status), np.asarray(forest.tokens)
    assert bool(info.complete) and path.shape[:2] == (P, W) and np.all(llen > 0)
    assert set(np.unique(status).tolist()) <= {2, 3, 4, 5, 6}
    rebuilt = forest_from_paths(path, llen, S, leaf_status=status)
    n = rebuilt.node_parent.shape[1]
    np.testing.assert_array_equal(np.asarray(forest.node_parent)[:, :n], np.asarray(rebuilt.node_parent))
    np.testing.assert_array_equal(np.asarray(forest.node_status)[:, :n], np.asarray(rebuilt.node_status))
    depth = np.asarray(forest.leaf_depth())
    decoded = 0
    for p in range(P):
        seen = {}
        for w in range(W):
            for k in range(1, depth[p, w] + 1):
                seen[path[p, w, k]] = max(seen.get(path[p, w, k], 0), min(llen[p, w], k * S) - (k - 1) * S)
            for v in range(w):
                shared = int(np.sum((path[p, w, 1:] == path[p, v, 1:]) & (path[p, w, 1:] >= 0)))
                upto = min(llen[p, w], llen[p, v], shared * S)
                np.testing.assert_array_equal(toks[p, w, :upto], toks[p, v, :upto])
        decoded += sum(seen.values())
    assert int(info.decoded_tokens) == decoded
    assert int(info.stops["pruned"]) == int(np.sum(status == NodeStatus.PRUNED))
    assert sum(int(v) for v in info.stops.values()) == P * W


def run_and_check(rule, params, seeds, tc=BASE, P=3):
    """Rolls out with ``rule`` under a recorder; every boundary's decisions == the references. Returns totals."""
    tag = len(RECORDS)
    tc = dataclasses.replace(tc, branching=Recorded(rule, tag))
    rollout = tree.make_tree_rollout(TOY, tc)
    before = decode.TRACE_COUNTS.get("tree_rollout", 0)
    totals = dict(pruned=0, uneven=0, boundaries=0)
    for i, seed in enumerate(seeds):
        RECORDS[tag] = []
        prompts, lengths = _prompts(seed, P=P)
        forest, info = rollout(params, prompts, lengths, jax.random.key(seed), step=i)
        jax.block_until_ready(forest)
        _check_structure(forest, info, tc, P)
        extra = 0
        for r in RECORDS[tag]:
            s = r["s"]
            if r["kind"] == "prune":
                np.testing.assert_array_equal(r["out"] & s["live_PxW"], _reference_prune(rule, s, tc.segment_length))
                totals["pruned"] += int(np.sum(r["out"] & s["live_PxW"]))
                continue
            live = s["live_PxW"]
            np.testing.assert_array_equal(r["total"], ref.budget(s, tc.num_leaves, tc.branch_factor))
            want = _reference_counts(rule, s, r["total"], tc.segment_length)
            np.testing.assert_array_equal(np.where(live, r["out"], 0), want)
            assert np.all(want[live] >= 1) and np.all(want.sum(-1) <= np.maximum(r["total"], live.sum(-1)))
            even = ref.fixed_average(live, r["total"], "first")
            totals["uneven"] += int(np.any(want != even))
            totals["boundaries"] += 1
            extra += int(np.sum(np.maximum(want - 1, 0)))
        assert int(info.forks) == extra  # the sampler forked exactly the extra children
        assert int(info.stops["pruned"]) == sum(int(np.sum(r["out"] & r["s"]["live_PxW"]))
                                                   for r in RECORDS[tag] if r["kind"] == "prune")
    assert decode.TRACE_COUNTS["tree_rollout"] - before <= 1  # one program for every step / key / batch
    assert totals["boundaries"] > 0
    return totals


# ----------------------------------------------------------------------------------------------- tests
FLAT = {"eos_bias": jnp.float32(-1.0), "scale": jnp.float32(0.6)}
SHARP = {"eos_bias": jnp.float32(-3.0), "scale": jnp.float32(4.0)}


@pytest.mark.parametrize("remainder", ["first", "last"])
def test_fixed_average_matches_reference(remainder):
    tc = dataclasses.replace(BASE, branch_factor=3)
    run_and_check(B.FixedAverage(remainder=remainder), FLAT, seeds=[0, 1], tc=tc)


@pytest.mark.parametrize("rule", [B.EntropyGuided(), B.EntropyGuided(statistic="nll", reduce="max", spill=False)],
                         ids=["entropy_mean", "nll_max_nospill"])
def test_entropy_guided_matches_reference(rule):
    totals = run_and_check(rule, FLAT, seeds=[0, 1, 2])
    assert totals["uneven"] > 0  # the budget really follows the score, not the even split


def test_latr_matches_reference_and_prunes_similar_siblings():
    rule = B.LATR(p_min=0.15, gap=0.25, lookahead=(2, 3), suffix_threshold=0.5, rouge_threshold=0.6)
    flat = run_and_check(rule, FLAT, seeds=[0, 1])
    sharp = run_and_check(rule, SHARP, seeds=[0, 1])  # near-deterministic: siblings repeat each other
    assert sharp["pruned"] > 0 and flat["uneven"] + sharp["uneven"] > 0


def test_echo_matches_reference_branches_and_prunes():
    # thresholds rescaled to a 6-token vocabulary (entropy <= log 6 = 1.79; top-5 confidence in [1.79, ~10])
    rule = B.ECHO(min_depth=1, entropy_high=1.2, entropy_low=0.3, branch_threshold=3.0, entropy_delta_threshold=0.0,
                  prune_threshold=1.9, tail_threshold=2.4, delta_upper=0.2)
    totals = run_and_check(rule, FLAT, seeds=[0, 1, 2])
    assert totals["pruned"] > 0 and totals["uneven"] > 0


def test_readme_example_rule():
    """A new rule is one class + ``register`` (docs/extending.md); gin knows it by class name."""
    from treejax import train

    totals = run_and_check(Confident(floor=-1.6), FLAT, seeds=[0, 1])
    assert totals["pruned"] > 0 and totals["uneven"] > 0
    assert B.get_rule("readme_confident", floor=-2.0) == Confident(floor=-2.0)
    assert train.register_configurables()["Confident"] is Confident


# ----------------------------------------------------------------------------------------------- kernels
def test_capped_allocation_matches_reference():
    rng = np.random.RandomState(0)
    capped = jax.jit(B.capped_allocation, static_argnums=4)  # one compile per (W, spill), not 400 op-by-op runs
    for _ in range(200):
        P, W = 3, rng.randint(1, 9)
        live = rng.rand(P, W) < 0.6
        score = rng.randint(0, 4, (P, W)).astype(np.float32)  # ties on purpose
        cap = rng.randint(0, 4, (P, W))
        total = rng.randint(0, 3 * W, P)
        for spill in (True, False):
            got = capped(jnp.asarray(score), jnp.asarray(cap), jnp.asarray(live), jnp.asarray(total), spill)
            np.testing.assert_array_equal(np.asarray(got), ref.capped(score, cap, live, total, spill))


def test_similarity_curves_match_latr_metrics():
    rng = np.random.RandomState(1)
    B_, L = 64, 9
    a = rng.randint(0, 3, (B_, L))
    b = np.where(rng.rand(B_, L) < 0.5, a, rng.randint(0, 3, (B_, L)))
    suffix, lcs = map(np.asarray, similarity_curves(jnp.asarray(a), jnp.asarray(b)))
    for i in range(B_):
        for l in range(1, L + 1):
            x, y = a[i, :l].tolist(), b[i, :l].tolist()
            assert suffix[i, l - 1] / l == pytest.approx(ref.suffix_match(x, y))
            assert lcs[i, l - 1] / l == pytest.approx(ref.rouge_l(x, y))


def test_windowed_mean_and_rule_errors():
    x = np.random.RandomState(2).randn(2, 3, 7).astype(np.float32)
    length = np.array([[7, 3, 0], [5, 7, 1]])
    got = np.asarray(B.windowed_mean(jnp.asarray(x), jnp.asarray(length), 3))
    for p in range(2):
        for w in range(3):
            for t in range(7):
                want = np.mean(x[p, w, max(0, t - 2): t + 1]) if t < length[p, w] else 0.0
                assert got[p, w, t] == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="remainder"):
        B.FixedAverage(remainder="middle")
    with pytest.raises(KeyError, match="valid"):
        B.get_rule("vibes")
    assert isinstance(B.get_rule("latr", max_new=1), B.LATR)
