"""The tree-packed update (``treejax.rl.packing`` + ``update.make_grad_fn`` of the ``Packed`` layout) against the
expanded one (``treejax.rl.batch.forest_to_batch``, the ``Expanded`` layout): same loss, metrics and gradients on forests sampled by the tree sampler.

Forest: a tiny Qwen2-family model (weights x8 so the sampler's distribution is peaked and varied) rolled out with
stop tokens and a maximum response length that ends leaves inside a segment, with a key whose rollout forks and
falls back (asserted), plus one dynamic-sampling filler prompt (a copy of prompt 0 with its loss mask zeroed, as
``treejax.rl.loop`` builds it): EOS, truncated and fallback leaves, and a tree the packed batch leaves out.

Tolerance: fp32 (``highest`` matmul precision on a GPU, tests/conftest.py). Loss and metrics ``rtol=1e-5``;
gradients relative to their norm, ``|g_packed - g| <= 1e-5 |g|`` for every parameter. The two layouts run the same
math on the same tokens; they differ only in the order of fp32 sums (attention over a longer row with exact-zero
masked terms, a different micro-batch composition), measured at ~4e-7 relative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from treejax.forest import NodeStatus
from treejax.models import presets
from treejax.models import transformer as T
from treejax.models.tree_attention import tree_mask
from treejax.parallel.mesh import MeshConfig, batch_sharding, jit_update, logical_to_sharding, make_mesh
from treejax.parallel.mesh import train_state_shardings
from treejax.rl import losses, packing
from treejax.rl.advantages import estimator_spec
from treejax.rl.batch import TreeInputs, expanded_batch, forest_to_batch, response_to_sequence
from treejax.rl.layouts import Expanded, Packed
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_grad_fn, make_update_fn
from treejax.sampling import strategies as S
from treejax.sampling import tree

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
TC = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=tuple(range(3, 30)),
                     strategy=S.Temperature(1.0), max_response_length=10, row_buckets=1)
PROMPTS = np.random.RandomState(1).randint(60, 250, (3, 6)).astype(np.int32)
LENGTHS = np.array([6, 3, 5], np.int32)
TREE_KEY = jax.random.key(8)  # forks, one fallback, EOS and truncated leaves with this draw (asserted)
ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "treepo", "treepo_segment", "spo_tree", "mc_grpo", "remax")
SMALL_ROWS = packing.PackingConfig(granule=8)
EXPANDED = Expanded(CFG, attention_impl="xla")
PACKED = Packed(CFG, dataclasses.replace(SMALL_ROWS, attention_impl="xla"))


def _grad_fn(loss_cfg, num_micro_batches=1):
    """One jitted gradient function per layout; the returned function picks the batch's."""
    fns = {lay: jax.jit(make_grad_fn(lay, loss_cfg, num_micro_batches=num_micro_batches)) for lay in (EXPANDED, PACKED)}
    return lambda params, b: fns[PACKED if isinstance(b.inputs, TreeInputs) else EXPANDED](params, b)


@pytest.fixture(scope="module")
def sampled():
    """``(prompts, lengths, forest)`` of 4 prompts: 3 sampled trees and a filler copy of the first (masked out)."""
    params = T.init_params(CFG, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)
    forest, info = tree.make_tree_rollout(CFG, TC)(params, PROMPTS, LENGTHS, TREE_KEY)
    status = np.asarray(forest.leaf_status)
    assert int(info.forks) > 0 and int(info.fallbacks) > 0
    assert np.any(status == NodeStatus.EOS) and np.any(status == NodeStatus.TRUNCATED)
    filler = jax.tree.map(lambda x: x[:1], forest)
    filler = filler.replace(loss_mask=jnp.zeros_like(filler.loss_mask))
    forest = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), forest, filler)
    return np.concatenate([PROMPTS, PROMPTS[:1]]), np.concatenate([LENGTHS, LENGTHS[:1]]), forest


@pytest.fixture(scope="module")
def policy_params():
    return T.init_params(CFG, jax.random.key(1))


def _inputs(forest, estimator: str, seed: int = 0):
    """Advantages of ``estimator`` on random rewards, plus per-pair old / reference / sampler log-probs that
    differ from each other (so every ratio, KL and TIS term is active) and a per-leaf clip scale."""
    P, W, Tr = forest.tokens.shape
    rng = np.random.default_rng(seed)
    rewards = jnp.asarray(rng.integers(0, 2, (P, W)).astype(np.float32))
    spec = estimator_spec(estimator)
    extra = {"greedy_reward_P": jnp.asarray(rng.random(P), jnp.float32)} if "greedy_reward_P" in spec.inputs else {}
    adv = spec.fn(forest, rewards, spec.default_options(), **extra)
    sampler = np.asarray(forest.logprobs)
    noise = lambda s: (sampler + rng.normal(0, s, sampler.shape)).astype(np.float32)  # noqa: E731
    return adv, noise(0.3), noise(0.2), noise(0.1), rng.uniform(0.5, 2.0, (P, W)).astype(np.float32)


def _both_batches(prompts, lens, forest, estimator, config=SMALL_ROWS, row_multiple=1):
    """The expanded dict batch and the packed batch of the same leaves and per-pair inputs."""
    adv, old, ref, smp, eps = _inputs(forest, estimator)
    P, W, Tr = forest.tokens.shape
    batch = forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv.tokens, adv.loss_mask,
                            eps_scale_PxW=jnp.asarray(eps))
    L = batch["tokens"].shape[1]
    for k, v in (("old_logp", old), ("ref_logp", ref), ("sampler_logp", smp)):
        batch[k] = response_to_sequence(jnp.asarray(v), jnp.asarray(lens), L)
    packed = packing.forest_to_packed(prompts, lens, forest, adv.tokens, adv.loss_mask, eps_scale_PxW=eps,
                                      config=config, row_multiple=row_multiple)
    flat = lambda x: jnp.asarray(x).reshape(P * W, Tr)  # noqa: E731
    packed = packed.replace(old_logp=packing.pack_pairs(packed.inputs, flat(old)),
                            ref_logp=packing.pack_pairs(packed.inputs, flat(ref)),
                            sampler_logp=packing.pack_pairs(packed.inputs, flat(smp)))
    return expanded_batch(batch), packed


def _assert_grads_close(g_packed, g_ref, rtol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_packed), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err, norm = np.linalg.norm(a - b), np.linalg.norm(b)
        assert err <= rtol * norm + 1e-12, (jax.tree_util.keystr(path), err, norm)


def _assert_steps_close(new_packed, new_ref, old, rtol=1e-5):
    """Two optimizer steps from ``old`` agree: ``|p - p_ref| <= rtol |p_ref - old| + 2 ulp |old|`` per parameter
    (the second term is the fp32 rounding of ``old + delta``, e.g. 1.2e-7 on a norm weight of 1)."""
    for (path, a), b, o in zip(jax.tree_util.tree_leaves_with_path(new_packed), jax.tree.leaves(new_ref),
                               jax.tree.leaves(old)):
        a, b, o = (np.asarray(x, np.float64) for x in (a, b, o))
        err, step = np.linalg.norm(a - b), np.linalg.norm(b - o)
        assert err <= rtol * step + 2 * 2.0 ** -23 * np.linalg.norm(o), (jax.tree_util.keystr(path), err, step)


# ----------------------------------------------------------------------------------------------- the layout
def test_layout_on_a_hand_built_forest():
    """Prompt, then nodes in preorder; positions by depth; predictors; preorder intervals; the gather map."""
    from treejax.forest import forest_from_paths

    paths = np.array([[[0, 1, 2], [0, 1, 3], [0, 4, -1]]])
    tok = np.random.RandomState(0).randint(3, 200, (1, 3, 8))
    tok[0, 1, :4] = tok[0, 0, :4]  # leaves 0 and 1 share node 1
    forest = forest_from_paths(paths, np.array([[8, 7, 3]]), 4, tokens=tok)
    plan = packing.plan_packing(np.array([[5, 6, 7]]), np.array([3]), forest.leaf_path, forest.leaf_length,
                                forest.tokens, 4, packing.PackingConfig(granule=8))
    n = 3 + 4 + 4 + 3 + 3  # prompt, node 1, node 2, node 3 (3 tokens), node 4 (3 tokens)
    assert plan.shape == (1, 24, 3) and plan.unique_tokens == n and plan.expanded_tokens == 3 * 3 + 18
    np.testing.assert_array_equal(plan.tokens[0, :n], np.concatenate([[5, 6, 7], tok[0, 0], tok[0, 1, 4:7],
                                                                      tok[0, 2, :3]]))
    np.testing.assert_array_equal(plan.positions[0, :n], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 7, 8, 9, 3, 4, 5])
    np.testing.assert_array_equal(plan.prev[0, :n], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 11, 12, 2, 14, 15])
    np.testing.assert_array_equal(plan.node_lo[0, :n], [0] * 3 + [1] * 4 + [2] * 4 + [3] * 3 + [4] * 3)
    np.testing.assert_array_equal(plan.node_hi[0, :n], [4] * 3 + [3] * 4 + [2] * 4 + [3] * 3 + [4] * 3)
    L = plan.shape[1]
    np.testing.assert_array_equal(plan.node_lo[0, n:], packing.PAD_NODE + np.arange(n, L))  # each pad its own node
    np.testing.assert_array_equal(plan.node_hi[0, n:], plan.node_lo[0, n:])
    assert np.all(plan.tokens[0, n:] == 0)
    np.testing.assert_array_equal(plan.pair_index[0, :3], [[3, 4, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 11, 12, 13, 0],
                                                           [14, 15, 16, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(plan.leaf_id[0], [0, 1, 2])


def _reference_visible(prompt_idx, pair_idx_WxT, valid_WxT, w, t):
    """Row indices a leaf's response token t may attend to: its prompt and its own tokens up to t."""
    return set(prompt_idx) | set(pair_idx_WxT[w, : t + 1][valid_WxT[w, : t + 1]])


@pytest.mark.parametrize("align", [1, 4])
def test_tree_mask_and_predictors_match_the_expanded_rows(sampled, align):
    """For every (leaf, token) pair: the packed token, position and predictor are those of the expanded row, and
    the packed mask row is exactly {the prompt} + {the leaf's tokens up to it} (a token sees nothing else), also
    with the prompt and every node padded to a multiple of ``align`` tokens."""
    prompts, lens, forest = sampled
    P, W, Tr = forest.tokens.shape
    pairs = packing.forest_pairs(forest, jnp.zeros(forest.tokens.shape))
    trained = np.asarray(pairs["loss_mask"]).reshape(P, W, Tr).max(-1) > 0
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, TC.segment_length,
                                dataclasses.replace(SMALL_ROWS, align=align), trained_PxW=trained)
    mask = np.asarray(tree_mask(jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)))
    tokens, length = np.asarray(forest.tokens), np.asarray(forest.leaf_length)
    seen = set()
    for r in range(plan.shape[0]):
        for s in range(plan.shape[2]):
            b = plan.leaf_id[r, s]
            if b < 0:
                continue
            p, w = divmod(int(b), W)
            seen.add(p)
            idx, valid = plan.pair_index[r, s], plan.pair_valid[r, s]
            assert valid.sum() == length[p, w]
            lo0 = plan.node_lo[r, idx[0]]  # the root's tokens: the only ones before the response positions whose
            prompt_idx = np.nonzero((plan.node_lo[r] <= lo0) & (lo0 <= plan.node_hi[r])  # subtree holds the leaf
                                    & (plan.positions[r] < lens[p]))[0]
            assert len(prompt_idx) == lens[p]
            np.testing.assert_array_equal(plan.tokens[r, prompt_idx], prompts[p, : lens[p]])
            for t in range(length[p, w]):
                i = idx[t]
                assert plan.tokens[r, i] == tokens[p, w, t] and plan.positions[r, i] == lens[p] + t
                assert plan.prev[r, i] == (idx[t - 1] if t else prompt_idx[-1])
                assert set(np.nonzero(mask[r, i])[0]) == _reference_visible(prompt_idx, plan.pair_index[r],
                                                                            plan.pair_valid[r], s, t)
    assert seen == {0, 1, 2}  # the filler prompt 3 is not packed
    assert plan.num_sequences == P * W and plan.unique_tokens < plan.expanded_tokens


def test_packing_rejects_inconsistent_forests(sampled):
    prompts, lens, forest = sampled
    bad = np.asarray(forest.tokens).copy()
    path = np.asarray(forest.leaf_path)
    p, w0, w1 = [(p, a, b) for p in range(3) for a in range(4) for b in range(a + 1, 4)
                 if path[p, a, 1] == path[p, b, 1]][0]  # two leaves sharing their depth-1 node
    bad[p, w1, 0] = bad[p, w0, 0] + 1
    with pytest.raises(ValueError, match="disagree on its token"):
        packing.plan_packing(prompts, lens, path, forest.leaf_length, bad, TC.segment_length)
    with pytest.raises(ValueError, match="does not fit PackingConfig.row_length=8"):
        packing.plan_packing(prompts, lens, path, forest.leaf_length, forest.tokens, TC.segment_length,
                             packing.PackingConfig(row_length=8))


def test_bucketing():
    assert [packing.bucket_units(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25)] == [1, 2, 3, 4, 6, 6, 8, 12, 16,
                                                                                         24, 32]
    assert packing.bucket_row_length(15424, 128) == 16384 and packing.bucket_row_length(3000, 128) == 3072


# ----------------------------------------------------------------------------------------------- loss and gradients
CASES = {  # aggregation -> (loss config, micro-batches)
    "token-mean": (losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_coef=0.05, kl_estimator="k3",
                                     entropy_coef=0.01, tis_cap=1.5), 1),
    "seq-mean-token-mean": (losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0,
                                              aggregation="seq-mean-token-mean", kl_coef=0.05, kl_estimator="k1",
                                              entropy_coef=0.01, tis_cap=1.5), 2),
    "seq-mean-token-sum-norm": (losses.LossConfig(eps_low=0.2, eps_high=0.28, aggregation="seq-mean-token-sum-norm",
                                                  kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5), 1),
}
METRICS = ("loss", "pg_loss", "num_tokens", "entropy", "kl", "tis_weight_mean", "tis_clip_frac", "clip_frac_low",
           "clip_frac_high", "clip_frac_dual", "approx_kl", "ratio_mean", "ratio_max", "ratio_min")


@pytest.fixture(scope="module")
def estimator_batches(sampled):
    """``{estimator: (expanded batch, packed batch)}`` (rows a multiple of 2, for 2 micro-batches)."""
    prompts, lens, forest = sampled
    return {name: _both_batches(prompts, lens, forest, name, row_multiple=2) for name in ESTIMATORS}


@pytest.mark.parametrize("aggregation", [pytest.param(a, marks=pytest.mark.slow) if a == "seq-mean-token-sum-norm" else a
                                         for a in CASES])  # the aggregations' math: tests/rl/test_losses.py
def test_packed_loss_and_gradients_equal_expanded(aggregation, estimator_batches, policy_params):
    """Every built-in estimator (segment-level ones included) x one aggregation, with KL, TIS, entropy,
    dual-clip and per-sample clip scales on: loss, metrics and gradients of the packed batch equal the expanded
    batch's (one compiled program per layout, shared by the estimators)."""
    loss_cfg, micro = CASES[aggregation]
    grad_fn = _grad_fn(loss_cfg, num_micro_batches=micro)
    for name, (batch, packed) in estimator_batches.items():
        assert packed.num_rows % micro == 0
        loss, metrics, grads = grad_fn(policy_params, batch)
        ploss, pmetrics, pgrads = grad_fn(policy_params, packed)
        assert float(metrics["num_tokens"]) > 0 and float(optax.tree.norm(grads)) > 0, name
        metrics = dict(metrics, loss=loss)
        pmetrics = dict(pmetrics, loss=ploss)
        for k in METRICS:
            np.testing.assert_allclose(float(pmetrics[k]), float(metrics[k]), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {k}")
        _assert_grads_close(pgrads, grads)


@pytest.mark.devices(8)
def test_packed_update_on_8_devices_equals_expanded_on_one(sampled, policy_params):
    """The packed update jitted with mesh shardings (rows over data x fsdp, params over fsdp x tensor) on 8 fake
    devices gives the expanded update's step on one device (treepo_segment, token-mean, KL + TIS on)."""
    loss_cfg, _ = CASES["token-mean"]
    prompts, lens, forest = sampled
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0, weight_decay=0.1))
    batch, packed = _both_batches(prompts, lens, forest, "treepo_segment",
                                  config=dataclasses.replace(SMALL_ROWS, max_trees_per_row=1), row_multiple=4)
    assert packed.num_rows == 4
    state = TrainState.create(policy_params, opt)
    ref_state, ref_m = jax.jit(make_update_fn(EXPANDED, loss_cfg, opt))(state, batch)

    mesh = make_mesh(MeshConfig(2, 2, 2), devices=jax.devices()[:8])
    param_sh = logical_to_sharding(T.param_logical_axes(CFG), mesh, shapes=policy_params)
    state_sh = train_state_shardings(jax.eval_shape(lambda: state), param_sh, opt, mesh)
    sh = batch_sharding(mesh, packed)
    assert sh.inputs.tokens.spec[0] == ("data", "fsdp")
    update = jit_update(make_update_fn(PACKED, loss_cfg, opt), state_sh, sh, mesh)
    host_params = jax.device_get(policy_params)
    new_state, m = update(jax.device_put(jax.tree.map(jnp.copy, state), state_sh), jax.device_put(packed, sh))
    for k in ("loss", "pg_loss", "grad_norm", "kl", "entropy", "num_tokens", "tis_weight_mean"):
        np.testing.assert_allclose(float(m[k]), float(ref_m[k]), rtol=1e-5, err_msg=k)
    _assert_steps_close(jax.device_get(new_state.params), jax.device_get(ref_state.params), host_params)


# ----------------------------------------------------------------------------------------------- the RL step
@pytest.mark.parametrize("shaped", [pytest.param(False, marks=pytest.mark.slow), True])  # True covers False's path
def test_rl_step_packed_equals_expanded(policy_params, shaped):
    """``StepConfig.packing`` through :func:`treejax.rl.step.rl_step`: the same rollout, old / reference log-prob
    passes and update as the expanded step (one mini-batch, 2 micro-batches, KL + TIS): equal metrics and
    parameters, the first PPO ratio 1. ``shaped``: with every built-in shaper on the trainer pass's statistics
    (entropy, top-k log-probs, reference log-probs), which the two layouts compute over different rows."""
    from treejax.rl.shaping import EchoShaping, EntropyAdvantageReshaping, ProcessRewardShaping, RoseLengthPenalty
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import make_layout
    from treejax.rl.step import initial_reference, make_learner, rl_step
    from treejax.testing.sources import FixedPromptRollouts

    loss_cfg = losses.LossConfig(eps_high=0.28, kl_coef=0.05, tis_cap=1.5, entropy_coef=0.01)
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0))
    source = FixedPromptRollouts(tree.make_tree_rollout(CFG, TC), PROMPTS, LENGTHS,
                                 lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
    out = {}
    for packed in (False, True):
        # ECHO's clip only: its shaping whitens the entropies, whose spread on a random tiny model is tiny (all
        # near log V), so the ulp-level differences of the two layouts' forwards grow by 1 / std(H) (measured:
        # 6e-6 in the score); its shaping is checked against a reference in tests/rl/test_shaping.py
        shapers = ((EntropyAdvantageReshaping(), EchoShaping(shaping=False), RoseLengthPenalty(),
                    ProcessRewardShaping(eta=2.0, step_length=3)) if shaped else ())
        cfg = StepConfig(estimator="treepo_segment", loss=loss_cfg, micro_batches=2, row_multiple=2,
                         packing=dataclasses.replace(SMALL_ROWS, attention_impl="xla") if packed else None,
                         attention_impl="xla", shapers=shapers)
        layout = make_layout(CFG, cfg.packing, attention_impl="xla", row_multiple=2)
        update = jax.jit(make_update_fn(layout, loss_cfg, opt, num_micro_batches=2))
        fns = make_learner(CFG, cfg, Precision().resolve("cpu"), update, layout)
        state = TrainState.create(jax.tree.map(jnp.copy, policy_params), opt)
        state, _, m, _ = rl_step(fns, state, source, jax.random.key(8), 0, initial_reference(state.params, loss_cfg))
        out[packed] = jax.device_get((state.params, m))
    (p0, m0), (p1, m1) = out[False], out[True]
    assert abs(m1["update/first_ratio_min"] - 1) < 1e-5 and abs(m1["update/first_ratio_max"] - 1) < 1e-5
    keys = ["update/loss", "update/pg_loss", "update/grad_norm", "update/entropy", "update/kl",
            "update/tis_weight_mean", "update/num_tokens", "mismatch/abs_mean", "mismatch/abs_max"]
    if shaped:
        keys += [k for k in m0 if k.startswith("shaping/")]
        assert "shaping/echo/eps_mean" in m0 and "shaping/prl/kl_to_go_mean" in m0 and "shaping/ear/scale_mean" in m0
        assert m0["shaping/adv_abs_mean_after"] != m0["shaping/adv_abs_mean_before"]
    assert set(keys) <= set(m1)
    for k in keys:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)
    _assert_steps_close(p1, p0, jax.device_get(policy_params))


# ----------------------------------------------------------------------------------------------- sticky layouts
def test_sticky_layout_only_grows_and_keeps_the_loss(sampled, policy_params):
    """A sticky run (``LayoutFloor``) packs every mini-batch into the largest layout met so far: shapes never
    shrink, a mini-batch that fits reuses the layout exactly, and the loss and gradients on the padded layout are
    the expanded batch's."""
    prompts, lens, forest = sampled
    P, W, Tr = forest.tokens.shape
    adv, old, ref, smp, eps = _inputs(forest, "treepo")
    pairs = packing.forest_pairs(forest, adv.tokens, adv.loss_mask)
    args = (prompts, lens, np.asarray(forest.leaf_path), np.asarray(forest.leaf_length), np.asarray(forest.tokens),
            TC.segment_length, SMALL_ROWS)
    subsets = [[1], [0, 1, 2], [2], [1], [0]]
    plain = [packing.plan_packing(*args, prompts=s).shape for s in subsets]
    assert len(set(plain)) >= 3  # without a floor the layout follows each mini-batch
    floor = packing.LayoutFloor()
    shapes = []
    for s in subsets:
        pl = packing.plan_packing(*args, prompts=s, floor=floor.shape)
        floor.grow(pl.shape)
        shapes.append(pl.shape)
    assert all(all(b >= a for a, b in zip(x, y)) for x, y in zip(shapes, shapes[1:]))  # grow-only
    assert shapes[2:] == [shapes[1]] * 3 and len(floor.layouts) == 2
    # the loss on a mini-batch padded into the floor's layout equals the expanded batch's on the same leaves
    keep = np.zeros((P, W), bool)
    keep[2] = True
    mask = adv.loss_mask * jnp.asarray(keep[:, :, None], adv.loss_mask.dtype)
    batch = forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv.tokens, mask)
    batch["old_logp"] = response_to_sequence(jnp.asarray(old), jnp.asarray(lens), batch["tokens"].shape[1])
    batch = expanded_batch(batch)
    pl = packing.plan_packing(*args, prompts=[2], floor=floor.shape)
    assert pl.shape == floor.shape and pl.shape != plain[2]
    packed = packing.packed_batch(pl, dict(pairs, loss_mask=mask.reshape(P * W, Tr),
                                           old_logp=jnp.asarray(old).reshape(P * W, Tr)), None)
    packed = packed.replace(num_sequences=P * W)  # the expanded batch above holds every prompt's leaves
    grad_fn = _grad_fn(losses.LossConfig())
    loss, _, grads = grad_fn(policy_params, batch)
    ploss, _, pgrads = grad_fn(policy_params, packed)
    np.testing.assert_allclose(float(ploss), float(loss), rtol=1e-5)
    _assert_grads_close(pgrads, grads)


# ----------------------------------------------------------------------------------------------- slot trees
@pytest.mark.parametrize("align", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_startup_layout_holds_every_tree_and_never_changes(sampled, align):
    """A sticky ``Packed`` layout is fixed at the first mini-batch from the config's bounds: the bound holds every
    sampled tree (alone, aligned or not), every later mini-batch of the run gets the same layout (one compile),
    and with two rows the trees are spread over both (balanced micro-batches / devices)."""
    import types

    prompts, lens, forest = sampled
    P, W, Tr = forest.tokens.shape
    N = forest.node_parent.shape[1]
    cfg = dataclasses.replace(SMALL_ROWS, align=align, attention_impl="xla")
    bound = packing.tree_token_bound(prompts.shape[1], W, Tr, N, TC.segment_length, align)
    args = (prompts, lens, np.asarray(forest.leaf_path), np.asarray(forest.leaf_length), np.asarray(forest.tokens),
            TC.segment_length, dataclasses.replace(cfg, skip_untrained=False))
    alone = [int(packing.plan_packing(*args, prompts=[p]).positions.shape[1]) for p in range(P)]
    sizes = [int(packing.plan_packing(*args, prompts=[p]).unique_tokens) for p in range(P)]
    assert max(sizes) <= bound and max(alone) >= max(sizes)
    assert packing.tree_token_bound(6, 4, 10, 9, 4) == 6 + min(40, 32)
    assert packing.tree_token_bound(6, 4, 10, 9, 4, align=3) == 6 + 32 + 8 * 2
    ro = types.SimpleNamespace(forest=forest, prompts_PxLp=prompts, lengths_P=lens)
    adv, *_ = _inputs(forest, "treepo")
    for row_multiple in (1, 2):
        layout = Packed(CFG, cfg, row_multiple=row_multiple)
        pool = layout.pool(ro, adv.tokens, adv.loss_mask, jnp.ones((P, W)))
        plans = [layout.plan(pool, np.asarray(u)) for u in ([0, 1], [2, 3], [1, 2], [3, 0], [2, 0])]
        R0, L0, Wr0 = packing.startup_layout(cfg, prompt_width=prompts.shape[1], num_leaves=W, response_length=Tr,
                                             num_nodes=N, node_length=TC.segment_length, trees=2,
                                             row_multiple=row_multiple)
        assert L0 == packing.bucket_row_length(bound, cfg.granule) and Wr0 == 2 * W and R0 == row_multiple
        assert {pl.shape for pl in plans} == {(R0, L0, Wr0)} and len(layout.floor.layouts) == 1
        if row_multiple == 2:  # two trained trees (prompt 3 is the untrained filler) in different rows, not in row 0
            assert all(((pl.leaf_id >= 0).any(axis=1)).all() for pl in (plans[0], plans[2], plans[4]))
    # startup_rows="max": the ladder's top from the start (one tree per row), nothing left to grow or precompile
    top = dataclasses.replace(cfg, startup_rows="max")
    for row_multiple in (1, 4):
        layout = Packed(CFG, top, row_multiple=row_multiple)
        pool = layout.pool(ro, adv.tokens, adv.loss_mask, jnp.ones((P, W)))
        plans = [layout.plan(pool, np.asarray(u)) for u in ([0, 1, 2], [2, 3, 1], [3, 0, 1])]
        shape = (row_multiple * -(-3 // row_multiple), packing.bucket_row_length(bound, cfg.granule), W)
        assert {pl.shape for pl in plans} == {shape} and layout.floor.layouts == {shape}
        assert layout.floor.ladder() == []
        for pl in plans:  # at most one tree a row; a row without one is all padding
            trees_per_row = (pl.leaf_id >= 0).sum(axis=1) // W
            assert trees_per_row.max() == 1 and (pl.node_lo[trees_per_row == 0] >= packing.PAD_NODE).all()
    with pytest.raises(ValueError, match="startup_rows"):
        packing.PackingConfig(startup_rows="all")


def test_packed_equals_expanded_with_duplicate_leaves(policy_params):
    """A slot tree stores a path that stops holding n slots n times: the packed batch holds its tokens once and
    gathers them to every copy's (leaf, token) pairs, so loss, metrics and gradients equal the expanded batch's,
    where each copy is its own row (fp32, 1e-5)."""
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, T.init_params(CFG, jax.random.key(0)))
    tc = dataclasses.replace(TC, allocation="slots", init_divergence=2, num_leaves=8)
    forest, _ = tree.make_tree_rollout(CFG, tc)(params, PROMPTS, LENGTHS, TREE_KEY)
    first = np.asarray(forest.distinct_leaves())
    assert not first.all()  # copies present
    grad_fn = _grad_fn(CASES["seq-mean-token-mean"][0], num_micro_batches=1)
    for name in ("treepo", "grpo", "treepo_segment"):
        batch, packed = _both_batches(PROMPTS, LENGTHS, forest, name)
        loss, metrics, grads = grad_fn(policy_params, batch)
        ploss, pmetrics, pgrads = grad_fn(policy_params, packed)
        np.testing.assert_allclose(float(ploss), float(loss), rtol=1e-5, err_msg=name)
        for k in ("pg_loss", "num_tokens", "kl", "entropy"):
            np.testing.assert_allclose(float(pmetrics[k]), float(metrics[k]), rtol=1e-5, atol=1e-7, err_msg=k)
        _assert_grads_close(pgrads, grads)


def test_mass_leaf_weighting(policy_params):
    """``leaf_weighting='mass'``: on a slot tree (every weight 1) the step equals ``'count'``'s; on a
    ``"transfer"`` tree without fallback (weights = W x path mass, not all 1) the parameters move differently;
    bad values and the fallback are refused."""
    from treejax.precision import Precision
    from treejax.rl.config import RunConfig, StepConfig
    from treejax.rl.step import make_learner, rl_step
    from treejax.testing.sources import FixedPromptRollouts

    with pytest.raises(ValueError, match="leaf_weighting must be one of"):
        StepConfig(leaf_weighting="path")
    with pytest.raises(ValueError, match="fallback"):
        RunConfig(leaf_weighting="mass")
    RunConfig(leaf_weighting="mass", rollout=dataclasses.replace(RunConfig().rollout, fallback=False))
    loss_cfg = losses.LossConfig(eps_high=0.28)
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0))
    update = jax.jit(make_update_fn(EXPANDED, loss_cfg, opt))

    fns = {w: make_learner(CFG, StepConfig(estimator="grpo", loss=loss_cfg, leaf_weighting=w),
                           Precision().resolve("cpu"), update, EXPANDED) for w in ("count", "mass")}  # built once each

    rollouts = {}

    def run(tc, weighting):
        if tc not in rollouts:  # one compiled rollout per tree config
            rollouts[tc] = tree.make_tree_rollout(CFG, tc)
        source = FixedPromptRollouts(rollouts[tc], PROMPTS, LENGTHS,
                                     lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
        state = TrainState.create(jax.tree.map(jnp.copy, policy_params), opt)
        state, ro, _, _ = rl_step(fns[weighting], state, source, jax.random.key(8), 0)
        return jax.device_get(state.params), np.asarray(ro.forest.leaf_weights())

    slots = dataclasses.replace(TC, allocation="slots", init_divergence=2)
    # weights of 1 change nothing (exact on the CPU; to reduction order on a GPU, whose sums are not run-to-run
    # deterministic), weights != 1 move the parameters far beyond that
    (a, _), (b, _) = run(slots, "count"), run(slots, "mass")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    transfer = dataclasses.replace(TC, fallback=False)
    (a, w), (b, _) = run(transfer, "count"), run(transfer, "mass")
    assert not np.allclose(w, 1.0)
    assert any(not np.allclose(x, y, rtol=1e-3, atol=1e-4) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_hidden_states_reach_a_shaper_equal_in_both_layouts(policy_params):
    """``Shaper.needs = ("hidden",)``: the trainer pass's last-layer states at each response token reach the
    shaper in the forest's layout, the same in both layouts and equal to a direct forward of the expanded rows."""
    import dataclasses as dc

    from treejax.models import transformer
    from treejax.precision import Precision
    from treejax.rl.batch import forest_to_batch
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import make_layout
    from treejax.rl.shaping import Shaped, Shaper, register, shaper_classes
    from treejax.rl.shaping.base import masked_mean
    from treejax.rl.step import make_learner, rl_step
    from treejax.testing.sources import FixedPromptRollouts

    if "test_hidden_norm" not in shaper_classes():
        @register("test_hidden_norm")
        @dc.dataclass(frozen=True)
        class HiddenNorm(Shaper):  # reports the mean squared norm of the trained tokens' hidden states
            needs = ("hidden",)

            def shape(self, x):
                sq = jnp.sum(jnp.square(x.hidden.astype(jnp.float32)), axis=-1)
                return Shaped(x.advantages, x.eps_scale, {"sq_norm": masked_mean(sq, x.on),
                                                          "first": sq[0, 0, 1]})
    shaper = shaper_classes()["test_hidden_norm"]()
    loss_cfg = losses.LossConfig()
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0))
    source = FixedPromptRollouts(tree.make_tree_rollout(CFG, TC), PROMPTS, LENGTHS,
                                 lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
    out = {}
    for packed in (False, True):
        cfg = StepConfig(estimator="treepo", loss=loss_cfg, attention_impl="xla", shapers=(shaper,),
                         packing=dataclasses.replace(SMALL_ROWS, attention_impl="xla") if packed else None)
        layout = make_layout(CFG, cfg.packing, attention_impl="xla")
        update = jax.jit(make_update_fn(layout, loss_cfg, opt))
        fns = make_learner(CFG, cfg, Precision().resolve("cpu"), update, layout)
        state = TrainState.create(jax.tree.map(jnp.copy, policy_params), opt)
        _, ro, m, _ = rl_step(fns, state, source, jax.random.key(8), 0)
        out[packed] = jax.device_get(m)
    np.testing.assert_allclose(out[True]["shaping/test_hidden_norm/sq_norm"],
                               out[False]["shaping/test_hidden_norm/sq_norm"], rtol=1e-5)
    # leaf (0, 0), response token 1: the hidden state at its own position n_0 + 1 of the expanded row
    b = forest_to_batch(jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), ro.forest,
                        jnp.zeros(ro.forest.tokens.shape, jnp.float32))
    h = transformer.forward(policy_params, CFG, b["tokens"][:1], b["positions"][:1], b["segment_ids"][:1])
    want = float(jnp.sum(jnp.square(h[0, int(LENGTHS[0]) + 1])))
    for packed in (False, True):
        np.testing.assert_allclose(out[packed]["shaping/test_hidden_norm/first"], want, rtol=1e-5)
