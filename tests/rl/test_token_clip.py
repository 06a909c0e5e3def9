"""Per-token clip ranges end to end: an estimator's ``Advantages.clip_scale [P, W, T]`` carried by the learner's pool
(``Batch.token_eps_scale``, either layout) to ``policy_loss(..., eps_scale_BxT=...)``.

Checked on a turn forest (:func:`treejax.forest.forest_from_spans`: branching, copies, observation tokens):

* (a) the expanded update's loss, metrics and gradients equal a direct ``policy_loss`` whose per-token scale is
  placed at the sequence positions by a plain loop (1 on prompt, padding and observation tokens), times a per-leaf
  scale;
* (b) the packed batch (through the learner's seam ``Layout.pool / plan / assemble``) equals the expanded one with
  a non-trivial per-token scale: tolerances of tests/rl/test_packing.py (loss and metrics ``rtol=1e-5``, gradients
  ``|g_packed - g| <= 1e-5 |g|``);
* (c) an all-ones per-token scale gives bit-identical loss, metrics and gradients to none, in both layouts; without
  a scale the pool holds no extra array (the programs are the ones built before per-token scales existed);
* (d) ``a2tgpo`` through :func:`treejax.rl.step.learn`: on a crafted forest whose first PPO ratios sit between the
  plain and the adaptive clip bounds, ``adaptive_clip`` moves clipped pairs exactly as its multipliers say.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import forest_from_spans
from treejax.models import presets
from treejax.models import transformer as T
from treejax.rl import losses, packing
from treejax.rl.advantages.info_gain import A2TGPOOptions
from treejax.rl.batch import TreeInputs, expanded_batch, forest_to_batch, response_to_sequence
from treejax.rl.layouts import Expanded, Packed
from treejax.rl.update import make_grad_fn
from treejax.testing.forests import hand_turn_forest, lay_out_nodes, random_tree_paths

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250, num_layers=1)  # one layer: compile time
P, W, D, MAXLEN = 2, 6, 3, 4
TR = D * MAXLEN
PROMPTS = np.random.RandomState(3).randint(60, 250, (P, 5)).astype(np.int32)
LENGTHS = np.array([5, 3], np.int32)
EXPANDED = Expanded(CFG, attention_impl="xla")
PACKED = Packed(CFG, packing.PackingConfig(row_length=64, max_trees_per_row=1, attention_impl="xla"))
LOSS = losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, entropy_coef=0.01, tis_cap=1.5)
METRICS = ("loss", "pg_loss", "num_tokens", "entropy", "tis_weight_mean", "clip_frac_low", "clip_frac_high",
           "clip_frac_dual", "approx_kl", "ratio_mean", "ratio_max", "ratio_min")


def turn_forest(seed: int):
    """``P`` random turn trees of ``W`` slots (branching, early stops, copied slots), nodes of 1..4 tokens: >= 1
    policy token, then maybe observation tokens. Sampler log-probs near ``-log V``, which the tiny random model
    gives every token (within ~0.05), so the first PPO ratios fall on both sides of the clip bounds."""
    rng = np.random.default_rng(seed)
    paths = np.stack([random_tree_paths(rng, W, D) for _ in range(P)])
    for p in range(P):
        for w in np.flatnonzero(rng.random(W) < 0.3):
            paths[p, w] = paths[p, rng.integers(W)]
    N = 1 + W * D
    node_length = rng.integers(1, MAXLEN + 1, (P, N))
    node_tok = rng.integers(3, 250, (P, N, MAXLEN))
    node_pm = np.arange(MAXLEN)[None, None, :] < rng.integers(1, MAXLEN + 1, (P, N))[:, :, None]
    node_logp = -np.log(250.0) + rng.normal(0, 0.05, (P, N, MAXLEN))  # near the tiny random model's own
    tok, pm, logp = lay_out_nodes(paths, node_length, node_tok.astype(np.int32), node_pm.astype(np.float32),
                                  node_logp.astype(np.float32), width=TR)
    return forest_from_spans(paths, node_length, tok, logp, pm)


def _inputs(forest, seed=0):
    """Advantages (0 off the loss mask), old / sampler log-probs that differ (ratios on both sides of the clip
    bounds), a per-leaf scale and a per-token scale in [0.5, 1.8] on policy tokens, junk (7) elsewhere: the
    learner must replace it by 1 there."""
    rng = np.random.default_rng(seed)
    mask = np.asarray(forest.loss_mask)
    adv = (rng.normal(0, 1, mask.shape) * mask).astype(np.float32)
    smp = np.asarray(forest.logprobs)
    old = (smp + rng.normal(0, 0.15, smp.shape)).astype(np.float32)
    sampler = (smp + rng.normal(0, 0.1, smp.shape)).astype(np.float32)
    eps = rng.uniform(0.5, 2.0, (P, W)).astype(np.float32)
    pol = np.asarray(forest.policy_tokens()) > 0
    tok = np.where(pol, rng.uniform(0.5, 1.8, mask.shape), 7.0).astype(np.float32)
    return adv, old, sampler, eps, tok


@pytest.fixture(scope="module")
def params():
    return T.init_params(CFG, jax.random.key(1))


@pytest.fixture(scope="module")
def case():
    f = turn_forest(11)
    return f, _inputs(f)


_GRAD_FNS = {}


def _grads(params, batch):
    lay = PACKED if isinstance(batch.inputs, TreeInputs) else EXPANDED
    if lay not in _GRAD_FNS:
        _GRAD_FNS[lay] = jax.jit(make_grad_fn(lay, LOSS))
    loss, metrics, grads = _GRAD_FNS[lay](params, batch)
    return jax.device_get((dict(metrics, loss=loss), grads))


def _pool_batches(forest, adv, old, sampler, eps, tok):
    """The expanded and the packed batch of all leaves through ``Layout.pool / plan / assemble`` (``tok=None``: no
    per-token scale), with the given old / sampler log-probs put in each layout's pairs."""
    ro = SimpleNamespace(forest=forest, prompts_PxLp=PROMPTS, lengths_P=LENGTHS)
    tok = None if tok is None else jnp.asarray(tok)
    out = []
    for lay in (EXPANDED, PACKED):
        pool = lay.pool(ro, jnp.asarray(adv), forest.loss_mask, jnp.asarray(eps), token_eps_scale_PxWxT=tok)
        b = lay.assemble(pool, lay.plan(pool, np.arange(pool.units)))
        if lay is EXPANDED:
            put = lambda x: response_to_sequence(jnp.asarray(x), jnp.asarray(LENGTHS), b.inputs.tokens.shape[1])  # noqa: E731
        else:
            put = lambda x: packing.pack_pairs(b.inputs, jnp.asarray(x).reshape(P * W, TR))  # noqa: E731
        out.append(b.replace(old_logp=put(old), sampler_logp=put(sampler)))
    return out


def _assert_grads_close(g_packed, g_ref, rtol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_packed), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err, norm = np.linalg.norm(a - b), np.linalg.norm(b)
        assert err <= rtol * norm + 1e-12, (jax.tree_util.keystr(path), err, norm)


# ------------------------------------------------------------------------------------------------ (a)
def test_expanded_update_equals_direct_policy_loss(params, case):
    """(a) The expanded update with a per-token scale = ``policy_loss(..., eps_scale_B=leaf scale,
    eps_scale_BxT=...)`` on the same rows, the per-token scale placed at ``n_p + t`` by a loop; (c) in the expanded
    layout: all ones == none, bit for bit."""
    f, (adv, old, sampler, eps, tok) = case
    d = forest_to_batch(jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), f, jnp.asarray(adv),
                        eps_scale_PxW=jnp.asarray(eps), token_eps_scale_PxWxT=jnp.asarray(tok))
    L = d["tokens"].shape[1]
    for k, v in (("old_logp", old), ("sampler_logp", sampler)):
        d[k] = response_to_sequence(jnp.asarray(v), jnp.asarray(LENGTHS), L)
    b = expanded_batch(d)
    m, g = _grads(params, b)

    pol = np.asarray(f.policy_tokens()) > 0
    want = np.ones((P * W, L), np.float32)
    for p in range(P):
        for w in range(W):
            for t in range(TR):
                if pol[p, w, t]:
                    want[p * W + w, LENGTHS[p] + t] = tok[p, w, t]
    np.testing.assert_array_equal(np.asarray(b.token_eps_scale), want)

    def direct(prm):
        logp, ent = EXPANDED.pair_logprobs(prm, b.inputs, with_entropy=True)
        return losses.policy_loss(logp, b.old_logp, b.advantages, b.loss_mask, LOSS, entropy=ent,
                                  sampler_logp=b.sampler_logp, eps_scale_B=jnp.asarray(eps).reshape(-1),
                                  eps_scale_BxT=jnp.asarray(want))

    (loss, dm), dg = jax.device_get(jax.jit(jax.value_and_grad(direct, has_aux=True))(params))
    dm = dict(dm, loss=loss)
    for k in METRICS:
        np.testing.assert_allclose(float(m[k]), float(dm[k]), rtol=1e-6, atol=1e-8, err_msg=k)
    _assert_grads_close(g, dg, rtol=1e-6)
    # the per-token scale matters here: without it other pairs clip
    m0, _ = _grads(params, b.replace(token_eps_scale=None))
    assert m0["loss"] != m["loss"]
    assert m0["clip_frac_low"] != m["clip_frac_low"] or m0["clip_frac_high"] != m["clip_frac_high"]
    _assert_ones_bit_identical(params, b.replace(token_eps_scale=None))


def _assert_ones_bit_identical(params, b0):
    """(c) ``b0`` (no per-token scale) and ``b0`` with an all-ones one: the same loss, metrics and gradients, bit for
    bit; without one the batch holds no extra array (the same pytree as before the field existed)."""
    b1 = b0.replace(token_eps_scale=jnp.ones_like(b0.loss_mask))
    assert len(jax.tree.leaves(b1)) == len(jax.tree.leaves(b0)) + 1
    m0, g0 = _grads(params, b0)
    m1, g1 = _grads(params, b1)
    for k in METRICS:
        assert np.array_equal(m0[k], m1[k]), (k, m0[k], m1[k])
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------------ (b)
@pytest.mark.parametrize("seed", [11, pytest.param(12, marks=pytest.mark.slow)])
def test_packed_equals_expanded_with_token_scale(params, seed):
    """(b) Through ``Layout.pool / plan / assemble``: the packed batch's per-pair scale is the expanded one's (1 off
    the policy tokens, empty slots included) and its loss, metrics and gradients equal the expanded batch's; (c) in
    the packed layout: all ones == none, bit for bit."""
    f = turn_forest(seed)
    adv, old, sampler, eps, tok = _inputs(f, seed)
    e, pk = _pool_batches(f, adv, old, sampler, eps, tok)
    pol = np.asarray(f.policy_tokens()).reshape(P * W, TR) > 0
    want = np.where(pol, tok.reshape(P * W, TR), 1.0)
    np.testing.assert_array_equal(np.asarray(EXPANDED.to_response(e.token_eps_scale, LENGTHS, TR)), want)
    np.testing.assert_array_equal(np.asarray(packing.unpack_pairs(pk.inputs, pk.token_eps_scale, P * W)), want)
    leaf = np.asarray(pk.inputs.leaf_id)
    assert np.all(np.asarray(pk.token_eps_scale)[leaf < 0] == 1.0)
    m, g = _grads(params, e)
    pm, pg = _grads(params, pk)
    assert float(m["num_tokens"]) == float(pol.sum())
    for k in METRICS:
        np.testing.assert_allclose(float(pm[k]), float(m[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    _assert_grads_close(pg, g)
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0
    if seed == 11:
        _assert_ones_bit_identical(params, pk.replace(token_eps_scale=None))


# ------------------------------------------------------------------------------------------------ (c)
def test_pool_without_estimator_scale_has_no_extra_array(case):
    """(c) Without an estimator's clip scale the pool's batch holds no per-token array in either layout (the learner
    builds the same programs as before the field existed); with an all-ones one it holds ones (the bit-identical
    losses are checked in the two tests above, which hold the compiled update)."""
    f, (adv, old, sampler, eps, _) = case
    for b0, b1 in zip(_pool_batches(f, adv, old, sampler, eps, None),
                      _pool_batches(f, adv, old, sampler, eps, np.ones((P, W, TR), np.float32))):
        assert b0.token_eps_scale is None and np.all(np.asarray(b1.token_eps_scale) == 1.0)
        assert len(jax.tree.leaves(b1)) == len(jax.tree.leaves(b0)) + 1


# ------------------------------------------------------------------------------------------------ (d)
# one prompt, 4 slots: root -> n1 -> {n3 (w0), n4 (w1)}; root -> n2 -> n5 -> n6 (w2, w3: copies); observation
# tokens inside n1, n2 and n5 (treejax.testing.forests.hand_turn_forest). Turn 0's IGs are [.3, .3, -.1, -.1]:
# z = +1 on n1 (w0, w1), -1 on n2 (w2, w3), so c = 1 +- 0.3 (2 sigmoid(1) - 1) = 1.1386 / 0.8614 there.
D_V = np.array([[0.2, 0.5, 0.1, 0.6, 0.4, 0.3, 0.7]])  # pi(a | ...) of root, n1 .. n6
D_R = np.array([[1.0, 0.0, 1.0, 1.0]], np.float32)
D_PROMPT, D_LEN = np.array([[5, 6, 7, 8]], np.int32), np.array([4], np.int32)
D_RATIO = {1: 0.79, 2: 1.185}  # first PPO ratio on n1's / n2's tokens (1 elsewhere)


def _d_forest(params):
    """The hand forest with sampler log-probs = the trainer's own minus log(ratio): with ``old_logp="sampler"`` the
    first update's ratios are ``D_RATIO`` on turn 0 (n1: 0.79, between the adaptive lower bound 1 - 0.2 c = 0.772
    and the plain 0.8; n2: 1.185, between 1 + 0.2 c = 1.172 and the plain 1.2), 1 elsewhere."""
    *_, f = hand_turn_forest()
    d = expanded_batch(forest_to_batch(jnp.asarray(D_PROMPT), jnp.asarray(D_LEN), f, jnp.zeros(f.tokens.shape)))
    logp = jax.jit(lambda prm, x: EXPANDED.pair_logprobs(prm, x))(params, d.inputs)
    logp = np.asarray(EXPANDED.to_response(logp, D_LEN, f.tokens.shape[-1])).reshape(f.tokens.shape)
    turn0 = np.asarray(f.segment_index) == 0
    node = np.where(turn0, np.asarray(f.leaf_path)[:, :, 1:2], 0)
    ratio = np.where(node == 1, D_RATIO[1], np.where(node == 2, D_RATIO[2], 1.0))
    return f.replace(logprobs=jnp.asarray(logp - np.log(ratio), jnp.float32))


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a2tgpo_adaptive_clip_through_learn(params, packed):
    """(d) ``learn`` with a2tgpo (one mini-batch, the sampler's log-probs as pi_old): with ``adaptive_clip`` off,
    w1's negative-advantage pairs on n1 clip low (ratio 0.79 < 0.8) and nothing clips high; with it on those pairs
    are inside their wider range (0.772) and w2 / w3's positive pairs on n2 clip high (1.185 > 1.172 in their
    narrower range) instead. Both fractions equal a NumPy count from the estimator's advantages and clip scale
    (``Advantages.clip_scale``, here equal to the hand values of :func:`a2tgpo_clip_scale`, which
    tests/rl/test_info_gain.py checks against a reference); without the option the estimator gives none."""
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import make_layout
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.rollouts import Rollouts
    from treejax.rl.step import learn, make_learner
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn

    f = _d_forest(params)
    truth = jnp.log(jnp.asarray(D_V, jnp.float32))
    ro = Rollouts(forest=f, rewards_PxW=jnp.asarray(D_R), scores_PxW=None, prompts_PxLp=D_PROMPT,
                  lengths_P=D_LEN, estimator_inputs={"truth_logp_PxN": truth})
    loss = losses.LossConfig(eps_low=0.2, eps_high=0.2)
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0))
    pol = np.asarray(f.policy_tokens()) > 0
    turn0 = np.asarray(f.segment_index) == 0
    node = np.where(turn0, np.asarray(f.leaf_path)[:, :, 1:2], 0)
    ratio = np.where(node == 1, D_RATIO[1], np.where(node == 2, D_RATIO[2], 1.0))
    z = 0.2 / (0.2 + 1e-6)  # turn 0's IGs [.3, .3, -.1, -.1]: mean .1, std .2
    c1 = 1 + 0.3 * (2 / (1 + np.exp(-z)) - 1)
    hand_c = np.where(pol & (node == 1), c1, np.where(pol & (node == 2), 2 - c1, 1.0))
    got = {}
    for adaptive in (False, True):
        options = A2TGPOOptions(adaptive_clip=adaptive)
        cfg = StepConfig(estimator="a2tgpo", estimator_options=options, loss=loss, old_logp="sampler",
                         attention_impl="xla",
                         packing=packing.PackingConfig(granule=8, attention_impl="xla") if packed else None)
        layout = make_layout(CFG, cfg.packing, attention_impl="xla")
        learner = make_learner(CFG, cfg, Precision().resolve("cpu"), jax.jit(make_update_fn(layout, loss, opt)),
                               layout)
        out = learner.estimator(f, ro.rewards_PxW, ro.estimator_inputs)  # the program learn runs
        assert (out.clip_scale is not None) == adaptive
        A = np.asarray(out.tokens)
        c = np.asarray(out.clip_scale) if adaptive else np.ones_like(A)
        if adaptive:
            np.testing.assert_allclose(c, hand_c, atol=2e-6)
        want_low = np.sum(pol & (A < 0) & (ratio < 1 - 0.2 * c)) / pol.sum()
        want_high = np.sum(pol & (A > 0) & (ratio > 1 + 0.2 * c)) / pol.sum()
        state = TrainState.create(jax.tree.map(jnp.copy, params), opt)
        _, m, _ = learn(learner, state, ro, jax.random.key(0))
        m = jax.device_get(m)
        np.testing.assert_allclose(m["update/clip_frac_low"], want_low, rtol=1e-6, err_msg=str(adaptive))
        np.testing.assert_allclose(m["update/clip_frac_high"], want_high, rtol=1e-6, err_msg=str(adaptive))
        got[adaptive] = (float(m["update/clip_frac_low"]), float(m["update/clip_frac_high"]))
    n = pol.sum()
    assert got[False] == pytest.approx((2 / n, 0.0)) and got[True] == pytest.approx((0.0, 2 / n))
