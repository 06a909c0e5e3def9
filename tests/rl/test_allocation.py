"""Prompt-level allocation: the allocators against slow references of their formulas, the chunk planner's budget
invariants, the group forest, and the ragged estimators (unused slots change nothing)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.rl import advantages as adv
from treejax.rl.advantages.registry import estimator_spec, list_estimators
from treejax.rl.allocation import (DARS, Budget, PromptStats, RolloutGDRO, XRPOAllocator, dars_extra, group_forest,
                                   group_leaves, plan_chunks, sqrt_rule, ungroup, xrpo_extra)
from treejax.testing.checkpoints import latest_data_state
from treejax.testing.forests import random_forest, random_rewards


# ----------------------------------------------------------------------------------------------------- DARS
def dars_reference(a: float, n: int, variant: str, std: bool) -> int:
    """DARS's schedule for one prompt, written from the paper / schedule_ET, schedule_HW (module docstring)."""
    if a == 0:
        a = 0.5 / n
    if a >= 0.5:
        return 0
    s = 2 * math.sqrt(a * (1 - a)) if std else 2 * a * (1 - a)
    peak = n if std else n / 2
    target = peak if variant == "et" else 2 * (1 - a) * peak
    return max(0, math.ceil((target - n * s) / s))


@pytest.mark.parametrize("variant", ["hw", "et"])
@pytest.mark.parametrize("std", [True, False])
def test_dars_matches_reference(variant, std):
    n = 8
    acc = np.array([k / n for k in range(n + 1)])
    got = dars_extra(acc, np.full(len(acc), n), variant, std)
    want = [dars_reference(float(a), n, variant, std) for a in acc]
    assert got.tolist() == want
    assert got[0] > got[1] > 0 and np.all(got[acc >= 0.5] == 0)
    if variant == "hw":  # harder prompts get more; HW >= ET
        assert np.all(got >= dars_extra(acc, np.full(len(acc), n), "et", std))


def test_dars_allocator_reads_stats():
    stats = PromptStats.from_leaves(correct_PxW=[[0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [1] * 8],
                                    rewards_PxW=np.zeros((3, 8)))
    extra, state = DARS("hw").extra_rollouts(stats, {}, Budget(100, 8, 64))
    assert extra.tolist() == [dars_reference(0.0, 8, "hw", False), dars_reference(0.125, 8, "hw", False), 0]
    # the official scripts' worked values (N = 8, no std): k = 0, 1, 2, 3 correct -> HW 56 / 24 / 8 / 3 (under
    # N_max = 64) and ET 24 / 11 / 3 / 1 (under N_max = 32)
    acc = np.array([0, 1, 2, 3]) / 8
    assert np.minimum(dars_extra(acc, np.full(4, 8), "hw", False), 56).tolist() == [56, 24, 8, 3]
    assert np.minimum(dars_extra(acc, np.full(4, 8), "et", False), 24).tolist() == [24, 11, 3, 1]
    assert state == {}


# ----------------------------------------------------------------------------------------------------- XRPO
def xrpo_reference(n, s, chunk, phases, alpha, lam, room):
    """One phase at a time, every prompt's priority written out per prompt."""
    from scipy.stats import t as student_t

    def h(k, sd):
        return student_t.ppf(1 - alpha / 2, k - 1) * sd / math.sqrt(k) if k >= 2 else math.inf

    n, room, extra, total = list(map(float, n)), list(map(float, room)), [0] * len(n), float(sum(n))
    for _ in range(phases):
        best, best_q = -math.inf, None
        for q in range(len(n)):
            if room[q] < chunk:
                continue
            shrink = h(n[q], s[q]) - h(n[q] + chunk, s[q])
            pr = (1e9 if math.isinf(shrink) else shrink) + lam * math.sqrt(math.log(1 + total) / n[q])
            if pr > best:
                best, best_q = pr, q
        if best_q is None:
            break
        extra[best_q] += chunk
        n[best_q] += chunk
        room[best_q] -= chunk
        total += chunk
    return extra


def test_xrpo_matches_reference_and_spends_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(5):
        n = np.full(7, 4)
        s = np.where(rng.random(7) < 0.3, 0.0, rng.random(7))
        room = rng.choice([0, 4, 8, 12], 7)
        got = xrpo_extra(n, s, 4, 6, 0.05, 0.1, room)
        want = xrpo_reference(n, s, 4, 6, 0.05, 0.1, room)
        assert got.tolist() == want
        assert got.sum() == min(24, sum(r // 4 * 4 for r in room)) and np.all(got <= room)


def test_xrpo_prefers_mixed_prompts_and_reaches_constant_ones_through_the_bonus():
    stats = PromptStats.from_leaves(correct_PxW=[[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]],
                                    rewards_PxW=[[1, -1, 1, -1], [1, 1, 1, 1], [-1, -1, -1, -1]])
    extra, _ = XRPOAllocator().extra_rollouts(stats, {}, Budget(4, 4, 16))
    assert extra.tolist() == [4, 0, 0]
    extra, _ = XRPOAllocator(lam=10.0).extra_rollouts(stats, {}, Budget(12, 4, 8))
    assert extra.tolist() == [4, 4, 4]  # each prompt's room is one chunk; the bonus spreads the budget


# ------------------------------------------------------------------------------------------------ GDRO
def test_sqrt_rule_closed_form_inside_the_box():
    q, v = np.array([3.0, 5.0, 2.0]), np.array([0.04, 0.25, 0.09])
    total = 10 * q.sum()
    got = sqrt_rule(q, v, total, 1.0, 1000.0)
    want = 10 * np.sqrt(v) / (q * np.sqrt(v)).sum() * q.sum()
    np.testing.assert_allclose(got, want, rtol=1e-9)
    boxed = sqrt_rule(q, v, total, 8.0, 12.0)
    assert np.all((boxed >= 8) & (boxed <= 12)) and abs((q * boxed).sum() - total) < 1e-6
    assert boxed[1] >= boxed[2] >= boxed[0]


def test_rollout_gdro_bins_history_and_budget():
    import json

    gdro = RolloutGDRO()
    state = gdro.init_state()
    acc = np.array([0.0, 0.125, 0.5, 0.5, 0.875, 1.0, 0.25, 0.375])
    stats = PromptStats(np.full(8, 8), acc, np.zeros(8), np.zeros(8), keys=tuple("abcdefgh"))
    extra, state = gdro.extra_rollouts(stats, state, Budget(64, 8, 32))
    json.dumps(state)  # saved in the checkpoint's JSON data state
    assert extra.sum() <= 64 + 8 * 4 and np.all(extra % 8 == 0)  # nearest chunks; the planner enforces the budget
    assert extra[0] == 0 and extra[5] == 0  # a(1 - a) = 0: no signal, no extra rollouts
    assert extra[2] >= extra[1] and extra[2] >= extra[4]  # the mixed prompts' bin gets the most
    assert state["passes"]["a"] == [0.0] and state["passes"]["c"] == [1.0]
    # history: "a" drawn again after a success now sits in the bin of its windowed pass rate (0.5)
    stats2 = PromptStats(np.full(1, 8), np.array([0.125]), np.zeros(1), np.zeros(1), keys=("a",))
    assert gdro.bins(stats2, state["passes"]).tolist() == [np.searchsorted(gdro.edges, 0.5, side="right")]


# ------------------------------------------------------------------------------------------------- planner
def test_plan_chunks_rounds_up_and_caps():
    got = plan_chunks(np.array([0, 1, 8, 9, 100]), np.zeros(5), num_leaves=8, max_chunks=3, budget_rows=100)
    assert got.tolist() == [0, 1, 1, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_plan_chunks_never_exceeds_the_budget(seed):
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, 40, 12)
    acc = rng.random(12)
    for budget in (0, 1, 3, 7, 50):
        got = plan_chunks(extra, acc, 4, 5, budget)
        want = np.minimum(-(-extra // 4), 5)
        assert got.sum() == min(budget, want.sum()) and np.all(got <= want) and np.all(got >= 0)


def test_plan_chunks_shares_a_tight_budget_by_unmet_request():
    # requests in rollouts 20, 20, 4 (W = 4): 5, 5, 1 chunks wanted, 4 granted -> 2, 2, 0 (largest unmet first)
    assert plan_chunks(np.array([20, 20, 4]), np.zeros(3), 4, 9, 4).tolist() == [2, 2, 0]
    # ties broken by the lower accuracy
    assert plan_chunks(np.array([8, 8]), np.array([0.4, 0.1]), 4, 9, 1).tolist() == [0, 1]


# ------------------------------------------------------------------------------------------------- groups
def _forest(seed=0, rows=6, W=4, D=3, S=2):
    rng = np.random.default_rng(seed)
    return random_forest(rng, rows, W, D, S), rng


def test_group_forest_of_one_chunk_is_the_forest():
    f, _ = _forest()
    g = group_forest(f, np.arange(6)[:, None])
    for name in ("node_parent", "node_depth", "node_status", "leaf_path", "leaf_length", "tokens", "loss_mask",
                 "segment_index", "logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(g, name)), np.asarray(getattr(f, name)), err_msg=name)


def test_group_forest_merges_trees_under_one_root_and_marks_unused_slots():
    f, _ = _forest()
    rows = np.array([[0, 3, -1], [1, -1, 5]])
    g = group_forest(f, rows)
    W, N = 4, f.node_parent.shape[1]
    path = np.asarray(g.leaf_path)
    assert np.all(path[0, 8:] == -1) and np.all(path[1, 4:8] == -1)
    assert np.all(np.asarray(g.loss_mask)[0, 8:] == 0) and np.all(np.asarray(g.leaf_weight)[0, 8:] == 0)
    assert np.all(path[:, :, 0][path[:, :, 0] != -1] == 0)
    parent = np.asarray(g.node_parent)
    # every used node's parent chain reaches the group's root 0
    for p in range(2):
        for n in np.nonzero(np.asarray(g.node_depth)[p] > 0)[0]:
            k = n
            while k != 0:
                k = parent[p, k]
                assert k >= 0
    # leaf tokens and node ids of chunk 1 of prompt 0 are row 3's, shifted by N
    np.testing.assert_array_equal(np.asarray(g.tokens)[0, W:2 * W], np.asarray(f.tokens)[3])
    src = np.asarray(f.leaf_path)[3]
    np.testing.assert_array_equal(path[0, W:2 * W], np.where(src > 0, src + N, src))
    # ungroup puts the values back; rows in no group (2, 4) get 0
    x = group_leaves(np.asarray(f.leaf_length, np.float32), rows)
    back = np.asarray(ungroup(x, rows, 6))
    for r in (0, 1, 3, 5):
        np.testing.assert_array_equal(back[r], np.asarray(f.leaf_length, np.float32)[r])
    assert np.all(back[[2, 4]] == 0)


RAGGED = [(n, o) for n, o in [
    ("grpo", adv.GRPOOptions()), ("grpo", adv.GRPOOptions(scale_by_std=False)), ("rloo", adv.RLOOOptions()),
    ("rloo", adv.RLOOOptions(baseline="other_subtrees")), ("reinforce_pp_baseline", adv.ReinforcePPBaselineOptions()),
    ("treepo", adv.TreePOOptions()), ("treepo", adv.TreePOOptions(weighting="group_size", reject_zero_std=True)),
    ("treepo_segment", adv.TreePOSegmentOptions()),
    ("treepo_segment", adv.TreePOSegmentOptions(node_value="child_mean")),
    ("spo_tree", adv.SPOTreeOptions()), ("remax", adv.ReMaxOptions()), ("slate", adv.SLATEOptions())]]


def test_ragged_flags():
    assert {n for n in list_estimators() if estimator_spec(n).ragged} == {n for n, _ in RAGGED}


@pytest.mark.parametrize("name,options", RAGGED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RAGGED)])
def test_unused_slots_change_nothing(name, options):
    """The same rollouts as full groups ([P, 2W], no unused slot) and with an unused chunk between and after them
    ([P, 4W]): identical advantages on every used leaf, 0 on the unused ones."""
    f, rng = _forest(seed=3)
    R = jnp.asarray(random_rewards(rng, (6, 4), "mixed"), jnp.float32)
    compact = np.array([[0, 1], [2, 3], [4, 5]])
    ragged = np.array([[0, -1, 1, -1], [-1, 2, 3, -1], [4, 5, -1, -1]])
    fn = adv.get_estimator(name)

    J = jnp.asarray(rng.uniform(size=(6, 4, f.leaf_path.shape[2] - 1)), jnp.float32)  # slate's step judge scores

    def inputs(rows):
        if name == "remax":
            return {"greedy_reward_P": R[jnp.asarray(rows).max(axis=1), 0]}
        return {"step_judge_PxWxD": group_leaves(J, rows)} if name == "slate" else {}

    def run(rows):
        kw = inputs(rows)
        out = jax.jit(lambda f, r, kw: fn(f, r, options, **kw))(group_forest(f, rows), group_leaves(R, rows), kw)
        return {k: None if v is None else np.asarray(ungroup(v, rows, 6)) for k, v in
                (("tokens", out.tokens), ("loss_mask", out.loss_mask), ("leaves", out.leaves))}

    a, b = run(compact), run(ragged)
    for k in a:
        if a[k] is not None:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-6, err_msg=k)
    g = group_forest(f, ragged)
    out = fn(g, group_leaves(R, ragged), options, **inputs(ragged))
    unused = np.asarray(g.leaf_path)[:, :, 0] < 0
    assert np.all(np.asarray(out.tokens)[unused] == 0) and np.all(np.asarray(out.loss_mask)[unused] == 0)


def test_traced_group_sizes_give_the_static_sizes_bits():
    """The ragged cores count the used slots at run time; on full groups they give the static-size formulas'
    exact bits (count_scaled_sum's reciprocal is the correctly rounded one, as scaled_sum's)."""
    from treejax.rl.advantages import flat

    rng = np.random.default_rng(4)
    for W in (3, 16):
        r = jnp.asarray(rng.normal(size=(5, W)), jnp.float32)
        used = jnp.ones((5, W), bool)
        for fn in (flat._mean_deviation, flat.rloo_core):
            np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(fn))(r, used)),
                                          np.asarray(jax.jit(jax.vmap(fn))(r)))
        path = jnp.zeros((5, W, 2), jnp.int32)
        for o in (adv.GRPOOptions(), adv.GRPOOptions(unbiased_std=False)):
            dev = jax.vmap(flat._mean_deviation)(r)
            var = jax.vmap(lambda d: flat.scaled_sum(flat.materialize(d * d), W - 1 if o.unbiased_std else W))(dev)
            static = dev * flat.materialize(1.0 / (jnp.sqrt(var) + o.eps))[:, None]
            np.testing.assert_array_equal(np.asarray(jax.vmap(lambda x, p: flat.grpo_core(x, o, p))(r, path)),
                                          np.asarray(static))


# ------------------------------------------------------------------------------------------ the source, resume
def _alloc_params(tiny_checkpoint, log_dir, *extra):
    return [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 1",
            "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
            "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2",
            "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0", "RunConfig.estimator = 'grpo'",
            "RunConfig.rollouts = [@AllocationConfig()]", "AllocationConfig.max_rollouts = 12",
            "AllocationConfig.extra_rows = 3", "AllocationConfig.call_prompts = 2", *extra]


def test_allocated_rollouts_hold_each_prompts_group(tiny_checkpoint, tmp_path):
    """The loop's source with DARS on a tiny random model (it solves nothing: every prompt asks for the most):
    2 prompts + 3 extra rows, decoded in calls of 2 rows; each extra row is its prompt's, unused rows train on
    nothing, and the learner's grouped estimator gives each prompt's advantages over its whole group."""
    import os

    from treejax import train
    from treejax.rl.setup import build_run

    cfg = train.parse([os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")],
                      _alloc_params(tiny_checkpoint, tmp_path / "run", "AllocationConfig.allocator = @DARS()"))
    r = build_run(cfg)
    ro = r.source.sample(r.learner.sampler_params(r.state.params), jax.random.key(0), 0)
    assert ro.num_rows == 5 and ro.main_rows == 2 and ro.groups_PxC.shape == (2, 3)
    extra = ro.groups_PxC[:, 1:]
    used = np.sort(extra[extra >= 0])
    assert used.tolist() == [2, 3, 4]  # the 3-row budget, shared by the largest unmet requests
    for p in range(2):
        for row in ro.groups_PxC[p][ro.groups_PxC[p] >= 0]:
            np.testing.assert_array_equal(ro.prompts_PxLp[row], ro.prompts_PxLp[p])
    assert ro.counters.rollout_calls == 1 + 2  # 3 extra rows in calls of 2
    assert ro.extra_metrics["alloc/extra_rows"] == 3 and ro.extra_metrics["alloc/unused_rows"] == 0
    assert ro.extra_metrics["alloc/rollouts_per_prompt_max"] == 12
    # the estimator over each whole group equals GRPO run on the merged groups directly
    R = jnp.asarray(np.random.default_rng(0).choice([-1.0, 1.0], (5, 4)), jnp.float32)
    got = r.learner.grouped_estimator(ro.forest, R, {}, jnp.asarray(ro.groups_PxC, jnp.int32))
    g = group_forest(ro.forest, ro.groups_PxC)
    want = adv.get_estimator("grpo")(g, group_leaves(R, ro.groups_PxC), adv.GRPOOptions())
    np.testing.assert_allclose(np.asarray(got.tokens), np.asarray(ungroup(want.tokens, ro.groups_PxC, 5)), atol=1e-6)
    assert r.source.state == {}


@pytest.mark.slow  # three short runs of the whole loop (~90 s)
def test_allocator_state_is_checkpointed_and_resumed(tiny_checkpoint, tmp_path):
    """Rollout-GDRO keeps per-prompt pass histories and bin EMAs: a run interrupted after step 1 and resumed saves
    and restores them, and ends where the uninterrupted run does (same history rows, same final state)."""
    import os

    from treejax import train

    gin = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")

    def main(log_dir, steps, *flags):
        params = _alloc_params(tiny_checkpoint, log_dir, "AllocationConfig.allocator = @RolloutGDRO()",
                               f"RunConfig.num_steps = {steps}", "RunConfig.checkpoint_every = 1",
                               "LossConfig.entropy_coef = 0.01", "OptimizerConfig.learning_rate = 1e-3")
        return train.main(["--gin_file", gin, "--quiet", *flags] + sum((["--gin_param", p] for p in params), []))

    straight = main(str(tmp_path / "straight"), 2)
    main(str(tmp_path / "resumed"), 1)
    saved = latest_data_state(tmp_path / "resumed")
    assert saved["allocation"]["passes"] and len(saved["allocation"]["v"]) == 7
    resumed = main(str(tmp_path / "resumed"), 2, "--resume")
    drop = lambda row: {k: v for k, v in row.items() if not k.startswith("time/") and not k.endswith("per_s")}  # noqa
    assert drop(resumed["history"][1]) == drop(straight["history"][1])
    resumed_state, straight_state = (latest_data_state(tmp_path / d) for d in ("resumed", "straight"))
    assert resumed_state["allocation"] == straight_state["allocation"]
