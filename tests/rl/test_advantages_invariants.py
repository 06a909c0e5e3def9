"""Invariants of the estimators: degenerate groups, permutations, telescoping, jit/vmap, worked example, registry."""

from __future__ import annotations

import dataclasses
import doctest
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import forest_from_paths
from treejax.rl import advantages as adv
from treejax.testing.forests import random_forest, random_rewards

ALL = [
    ("grpo", adv.GRPOOptions()),
    ("grpo", adv.GRPOOptions(scale_by_std=False)),
    ("rloo", adv.RLOOOptions()),
    ("reinforce_pp_baseline", adv.ReinforcePPBaselineOptions()),
    ("treepo", adv.TreePOOptions()),
    ("treepo", adv.TreePOOptions(weighting="group_size", reject_zero_std=True)),
    ("treepo_segment", adv.TreePOSegmentOptions()),
    ("treepo_segment", adv.TreePOSegmentOptions(node_value="child_mean", root_value="zero")),
    ("treepo_segment", adv.TreePOSegmentOptions(eta=0.8)),
    ("spo_tree", adv.SPOTreeOptions()),
    ("spo_tree", adv.SPOTreeOptions(normalize=True, prob_threshold=0.6)),
    ("mc_grpo", adv.MCGRPOOptions()),
    ("remax", adv.ReMaxOptions()),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(ALL)]


@functools.lru_cache(maxsize=None)
def _jitted(name, options):
    fn = adv.get_estimator(name)
    return jax.jit(lambda f, r, kw: fn(f, r, options, **kw))


def _call(name, options, forest, R, jit=False):
    """Op by op (``jit=False``) or through one cached jitted function per estimator case (reused across
    calls of the same shapes; bit-identical to op by op, see test_jit_equals_no_jit_exactly)."""
    kwargs = {"greedy_reward_P": jnp.asarray(R)[:, 0]} if name == "remax" else {}
    if jit:
        return _jitted(name, options)(forest, R, kwargs)
    return adv.get_estimator(name)(forest, R, options, **kwargs)


def _no_whiten(options):
    fields = {f.name for f in dataclasses.fields(options)}
    return dataclasses.replace(options, whiten=False) if "whiten" in fields else options


@pytest.mark.parametrize("name,options", ALL, ids=IDS)
@pytest.mark.parametrize("num_leaves", [1, 6])
def test_all_equal_rewards_give_exact_zeros(name, options, num_leaves):
    rng = np.random.default_rng(1)
    forest = random_forest(rng, 4, num_leaves, 3, 2)
    R = random_rewards(rng, (4, num_leaves), "equal")
    out = _call(name, options, forest, R)
    assert np.all(np.isfinite(np.asarray(out.tokens)))
    if getattr(options, "eta", 1.0) != 1.0 or getattr(options, "root_value", "mean") == "zero":
        return  # V(n) - eta^k V(parent) (or a zero root) is not 0 on equal non-zero rewards, by definition
    for value in (out.tokens, out.leaves, out.segments):
        if value is not None:
            assert np.all(np.asarray(value) == 0.0), name
    assert np.all(np.isfinite(np.asarray(out.tokens)))


@pytest.mark.parametrize("name,options", ALL, ids=IDS)
def test_w1_gives_zero_and_finite(name, options):
    rng = np.random.default_rng(2)
    forest = random_forest(rng, 3, 1, 3, 2)
    R = random_rewards(rng, (3, 1), "grid")
    out = _call(name, options, forest, R)
    assert np.all(np.isfinite(np.asarray(out.tokens)))
    if getattr(options, "eta", 1.0) != 1.0 or getattr(options, "root_value", "mean") == "zero":
        return
    if name != "remax":  # ReMax's baseline is the greedy reward, not the group
        assert np.all(np.asarray(out.tokens) == 0.0)


def _permute_leaves(forest, perm):
    leaf_fields = ["leaf_path", "leaf_status", "leaf_length", "tokens", "logprobs", "segment_index", "loss_mask"]
    return forest.replace(**{k: getattr(forest, k)[:, perm] for k in leaf_fields})


@pytest.mark.parametrize("name,options", ALL, ids=IDS)
def test_permuting_leaves_permutes_advantages(name, options):
    rng = np.random.default_rng(3)
    forest = random_forest(rng, 3, 7, 3, 2)
    R = random_rewards(rng, (3, 7), "mixed")
    perm = rng.permutation(7)
    base = _call(name, options, forest, R, jit=True)
    permuted = _call(name, options, _permute_leaves(forest, perm), R[:, perm], jit=True)
    np.testing.assert_allclose(np.asarray(permuted.tokens), np.asarray(base.tokens)[:, perm], rtol=1e-6, atol=1e-6)
    if name != "mc_grpo":  # the pivot among tied rewards is chosen by index; its tokens are 0 either way
        np.testing.assert_array_equal(np.asarray(permuted.loss_mask), np.asarray(base.loss_mask)[:, perm])


@pytest.mark.parametrize("weighting", ["average", "group_size"])
def test_depth1_treepo_equals_reinforce_pp_baseline(weighting):
    rng = np.random.default_rng(4)
    for _ in range(5):
        forest = random_forest(rng, 4, 6, 1, 4)
        R = random_rewards(rng, (4, 6), "mixed")
        a = adv.treepo(forest, R, adv.TreePOOptions(weighting=weighting)).tokens
        b = adv.reinforce_pp_baseline(forest, R).tokens
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_treepo_segment_telescopes_to_reward_minus_root_value():
    rng = np.random.default_rng(5)
    for _ in range(10):
        forest = random_forest(rng, 3, 6, 4, 2, stop_prob=0.5)
        R = random_rewards(rng, (3, 6), "grid")
        seg = np.asarray(adv.treepo_segment(forest, R, adv.TreePOSegmentOptions(whiten=False)).segments)
        expected = R - R.mean(axis=1, keepdims=True)
        np.testing.assert_allclose(seg.sum(-1), expected, rtol=1e-6, atol=1e-6)


def test_treepo_worked_example_and_doctest():
    paths = np.array([[[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]])
    forest = forest_from_paths(paths, np.full((1, 4), 2), 1)
    R = np.array([[1.0, 1.0, 0.0, 1.0]], np.float32)
    raw = adv.treepo(forest, R, adv.TreePOOptions(whiten=False)).leaves
    np.testing.assert_allclose(np.asarray(raw), [[0.125, 0.125, -0.625, 0.375]], atol=1e-7)
    sized = adv.treepo(forest, R, adv.TreePOOptions(weighting="group_size", whiten=False)).leaves
    np.testing.assert_allclose(np.asarray(sized), [[1 / 6, 1 / 6, -2 / 3, 1 / 3]], atol=1e-7)
    var = 2 * (2 * 0.125**2 + 0.625**2 + 0.375**2) / 7
    white = adv.treepo(forest, R).leaves
    np.testing.assert_allclose(np.asarray(white), np.asarray(raw) / np.sqrt(var + 1e-8), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(white), [[0.31180, 0.31180, -1.55902, 0.93541]], atol=1e-5)
    module = importlib.import_module("treejax.rl.advantages.tree")
    result = doctest.testmod(module)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("name,options", ALL, ids=IDS)
def test_jit_equals_no_jit_exactly(name, options):
    """Bit-identical with and without jit, on discrete and on continuous rewards (where every product and sum
    rounds, so a reassociated reduction or a fused multiply-add under jit would show)."""
    rng = np.random.default_rng(6)
    for kind in ("mixed", "uniform", "uniform"):
        forest = random_forest(rng, 3, 6, 3, 2)
        R = random_rewards(rng, (3, 6), kind)
        a = _call(name, options, forest, R)
        b = _call(name, options, forest, R, jit=True)
        np.testing.assert_array_equal(np.asarray(a.loss_mask), np.asarray(b.loss_mask))
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        for x, y in ((a.leaves, b.leaves), (a.segments, b.segments)):
            if x is not None:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name,options", ALL, ids=IDS)
def test_batched_prompts_equal_loop_over_prompts(name, options):
    """Per-prompt work is vmapped: without the batch-global whitening, P prompts at once == one at a time."""
    rng = np.random.default_rng(7)
    forest = random_forest(rng, 4, 5, 3, 2)
    R = random_rewards(rng, (4, 5), "mixed")
    options = _no_whiten(options)
    batched = _call(name, options, forest, R, jit=True)
    for p in range(4):
        single = jax.tree.map(lambda x: x[p : p + 1], forest)
        one = _call(name, options, single, R[p : p + 1], jit=True)
        np.testing.assert_allclose(np.asarray(one.tokens)[0], np.asarray(batched.tokens)[p], rtol=1e-6, atol=1e-7)


def test_vmapped_cores_equal_loop():
    from treejax.rl.advantages.tree import treepo_core, treepo_segment_core

    rng = np.random.default_rng(8)
    forest = random_forest(rng, 4, 6, 3, 2)
    R = jnp.asarray(random_rewards(rng, (4, 6), "mixed"))
    n = forest.node_parent.shape[1]
    o1, o2 = adv.TreePOOptions(), adv.TreePOSegmentOptions()
    v1 = jax.vmap(lambda p, r: treepo_core(p, r, o1))(forest.leaf_path, R)
    v2 = jax.vmap(lambda p, r: treepo_segment_core(p, r, n, o2))(forest.leaf_path, R)
    for p in range(4):
        np.testing.assert_array_equal(np.asarray(treepo_core(forest.leaf_path[p], R[p], o1)), np.asarray(v1[p]))
        np.testing.assert_array_equal(
            np.asarray(treepo_segment_core(forest.leaf_path[p], R[p], n, o2)), np.asarray(v2[p])
        )


def test_tokens_zero_where_loss_mask_zero():
    rng = np.random.default_rng(9)
    forest = random_forest(rng, 3, 6, 3, 3)
    R = random_rewards(rng, (3, 6), "grid")
    for name, options in ALL:
        out = _call(name, options, forest, R, jit=True)  # jitted: op by op is bit-identical and 10x slower
        assert np.all(np.asarray(out.tokens)[np.asarray(out.loss_mask) == 0] == 0.0), name
        assert np.all(np.asarray(out.loss_mask) <= np.asarray(forest.loss_mask)), name


def test_mc_grpo_pivot_is_lower_median_and_excluded():
    forest = forest_from_paths(np.zeros((1, 5, 2), np.int64) + np.array([0, 1])[None, None] * 0
                               + np.stack([np.zeros(5), np.arange(1, 6)], -1)[None].astype(np.int64),
                               np.full((1, 5), 1), 1)
    R = np.array([[1.0, 0.0, 1.0, 0.0, 1.0]], np.float32)  # sorted: 0(1) 0(3) 1(0) 1(2) 1(4) -> pivot leaf 0
    out = adv.mc_grpo(forest, R)
    assert np.asarray(out.loss_mask)[0, 0].sum() == 0 and np.asarray(out.loss_mask)[0, 1:].sum() == 4
    # med = 1, MAD = sorted(|R - 1|) = [0,0,0,1,1][2] = 0 -> std fallback (population std 0.4899)
    np.testing.assert_allclose(np.asarray(out.leaves)[0], [0, -1 / (0.4898979 + 1e-6), 0, -1 / (0.4898979 + 1e-6), 0],
                               rtol=1e-5)


def test_registry_errors():
    assert {"grpo", "rloo", "reinforce_pp_baseline", "treepo", "treepo_segment", "spo_tree", "mc_grpo",
            "remax"} <= set(adv.list_estimators())
    with pytest.raises(KeyError, match="valid names.*treepo"):
        adv.get_estimator("tree_po")
    with pytest.raises(ValueError, match="already registered"):
        adv.register_estimator("treepo", adv.TreePOOptions)(lambda f, r, o: None)

    @dataclasses.dataclass
    class Mutable:
        x: int = 0

    with pytest.raises(TypeError, match="frozen"):
        adv.register_estimator("bad", Mutable)
    assert adv.estimator_spec("remax").inputs == ("greedy_reward_P",)
    with pytest.raises(ValueError, match="weighting"):
        adv.TreePOOptions(weighting="mean")


def test_shape_errors_name_the_input():
    rng = np.random.default_rng(10)
    forest = random_forest(rng, 2, 4, 2, 2)
    with pytest.raises(ValueError, match="rewards_PxW"):
        adv.treepo(forest, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="greedy_reward_P"):
        adv.remax(forest, np.zeros((2, 4), np.float32), greedy_reward_P=np.zeros(3, np.float32))
