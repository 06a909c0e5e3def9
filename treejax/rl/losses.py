"""PPO-family policy losses on per-token arrays: clip-higher, dual-clip, three aggregations, KL, entropy, TIS.

All inputs are ``[B, T]`` per-token arrays aligned with each other (``B`` sequences, ``T`` token slots) and a
``[B, T]`` loss mask (1.0 on action tokens the loss trains on, 0.0 elsewhere: prompt, padding, observations,
SPO-style probability masks). Masked positions may hold anything finite or not: they are replaced by zeros
*before* any ``exp`` so that neither the value nor the gradient can pick up a NaN from them.

Per-token surrogate (Schulman et al. 2017, PPO; clip-higher from DAPO, Yu et al. 2025, arXiv 2503.14476;
dual-clip from Ye et al. 2020, arXiv 1912.09729)::

    r_t      = exp(logp_t - old_logp_t)                                   (importance ratio, new / old)
    eps_lo_bt = eps_low  * s_b * u_bt,   eps_hi_bt = eps_high * s_b * u_bt
                 (s_b = eps_scale_B[b], u_bt = eps_scale_BxT[b, t]: per-sequence / per-token multipliers, default 1)
    L^clip_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_lo_bt, 1 + eps_hi_bt))
    L^pg_t   = min(L^clip_t, -A_t c)   if A_t < 0 and dual-clip is on      (caps the loss of very large ratios)
             = L^clip_t                otherwise

Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training", as implemented in verl's ``tis_imp_ratio_cap``): when the sampler's log-probs ``sampler_logp`` differ
from the trainer's recomputed ``old_logp`` (different kernels / precision / a stale sampler), each token's
policy-gradient loss is multiplied by a constant (stop-gradient) weight::

    w_t = min(exp(old_logp_t - sampler_logp_t), C),   L^pg_t <- w_t * L^pg_t

KL to a frozen reference policy (samples come from the current policy, so these estimate KL(pi_theta || pi_ref);
Schulman, "Approximating KL divergence", 2020; GRPO uses k3)::

    k1_t = logp_t - ref_logp_t
    k3_t = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1          (>= 0, unbiased, low variance)

Total per-token loss: ``L_t = L^pg_t + beta * KL_t - alpha * H_t`` (H = entropy of the current policy at t),
aggregated over the batch by one of (``m`` = mask, ``T_max`` = the Dr.GRPO normaliser, default ``T``)::

    "token-mean"              sum_{b,t} m L / sum_{b,t} m                       (DAPO; TreePO's setting)
    "seq-mean-token-mean"     mean over sequences with >= 1 token of (sum_t m L / sum_t m)   (GRPO)
    "seq-mean-token-sum-norm" sum_{b,t} m L / (B * T_max)                      (Dr.GRPO, Liu et al. 2025,
                                                                              arXiv 2503.20783)

Dr.GRPO note: the paper writes (1/G) sum_i sum_t; its code (oat's ``masked_mean(..., constant_normalizer)``)
divides each sequence's token sum by the generation budget and averages over sequences, i.e. the formula above.
verl's ``seq-mean-token-sum-norm`` omits the 1/B in some versions; we keep it so the scale is independent of the
batch size.

Gradient accumulation: the aggregations are sums over tokens divided by a batch-level denominator. Pass the
mini-batch's denominator (:func:`loss_denominator` on the whole mini-batch mask) as ``denominator`` to each
micro-batch's call, and the sum of the micro-batch losses equals the mini-batch loss exactly (and so do the
gradients), for every aggregation mode.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from treejax.choices import check_choice

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss configuration (hashable; safe as a jit static argument).

    Attributes:
      eps_low: lower clip range: ratios below ``1 - eps_low`` are clipped (for A < 0).
      eps_high: upper clip range: ratios above ``1 + eps_high`` are clipped (for A > 0). DAPO: 0.28 with
        eps_low 0.2 ("clip-higher").
      dual_clip_c: dual-clip constant ``c > 1`` for negative advantages (verl default 3.0, TreePO runs 10.0);
        ``None`` turns dual-clip off.
      aggregation: one of ``AGGREGATIONS`` (see module docstring).
      norm_constant: ``T_max`` of ``"seq-mean-token-sum-norm"``; ``None`` uses the token axis length ``T``.
      kl_coef: ``beta``; 0 disables the KL term (``ref_logp`` is then ignored).
      kl_estimator: ``"k1"`` or ``"k3"``.
      entropy_coef: ``alpha``; 0 disables the entropy bonus.
      tis_cap: ``C`` of truncated importance sampling; ``None`` disables it (``sampler_logp`` then only feeds
        metrics).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    aggregation: Aggregation = "token-mean"
    norm_constant: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None

    def __post_init__(self):
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"LossConfig.dual_clip_c must be > 1 (or None to disable), got {self.dual_clip_c}")
        check_choice("LossConfig.aggregation", self.aggregation, AGGREGATIONS)
        if self.norm_constant is not None and self.norm_constant <= 0:
            raise ValueError(f"LossConfig.norm_constant must be > 0, got {self.norm_constant}")
        check_choice("LossConfig.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"LossConfig.kl_coef/entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0 (or None), got {self.tis_cap}")


def loss_denominator(mask_BxT: jax.Array, config: LossConfig) -> jax.Array:
    """The batch-level denominator of ``config.aggregation`` (float32 scalar, never below 1 token / 1 sequence).

    token-mean: number of masked tokens; seq-mean-token-mean: number of sequences with at least one token;
    seq-mean-token-sum-norm: ``B * T_max``.
    """
    mask = mask_BxT.astype(jnp.float32)
    if config.aggregation == "token-mean":
        return jnp.maximum(jnp.sum(mask), 1.0)
    if config.aggregation == "seq-mean-token-mean":
        return jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32)), 1.0)
    norm = config.norm_constant if config.norm_constant is not None else mask.shape[-1]
    return jnp.asarray(mask.shape[0] * float(norm), jnp.float32)


def aggregate(
    values_BxT: jax.Array, mask_BxT: jax.Array, config: LossConfig, denominator: jax.Array | None = None
) -> jax.Array:
    """Aggregates per-token values into a scalar with ``config.aggregation`` (formulas in the module docstring).

    ``denominator`` overrides :func:`loss_denominator` (for micro-batches of a larger mini-batch).
    """
    mask = mask_BxT.astype(jnp.float32)
    values = jnp.where(mask > 0, values_BxT, 0.0)
    denom = loss_denominator(mask, config) if denominator is None else denominator
    if config.aggregation == "seq-mean-token-mean":
        per_seq_B = jnp.sum(values * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return jnp.sum(per_seq_B) / denom
    return jnp.sum(values * mask) / denom


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def kl_penalty(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL(pi_theta || pi_ref) estimate: ``k1 = logp - ref``, ``k3 = exp(ref - logp) - (ref - logp) - 1``."""
    if estimator == "k1":
        return logp_BxT - ref_logp_BxT
    if estimator == "k3":
        log_ratio = ref_logp_BxT - logp_BxT
        return jnp.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def _check_shapes(name_to_array: dict[str, jax.Array | None], shape: tuple[int, ...]) -> None:
    for name, arr in name_to_array.items():
        if arr is not None and tuple(arr.shape) != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(arr.shape)}, expected {shape} (like logp_BxT)")


def policy_loss(
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    mask_BxT: jax.Array,
    config: LossConfig,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    sampler_logp: jax.Array | None = None,
    eps_scale_B: jax.Array | None = None,
    *,
    denominator: jax.Array | None = None,
    eps_scale_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip loss with clip-higher, dual-clip, TIS, KL and entropy terms (math in the module docstring).

    Args:
      logp_BxT: log pi_theta of the taken tokens (differentiable).
      old_logp_BxT: log pi_old of the taken tokens (the policy that the ratio is taken against; no gradient).
      advantages_BxT: per-token advantages (broadcast a per-sequence advantage to tokens before calling).
      mask_BxT: 1.0 on tokens the loss trains on.
      config: :class:`LossConfig`.
      ref_logp: [B, T] reference-policy log-probs; required iff ``config.kl_coef > 0``.
      entropy: [B, T] entropy of pi_theta at each position (differentiable); required iff
        ``config.entropy_coef > 0``; also reported as a metric when given.
      sampler_logp: [B, T] the sampler's log-probs of the same tokens; required iff ``config.tis_cap`` is set.
      eps_scale_B: optional [B] per-sequence multiplier of both clip ranges (per-sample clip epsilon hooks such
        as ECHO's); 1 everywhere by default.
      eps_scale_BxT: optional [B, T] per-token multiplier of both clip ranges, on top of ``eps_scale_B`` (per-turn
        clip ranges such as A2TGPO's adaptive turn clip, :func:`treejax.rl.advantages.info_gain.a2tgpo_clip_scale`,
        broadcast to the turn's tokens); 1 everywhere by default.
      denominator: overrides the aggregation denominator (see module docstring on gradient accumulation).

    Returns:
      ``(loss, metrics)``; ``loss`` is a float32 scalar. ``metrics`` (float32 scalars, token-means over the
      mask unless named otherwise): ``pg_loss``, ``clip_frac_low`` (A<0 and r<1-eps_lo: clipped, zero
      gradient), ``clip_frac_high`` (A>0 and r>1+eps_hi), ``clip_frac_dual`` (A<0 and the dual-clip bound is
      active), ``approx_kl`` (k1 of KL(pi_old || pi_theta): mean(old - logp)), ``approx_kl_k3``,
      ``ratio_mean``/``ratio_min``/``ratio_max`` (+inf / -inf when the mask is empty), ``num_tokens``, and when given ``kl``, ``entropy``, ``tis_weight_mean``,
      ``tis_clip_frac``.
    """
    shape = tuple(logp_BxT.shape)
    _check_loss_inputs(shape, config, old_logp_BxT=old_logp_BxT, advantages_BxT=advantages_BxT, mask_BxT=mask_BxT,
                       ref_logp=ref_logp, entropy=entropy, sampler_logp=sampler_logp, eps_scale_B=eps_scale_B,
                       eps_scale_BxT=eps_scale_BxT)

    mask = mask_BxT.astype(jnp.float32)
    on = mask > 0
    f32 = lambda x: jnp.where(on, x.astype(jnp.float32), 0.0)  # noqa: E731  (sanitise masked slots before exp)
    logp, old_logp, adv = f32(logp_BxT), jax.lax.stop_gradient(f32(old_logp_BxT)), f32(advantages_BxT)
    adv = jax.lax.stop_gradient(adv)

    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    lower, upper = _clip_bounds(config, shape, on, eps_scale_B, eps_scale_BxT)
    pg_loss, negative, dual_active = _clipped_surrogate(config, adv, ratio, lower, upper, on)

    metrics: dict[str, jax.Array] = {}
    if sampler_logp is not None:
        pg_loss = _truncated_is(config, pg_loss, old_logp, f32(sampler_logp), mask, metrics)

    per_token = pg_loss
    metrics["pg_loss"] = aggregate(pg_loss, mask, config, denominator)
    per_token = _kl_and_entropy(config, per_token, logp, ref_logp, entropy, f32, mask, metrics)
    loss = aggregate(per_token, mask, config, denominator)
    _ratio_metrics(metrics, adv, ratio, log_ratio, lower, upper, negative, dual_active, on, mask)
    return loss, metrics


def _check_loss_inputs(shape: tuple[int, ...], config: LossConfig, *, old_logp_BxT, advantages_BxT, mask_BxT,
                       ref_logp, entropy, sampler_logp, eps_scale_B, eps_scale_BxT) -> None:
    """:func:`policy_loss`'s arguments: every per-token array ``[B, T]`` like ``logp_BxT``, ``eps_scale_B [B]``,
    and the arrays the config's terms need (KL: ``ref_logp``, entropy bonus: ``entropy``, TIS: ``sampler_logp``)."""
    if len(shape) != 2:
        raise ValueError(f"policy_loss: logp_BxT must be [B, T], got shape {shape}")
    _check_shapes(
        dict(old_logp_BxT=old_logp_BxT, advantages_BxT=advantages_BxT, mask_BxT=mask_BxT, ref_logp=ref_logp,
             entropy=entropy, sampler_logp=sampler_logp),
        shape,
    )
    if eps_scale_B is not None and tuple(eps_scale_B.shape) != shape[:1]:
        raise ValueError(f"policy_loss: eps_scale_B has shape {tuple(eps_scale_B.shape)}, expected {shape[:1]}")
    _check_shapes(dict(eps_scale_BxT=eps_scale_BxT), shape)
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: config.kl_coef > 0 needs ref_logp")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: config.entropy_coef > 0 needs entropy")
    if config.tis_cap is not None and sampler_logp is None:
        raise ValueError("policy_loss: config.tis_cap is set but sampler_logp is None")


def _clip_bounds(config: LossConfig, shape: tuple[int, ...], on: jax.Array, eps_scale_B: jax.Array | None,
                 eps_scale_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The ratio's clip range ``(1 - eps_low s_b u_bt, 1 + eps_high s_b u_bt)``, ``[B, 1]`` or ``[B, T]`` (module
    docstring; ``u_bt`` is 1 on masked slots, where the bounds are never used)."""
    clip_scale = jnp.ones((shape[0], 1), jnp.float32) if eps_scale_B is None else eps_scale_B.astype(jnp.float32)[:, None]
    if eps_scale_BxT is not None:  # per-token clip ranges ([B, T] bounds; 1 on masked slots, never used there)
        clip_scale = clip_scale * jnp.where(on, jax.lax.stop_gradient(eps_scale_BxT.astype(jnp.float32)), 1.0)
    lower = 1.0 - config.eps_low * clip_scale
    upper = 1.0 + config.eps_high * clip_scale
    return lower, upper


def _clipped_surrogate(config: LossConfig, adv: jax.Array, ratio: jax.Array, lower: jax.Array, upper: jax.Array,
                       on: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(L^pg, A < 0, dual-clip active)`` per token: ``max(-A r, -A clip(r, lower, upper))``, capped at ``-A c``
    where ``A < 0`` when dual-clip is on (module docstring)."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, lower, upper)
    pg_loss = jnp.maximum(pg_unclipped, pg_clipped)
    negative = adv < 0
    if config.dual_clip_c is not None:
        dual_bound = -adv * config.dual_clip_c
        dual_active = negative & (pg_loss > dual_bound) & on
        pg_loss = jnp.where(negative, jnp.minimum(pg_loss, dual_bound), pg_loss)
    else:
        dual_active = jnp.zeros(ratio.shape, bool)
    return pg_loss, negative, dual_active


def _truncated_is(config: LossConfig, pg_loss: jax.Array, old_logp: jax.Array, sampler_logp: jax.Array,
                  mask: jax.Array, metrics: dict) -> jax.Array:
    """TIS: ``w = exp(old_logp - sampler_logp)`` (no gradient), its mean as ``tis_weight_mean``; with
    ``config.tis_cap`` ``C`` the loss times ``min(w, C)`` and the fraction of ``w > C`` as ``tis_clip_frac``."""
    tis_log_w = old_logp - jax.lax.stop_gradient(sampler_logp)
    tis_w = jnp.exp(tis_log_w)
    metrics["tis_weight_mean"] = _masked_mean(tis_w, mask)
    if config.tis_cap is not None:
        metrics["tis_clip_frac"] = _masked_mean((tis_w > config.tis_cap).astype(jnp.float32), mask)
        pg_loss = pg_loss * jnp.minimum(tis_w, config.tis_cap)
    return pg_loss


def _kl_and_entropy(config: LossConfig, per_token: jax.Array, logp: jax.Array, ref_logp: jax.Array | None,
                    entropy: jax.Array | None, f32, mask: jax.Array, metrics: dict) -> jax.Array:
    """``per_token + beta KL - alpha H`` (each term when its coefficient is > 0); ``kl`` and ``entropy`` reported
    whenever their arrays are given (``f32``: the masked-slot sanitiser)."""
    if ref_logp is not None:
        kl = kl_penalty(logp, jax.lax.stop_gradient(f32(ref_logp)), config.kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask)
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    if entropy is not None:
        ent = f32(entropy)
        metrics["entropy"] = _masked_mean(ent, mask)
        if config.entropy_coef > 0:
            per_token = per_token - config.entropy_coef * ent
    return per_token


def _ratio_metrics(metrics: dict, adv: jax.Array, ratio: jax.Array, log_ratio: jax.Array, lower: jax.Array,
                   upper: jax.Array, negative: jax.Array, dual_active: jax.Array, on: jax.Array,
                   mask: jax.Array) -> None:
    """The clip fractions, approximate KL(pi_old || pi_theta) (k1 and k3), ratio mean / min / max and the token
    count into ``metrics`` (no gradient; :func:`policy_loss`'s docstring)."""
    sg = jax.lax.stop_gradient
    ratio_sg, log_ratio_sg = sg(ratio), sg(log_ratio)
    metrics["clip_frac_low"] = _masked_mean((negative & (ratio_sg < lower)).astype(jnp.float32), mask)
    metrics["clip_frac_high"] = _masked_mean(((adv > 0) & (ratio_sg > upper)).astype(jnp.float32), mask)
    metrics["clip_frac_dual"] = _masked_mean(dual_active.astype(jnp.float32), mask)
    metrics["approx_kl"] = _masked_mean(-log_ratio_sg, mask)
    metrics["approx_kl_k3"] = _masked_mean(ratio_sg - 1.0 - log_ratio_sg, mask)
    metrics["ratio_mean"] = _masked_mean(ratio_sg, mask)
    metrics["ratio_max"] = jnp.max(jnp.where(on, ratio_sg, -jnp.inf))
    metrics["ratio_min"] = jnp.min(jnp.where(on, ratio_sg, jnp.inf))
    metrics["num_tokens"] = jnp.sum(mask)
