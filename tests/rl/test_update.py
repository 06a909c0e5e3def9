"""Update-step tests on a tiny Qwen2-family model: log-prob alignment, finite differences, micro-batch
accumulation, the non-finite guard and a learning-signal sanity check.

Precision: fp32 (``highest`` matmul precision on a GPU, tests/conftest.py): log-probs 1e-5, micro-batch
accumulation 1e-5 relative, finite differences 2e-3 relative; fp32 master weights with bf16 compute: dtypes,
finiteness and movement only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from treejax.models import presets, transformer
from treejax.rl import losses
from treejax.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.batch import expanded_batch, trainable_mask
from treejax.rl.layouts import Expanded, sequence_logprobs
from treejax.rl.update import make_update_fn

CFG = presets.tiny_config("qwen2.5-0.5b")


def _update(cfg, loss_cfg, tx, **kw):
    """The jitted update of the expanded layout on an expanded dict batch (``expanded_batch``)."""
    fn = make_update_fn(Expanded(cfg, attention_impl="xla"), loss_cfg, tx, **kw)
    return jax.jit(lambda state, batch: fn(state, expanded_batch(batch)))


def make_batch(seed, B=8, L=16, prompt=5, cfg=CFG):
    """Synthetic batch: random tokens, right-padded responses of random lengths after a 5-token prompt."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.vocab_size, (B, L)).astype(np.int32)
    lengths = rng.integers(prompt + 2, L + 1, B)
    t = np.arange(L)[None, :]
    seg = (t < lengths[:, None]).astype(np.int32)
    tokens = np.where(seg > 0, tokens, 0)
    loss_mask = ((t >= prompt) & (seg > 0)).astype(np.float32)
    adv_B = rng.normal(size=B).astype(np.float32)
    return dict(
        tokens=jnp.asarray(tokens), positions=jnp.asarray(np.broadcast_to(t, (B, L)).astype(np.int32)),
        segment_ids=jnp.asarray(seg), loss_mask=jnp.asarray(loss_mask),
        old_logp=jnp.asarray(np.log(1.0 / cfg.vocab_size) + rng.normal(0, 0.3, (B, L)).astype(np.float32)),
        advantages=jnp.asarray(np.broadcast_to(adv_B[:, None], (B, L)).copy()),
    )


def test_sequence_logprobs_are_aligned_with_tokens():
    params = transformer.init_params(CFG, jax.random.PRNGKey(0))
    b = make_batch(0, B=2)
    logp, ent = sequence_logprobs(params, CFG, b["tokens"], b["positions"], b["segment_ids"], chunk_size=100,
                                  with_entropy=True)
    hidden = transformer.forward(params, CFG, b["tokens"], b["positions"], b["segment_ids"])
    logsm = np.asarray(jax.nn.log_softmax(transformer.logits(params, CFG, hidden), axis=-1))  # [B, L, V]
    want = np.zeros(logp.shape)
    want_ent = np.zeros(logp.shape)
    toks = np.asarray(b["tokens"])
    for i in range(logp.shape[0]):
        for t in range(1, logp.shape[1]):
            want[i, t] = logsm[i, t - 1, toks[i, t]]
            want_ent[i, t] = -np.sum(np.exp(logsm[i, t - 1]) * logsm[i, t - 1])
    np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)


def test_trainable_mask_drops_segment_starts_and_padding():
    b = dict(tokens=jnp.zeros((1, 6), jnp.int32), loss_mask=jnp.ones((1, 6)),
             segment_ids=jnp.asarray([[1, 1, 2, 2, 2, 0]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(trainable_mask(b)), [[0, 1, 0, 1, 1, 0]])


def _total_loss(params, batch, loss_cfg):
    logp, ent = sequence_logprobs(params, CFG, batch["tokens"], batch["positions"], batch["segment_ids"],
                                  with_entropy=True)
    return losses.policy_loss(logp, batch["old_logp"], batch["advantages"], trainable_mask(batch), loss_cfg,
                              entropy=ent)[0]


def test_loss_gradient_matches_finite_differences_on_tiny_model():
    """Directional derivative of the full loss (model + clipped surrogate) vs a central difference, fp32."""
    params = transformer.init_params(CFG, jax.random.PRNGKey(1))
    batch = make_batch(1)
    loss_cfg = losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, entropy_coef=0.01)
    f = jax.jit(lambda p: _total_loss(p, batch, loss_cfg))
    grads = jax.jit(jax.grad(lambda p: _total_loss(p, batch, loss_cfg)))(params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    direction = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    norm = optax.tree.norm(direction)
    direction = jax.tree.map(lambda d: d / norm, direction)
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    h = 1e-2
    shifted = lambda s: jax.tree.map(lambda p, d: p + s * d, params, direction)  # noqa: E731
    numeric = (float(f(shifted(h))) - float(f(shifted(-h)))) / (2 * h)
    assert abs(analytic) > 1e-3  # a meaningful directional derivative
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3)


@pytest.fixture(scope="module")
def smooth_optimizer():
    # eps=1: Adam's first step is then ~lr * g (smooth in g) instead of ~lr * sign(g), so fp32 summation-order
    # differences in tiny gradients cannot flip an update's sign when comparing two ways of computing one step.
    return make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0, weight_decay=0.1))


def test_micro_batch_accumulation_equals_one_shot(smooth_optimizer):
    loss_cfg = losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, aggregation="seq-mean-token-mean",
                                 kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01, tis_cap=2.0)
    params = transformer.init_params(CFG, jax.random.PRNGKey(3))
    batch = make_batch(3)
    rng = np.random.default_rng(33)  # every optional input goes through the micro-batch split too
    batch["ref_logp"] = batch["old_logp"] + jnp.asarray(rng.normal(0, 0.2, batch["old_logp"].shape), jnp.float32)
    batch["sampler_logp"] = batch["old_logp"] + jnp.asarray(rng.normal(0, 0.3, batch["old_logp"].shape),
                                                            jnp.float32)
    batch["eps_scale"] = jnp.asarray(rng.uniform(0.5, 2.0, batch["tokens"].shape[0]), jnp.float32)
    results = {}
    for m in (1, 4):
        fn = _update(CFG, loss_cfg, smooth_optimizer, num_micro_batches=m)
        state = TrainState.create(params, smooth_optimizer)
        results[m] = fn(state, batch)
    (s1, m1), (s4, m4) = results[1], results[4]
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "kl", "tis_weight_mean", "clip_frac_low", "approx_kl",
              "ratio_max", "ratio_min", "num_tokens"):
        np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    # the update's loss is policy_loss on freshly recomputed log-probs (direct, un-split computation)
    logp, ent = jax.jit(lambda p: sequence_logprobs(p, CFG, batch["tokens"], batch["positions"],
                                                    batch["segment_ids"], with_entropy=True))(params)
    direct, _ = losses.policy_loss(logp, batch["old_logp"], batch["advantages"], trainable_mask(batch), loss_cfg,
                                   ref_logp=batch["ref_logp"], entropy=ent, sampler_logp=batch["sampler_logp"],
                                   eps_scale_B=batch["eps_scale"])
    np.testing.assert_allclose(float(m1["loss"]), float(direct), rtol=1e-5)
    chex_close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)  # noqa
    jax.tree.map(chex_close, s4.params, s1.params)
    assert int(s4.step) == 1


def test_nonfinite_step_is_skipped_or_raises(smooth_optimizer):
    loss_cfg = losses.LossConfig()
    params = transformer.init_params(CFG, jax.random.PRNGKey(4))
    good = make_batch(4)
    r, c = np.argwhere(np.asarray(trainable_mask(good)) > 0)[0]
    bad = dict(good, advantages=good["advantages"].at[r, c].set(jnp.nan))
    fn = _update(CFG, loss_cfg, smooth_optimizer, nonfinite="skip")
    state = TrainState.create(params, smooth_optimizer)
    skipped, m = fn(state, bad)
    assert float(m["skipped"]) == 1.0 and not np.isfinite(float(m["loss"]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), skipped.params, params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), skipped.opt_state,
                 state.opt_state)
    after, m2 = fn(skipped, good)  # the run goes on normally afterwards
    assert float(m2["skipped"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(after.params))

    raising = _update(CFG, loss_cfg, smooth_optimizer, nonfinite="raise")
    with pytest.raises(Exception, match="non-finite update at step 0"):
        jax.block_until_ready(raising(state, bad))


def test_updates_raise_logprob_of_positive_advantage_tokens():
    """Learning signal: with A=+1 on some sequences and -1 on others, a few steps move their log-probs apart;
    flipping the advantage sign moves them the other way."""
    loss_cfg = losses.LossConfig(eps_low=0.2, eps_high=0.28)
    opt_cfg = OptimizerConfig(learning_rate=3e-3, warmup_steps=2, total_steps=10, decay="cosine", weight_decay=0.0)
    tx = make_optimizer(opt_cfg)
    params = transformer.init_params(CFG, jax.random.PRNGKey(5))
    batch = make_batch(5)
    sign_B = jnp.asarray([1.0, -1.0] * 4)
    score = jax.jit(lambda p: sequence_logprobs(p, CFG, batch["tokens"], batch["positions"], batch["segment_ids"]))
    old = score(params)
    mask = trainable_mask(batch)
    fn = _update(CFG, loss_cfg, tx, num_micro_batches=2, learning_rate_fn=learning_rate_schedule(opt_cfg))

    def gap_after(sign):
        b = dict(batch, old_logp=old, advantages=jnp.broadcast_to(sign[:, None], old.shape))
        state = TrainState.create(params, tx)
        for _ in range(4):
            state, metrics = fn(state, b)
        delta = (score(state.params) - old) * mask
        per_seq = jnp.sum(delta, 1) / jnp.sum(mask, 1)
        return float(jnp.mean(per_seq * sign_B)), metrics

    gap, metrics = gap_after(sign_B)
    flipped, _ = gap_after(-sign_B)
    assert gap > 0.05 and flipped < -0.05, (gap, flipped)
    np.testing.assert_allclose(float(metrics["learning_rate"]), float(learning_rate_schedule(opt_cfg)(3)))


def test_fp32_master_weights_with_bf16_compute():
    """param_dtype float32 + compute_dtype bfloat16: params, grads and Adam moments stay fp32 and the step
    moves the loss in the same direction as the fp32 step."""
    cfg16 = presets.tiny_config("qwen2.5-0.5b", compute_dtype="bfloat16")
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    params = transformer.init_params(cfg16, jax.random.PRNGKey(6))
    state = TrainState.create(params, tx)
    batch = make_batch(6, cfg=cfg16)
    new, m = _update(cfg16, losses.LossConfig(), tx, num_micro_batches=2)(state, batch)
    assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.opt_state) if jnp.issubdtype(x.dtype, jnp.floating))
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(new.params),
                                                                               jax.tree.leaves(params))]
    assert all(changed)
