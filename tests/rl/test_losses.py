"""Policy-loss tests: each clip branch by hand, each aggregation against a loop reference, gradients, hooks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.rl.losses import AGGREGATIONS, LossConfig, aggregate, loss_denominator, policy_loss


def _one_token(logp, old, adv, config, **kw):
    arr = lambda x: jnp.asarray([[x]], jnp.float32)  # noqa: E731
    return policy_loss(arr(logp), arr(old), arr(adv), arr(1.0), config, **kw)


def _grad_one_token(logp, old, adv, config):
    f = lambda lp: _one_token(lp, old, adv, config)[0]  # noqa: E731
    return float(jax.grad(f)(jnp.float32(logp)))


# (ratio, advantage, expected loss, expected d loss / d logp, branch) with eps_low=0.2, eps_high=0.28, c=3.
BRANCHES = [
    (1.1, 1.0, -1.1, -1.1, "inside range, A>0: unclipped, grad -A r"),
    (1.5, 1.0, -1.28, 0.0, "A>0, r > 1+eps_high: clipped at 1.28, zero grad"),
    (0.5, 1.0, -0.5, -0.5, "A>0, r < 1-eps_low: unclipped (pessimistic min keeps r)"),
    (0.5, -1.0, 0.8, 0.0, "A<0, r < 1-eps_low: clipped at 0.8, zero grad"),
    (1.5, -2.0, 3.0, 3.0, "A<0, 1+eps_high < r < c: unclipped, grad -A r = 3"),
    (5.0, -1.0, 3.0, 0.0, "A<0, r > c: dual-clip bound -A c = 3, zero grad"),
    (0.9, 0.0, 0.0, 0.0, "A=0: no loss, no grad"),
]


@pytest.mark.parametrize("ratio,adv,loss_ref,grad_ref,why", BRANCHES)
def test_each_clip_branch_value_and_grad(ratio, adv, loss_ref, grad_ref, why):
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    old = -1.3
    logp = old + math.log(ratio)
    loss, metrics = _one_token(logp, old, adv, cfg)
    np.testing.assert_allclose(float(loss), loss_ref, rtol=1e-5, atol=1e-6, err_msg=why)
    np.testing.assert_allclose(_grad_one_token(logp, old, adv, cfg), grad_ref, rtol=1e-5, atol=1e-6, err_msg=why)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), ratio, rtol=1e-5)
    expect_low = adv < 0 and ratio < 0.8
    expect_high = adv > 0 and ratio > 1.28
    expect_dual = adv < 0 and ratio > 3.0
    assert float(metrics["clip_frac_low"]) == float(expect_low), why
    assert float(metrics["clip_frac_high"]) == float(expect_high), why
    assert float(metrics["clip_frac_dual"]) == float(expect_dual), why


def test_dual_clip_off_leaves_large_negative_ratio_unbounded():
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=None)
    loss, metrics = _one_token(math.log(5.0), 0.0, -1.0, cfg)
    np.testing.assert_allclose(float(loss), 5.0, rtol=1e-5)
    assert float(metrics["clip_frac_dual"]) == 0.0


def _reference_loss(logp, old, adv, mask, cfg, eps_scale=None, ref=None, ent=None, samp=None):
    """Loop-by-loop NumPy reference of the module docstring's formulas."""
    B, T = logp.shape
    per = np.zeros((B, T))
    for b in range(B):
        s = 1.0 if eps_scale is None else eps_scale[b]
        for t in range(T):
            if mask[b, t] == 0:
                continue
            r = math.exp(logp[b, t] - old[b, t])
            a = adv[b, t]
            lo, hi = 1 - cfg.eps_low * s, 1 + cfg.eps_high * s
            l = max(-a * r, -a * min(max(r, lo), hi))
            if cfg.dual_clip_c is not None and a < 0:
                l = min(l, -a * cfg.dual_clip_c)
            if cfg.tis_cap is not None:
                l *= min(math.exp(old[b, t] - samp[b, t]), cfg.tis_cap)
            if cfg.kl_coef > 0:
                d = ref[b, t] - logp[b, t]
                kl = (logp[b, t] - ref[b, t]) if cfg.kl_estimator == "k1" else math.exp(d) - d - 1
                l += cfg.kl_coef * kl
            if cfg.entropy_coef > 0:
                l -= cfg.entropy_coef * ent[b, t]
            per[b, t] = l
    if cfg.aggregation == "token-mean":
        return per.sum() / mask.sum()
    if cfg.aggregation == "seq-mean-token-mean":
        seqs = [per[b].sum() / mask[b].sum() for b in range(B) if mask[b].sum() > 0]
        return sum(seqs) / len(seqs)
    norm = cfg.norm_constant if cfg.norm_constant is not None else T
    return per.sum() / (B * norm)


def _random_batch(seed, B=5, T=7):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 0.5, (B, T))
    logp = old + rng.normal(0.0, 0.6, (B, T))  # ratios spread over every clip branch
    adv = rng.normal(0.0, 1.0, (B, T))
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[0] = 0.0  # an empty sequence
    mask[1, 0] = 1.0
    return logp, old, adv, mask, rng


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_aggregations_match_loop_reference(aggregation, dual):
    logp, old, adv, mask, _ = _random_batch(0)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=dual, aggregation=aggregation,
                     norm_constant=16.0 if aggregation == "seq-mean-token-sum-norm" else None)
    # Masked slots hold garbage that must not leak in (not even as NaN gradients).
    logp_garbage = np.where(mask > 0, logp, np.nan)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, _ = policy_loss(f32(logp_garbage), f32(old), f32(adv), f32(mask), cfg)
    np.testing.assert_allclose(float(loss), _reference_loss(logp, old, adv, mask, cfg), rtol=1e-5)
    g = jax.grad(lambda lp: policy_loss(lp, f32(old), f32(adv), f32(mask), cfg)[0])(f32(logp_garbage))
    assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(g)[mask == 0] == 0.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradient_matches_finite_differences_of_reference(aggregation):
    logp, old, adv, mask, rng = _random_batch(1, B=3, T=4)
    ref = logp + rng.normal(0.0, 0.3, logp.shape)
    ent = rng.random(logp.shape) * 2
    samp = old + rng.normal(0.0, 0.4, logp.shape)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, aggregation=aggregation, kl_coef=0.1,
                     kl_estimator="k3", tis_cap=1.5, entropy_coef=0.01)
    jax.config.update("jax_enable_x64", True)
    try:
        f = lambda lp: policy_loss(lp, old, adv, mask, cfg, ref_logp=ref, entropy=ent, sampler_logp=samp)[0]  # noqa
        grad = np.asarray(jax.grad(f)(jnp.asarray(logp)))
    finally:
        jax.config.update("jax_enable_x64", False)
    h = 1e-6
    fd = np.zeros_like(logp)
    for idx in np.ndindex(*logp.shape):
        up, dn = logp.copy(), logp.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (_reference_loss(up, old, adv, mask, cfg, ref=ref, ent=ent, samp=samp)
                   - _reference_loss(dn, old, adv, mask, cfg, ref=ref, ent=ent, samp=samp)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_entropy_tis_and_eps_scale_match_reference(estimator):
    logp, old, adv, mask, rng = _random_batch(2)
    ref = logp + rng.normal(0.0, 0.3, logp.shape)
    ent = rng.random(logp.shape) * 3
    samp = old + rng.normal(0.0, 0.5, logp.shape)
    scale = rng.uniform(0.5, 2.0, logp.shape[0])
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=4.0, kl_coef=0.05, kl_estimator=estimator,
                     entropy_coef=0.02, tis_cap=2.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = policy_loss(f32(logp), f32(old), f32(adv), f32(mask), cfg, ref_logp=f32(ref), entropy=f32(ent),
                          sampler_logp=f32(samp), eps_scale_B=f32(scale))
    want = _reference_loss(logp, old, adv, mask, cfg, eps_scale=scale, ref=ref, ent=ent, samp=samp)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    on = mask > 0
    np.testing.assert_allclose(float(m["entropy"]), ent[on].mean(), rtol=1e-5)
    w = np.exp(old - samp)[on]
    np.testing.assert_allclose(float(m["tis_weight_mean"]), w.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["tis_clip_frac"]), (w > 2.0).mean(), rtol=1e-6)
    lr = (logp - old)[on]
    np.testing.assert_allclose(float(m["approx_kl"]), (-lr).mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["approx_kl_k3"]), (np.exp(lr) - 1 - lr).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_max"]), np.exp(lr).max(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_min"]), np.exp(lr).min(), rtol=1e-5)


def test_eps_scale_changes_clip_decision():
    cfg = LossConfig(eps_low=0.2, eps_high=0.2)
    arr = lambda x: jnp.asarray([[x], [x]], jnp.float32)  # noqa: E731
    loss_each = []
    for s in (1.0, 3.0):
        loss, _ = policy_loss(arr(math.log(1.5)), arr(0.0), arr(1.0), arr(1.0), cfg,
                              eps_scale_B=jnp.asarray([s, s], jnp.float32))
        loss_each.append(float(loss))
    np.testing.assert_allclose(loss_each, [-1.2, -1.5], rtol=1e-5)  # eps 0.2 clips 1.5; eps 0.6 does not


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_losses_sum_to_full_batch_loss(aggregation):
    logp, old, adv, mask, _ = _random_batch(3, B=6, T=5)
    cfg = LossConfig(aggregation=aggregation, dual_clip_c=3.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    full, _ = policy_loss(f32(logp), f32(old), f32(adv), f32(mask), cfg)
    denom = loss_denominator(f32(mask), cfg)
    parts = [policy_loss(f32(logp[i:i + 2]), f32(old[i:i + 2]), f32(adv[i:i + 2]), f32(mask[i:i + 2]), cfg,
                         denominator=denom)[0] for i in (0, 2, 4)]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-5)


def test_aggregate_empty_mask_is_zero_not_nan():
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    out = aggregate(jnp.ones((2, 3)), jnp.zeros((2, 3)), cfg)
    assert float(out) == 0.0


def test_bad_inputs_raise_clear_errors():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="advantages_BxT"):
        policy_loss(x, x, jnp.zeros((2, 4)), x, LossConfig())
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, x, x, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="sum")
