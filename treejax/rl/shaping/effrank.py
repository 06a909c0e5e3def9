"""VERL: the effective rank of the policy's hidden states, its velocity and acceleration, as an advantage bonus.

Source: "Beyond the Exploration-Exploitation Trade-off: A Hidden State Approach for LLM Reasoning in RLVR"
(arXiv 2509.23808) and its code ``hf618/VERL`` at 3de68f1 (``verl/trainer/metrics_utils.py``,
``reward_manager_versions.py``, ``train.sh``); the paper's own equations could not be read, the constants are the
released script's.

Per leaf, with ``H`` its response tokens' last-layer hidden states (after the final norm; ``Shaper.needs =
("hidden",)``, the trainer's own forward), ``L`` tokens:

* **effective rank** of a token set: ``sigma`` = singular values of the token-centred ``H - mean_t H``,
  ``p_j = sigma_j / (sum sigma + 1e-8)``, ``ER = exp(-sum_j p_j log(p_j + 1e-8))``; ``ER`` of the whole response;
* over growing prefixes of the last ``n = min(L, max_window)`` tokens (``max_window = 512``), stride
  ``s = stride = 40``: window ``k = 1, 2, ...`` (while ``k s < n``) holds the first ``k s + 1`` of them,
  ``ER_k`` its rank; ``d_k = ER_k - mean(ER_1 .. ER_{k-1})`` (``k >= 2``), ``a_k = d_k - d_{k-1}`` (``k >= 3``);
  **ERV** = mean_k ``d_k``, **ERA** = mean_k ``a_k`` (0 when the response has too few windows).

The bonus, with ``mu_m`` an EMA over steps of the batch mean of each channel ``m`` in (ERA, ERV, ER):

    ``delta_m = clip((m - mu_m) / (|mu_m| + 1e-8), -5, 5)``,  ``lambda = sigmoid(gain * delta_ERA)``,
    ``psi = weight * (lambda tanh(delta_ER) + (1 - lambda) tanh(delta_ERV))``,
    ``A'_t = A_t + min(relu(psi), |A_t| / kappa)``

(``gain = 2``, ``weight = 1``, ``kappa = 2``: the bonus is never negative and at most half the advantage), on the
leaf's **last** trained token as the code writes it (``apply_to="last"``), or on every trained token
(``apply_to="all"``, the paper's "auxiliary advantage" reading). ``mu <- (1 - alpha) mu + alpha * batch mean``
after the step's bonus (``alpha = ema_alpha = 0.3``).

Choices where the code is silent or odd (said here, not hidden): the released ``train.sh`` passes
``--add_reward False --add_adv True`` and its reward manager computes ``psi`` only when ``add_reward`` is on, so it
trains plain GRPO; here ``psi`` is computed whenever the shaper is on. The code starts ``mu`` at 0, which saturates
every ``delta`` at the first bonus step; here the first step only sets ``mu`` to its batch means (no bonus). The
state (``mu`` and the step count) lives in ``TrainState.aux["verl_rank"]`` and is checkpointed with the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register

_EPS = 1e-8


def effective_rank(h_NxE: jax.Array, on_N: jax.Array) -> jax.Array:
    """``exp`` of the entropy of the normalised singular values of the rows ``on`` of ``h``, centred (module
    docstring). Rows off ``on`` add zero singular values, which change nothing; no rows gives 1. The singular
    values are the square roots of the eigenvalues of the smaller Gram matrix (``N x N`` or ``E x E``), as in the
    code's windows, with eigenvalues below ``lambda_max * size * eps`` set to 0: in fp32 the exact zeros (a
    window of fewer tokens than dimensions, the centring) come out as ``~eps lambda_max`` of noise, whose square
    roots (``~3e-4 sigma_max``) would move a short window's rank by ~1e-3. (Not ``jnp.linalg.svd``: XLA's CPU
    SVD hung inside the loop's jitted step on a multi-device CPU mesh.)"""
    h = h_NxE.astype(jnp.float32)
    on = on_N.astype(jnp.float32)[:, None]
    mean = jnp.sum(h * on, axis=0) / jnp.maximum(jnp.sum(on), 1.0)
    hc = (h - mean[None, :]) * on
    gram = hc @ hc.T if h.shape[0] <= h.shape[1] else hc.T @ hc
    lam = jnp.linalg.eigvalsh(gram)
    # numerical rank cut-off (NumPy's matrix_rank rule on the Gram matrix): eigenvalues at fp32 noise level are 0
    tol = jnp.max(lam) * max(gram.shape) * jnp.finfo(jnp.float32).eps
    sigma = jnp.sqrt(jnp.where(lam > tol, lam, 0.0))
    p = sigma / (jnp.sum(sigma) + _EPS)
    return jnp.exp(-jnp.sum(p * jnp.log(p + _EPS)))


def rank_channels(hidden_PxWxTxE: jax.Array, length_PxW: jax.Array, stride: int = 40, max_window: int = 512
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(ER, ERV, ERA)``, each ``[P, W]``, of every leaf's first ``length`` hidden states (module docstring)."""
    P, W, T, E = hidden_PxWxTxE.shape
    h = hidden_PxWxTxE.reshape(P * W, T, E)
    L = length_PxW.reshape(P * W).astype(jnp.int32)
    t = jnp.arange(T)
    er = jax.vmap(effective_rank)(h, t[None, :] < L[:, None])
    Tw = min(T, max_window)
    n = jnp.minimum(L, Tw)
    start = L - n
    idx = jnp.minimum(start[:, None] + jnp.arange(Tw)[None, :], T - 1)
    tail = jnp.take_along_axis(h, idx[:, :, None], axis=1)  # [R, Tw, E]: the last n tokens first
    K = max((Tw - 1) // stride, 0)  # windows k = 1..K can exist (k * stride < Tw)
    if K == 0:
        z = jnp.zeros((P, W), jnp.float32)
        return er.reshape(P, W), z, z
    k = jnp.arange(1, K + 1)
    on_RxKxTw = jnp.arange(Tw)[None, None, :] <= (k * stride)[None, :, None]
    valid_RxK = (k[None, :] * stride) < n[:, None]
    er_k = jax.vmap(lambda hh: jax.vmap(lambda on: effective_rank(hh, on))(on_RxKxTw[0]))(tail)  # [R, K]
    er_k = jnp.where(valid_RxK, er_k, 0.0)
    prev_mean = jnp.cumsum(er_k, axis=1) / k[None, :].astype(jnp.float32)  # mean of ER_1..ER_k
    d = jnp.concatenate([jnp.zeros_like(er_k[:, :1]), er_k[:, 1:] - prev_mean[:, :-1]], axis=1)
    d_on = valid_RxK & (k[None, :] >= 2)
    a = jnp.concatenate([jnp.zeros_like(d[:, :1]), d[:, 1:] - d[:, :-1]], axis=1)
    a_on = valid_RxK & (k[None, :] >= 3)
    erv = jnp.sum(jnp.where(d_on, d, 0.0), 1) / jnp.maximum(jnp.sum(d_on, 1), 1)
    era = jnp.sum(jnp.where(a_on, a, 0.0), 1) / jnp.maximum(jnp.sum(a_on, 1), 1)
    return er.reshape(P, W), erv.reshape(P, W), era.reshape(P, W)


def last_on(on_PxWxT: jax.Array) -> jax.Array:
    """bool ``[P, W, T]``: the last position ``on`` of each leaf."""
    T = on_PxWxT.shape[-1]
    t = jnp.arange(T)[None, None, :]
    last = jnp.max(jnp.where(on_PxWxT, t, -1), axis=-1)
    return on_PxWxT & (t == last[..., None])


@register("verl_rank")
@dataclasses.dataclass(frozen=True)
class EffectiveRankBonus(Shaper):
    """VERL's effective-rank advantage bonus (module docstring)."""

    needs = ("hidden",)
    stateful = True
    stride: int = 40
    max_window: int = 512
    ema_alpha: float = 0.3
    gain: float = 2.0
    weight: float = 1.0
    kappa: float = 2.0
    delta_clip: float = 5.0
    apply_to: str = "last"

    def __post_init__(self):
        check_choice("EffectiveRankBonus.apply_to", self.apply_to, ("last", "all"))
        if self.stride < 1 or self.max_window < 2:
            raise ValueError(f"EffectiveRankBonus needs stride >= 1 and max_window >= 2, got {self.stride}, "
                             f"{self.max_window}")
        if not 0.0 < self.ema_alpha <= 1.0 or self.kappa <= 0:
            raise ValueError(f"EffectiveRankBonus needs 0 < ema_alpha <= 1 and kappa > 0, got {self.ema_alpha}, "
                             f"{self.kappa}")

    def init_state(self, hidden_size: int) -> Any:
        return {"mu": jnp.zeros((3,), jnp.float32), "steps": jnp.zeros((), jnp.int32)}

    def shape(self, x: ShapingInputs) -> Shaped:
        raise TypeError("EffectiveRankBonus is stateful: apply it with shape_stateful (apply_shapers does)")

    def shape_stateful(self, x: ShapingInputs, state: Any) -> tuple[Shaped, Any]:
        er, erv, era = rank_channels(x.hidden, x.leaf_length, self.stride, self.max_window)
        m = jnp.stack([era, erv, er], axis=-1)  # [P, W, 3]
        leaf_on = jnp.any(x.on, axis=-1)
        batch = masked_mean(m, leaf_on[..., None], axis=(0, 1))  # [3]
        mu = state["mu"]
        delta = jnp.clip((m - mu[None, None, :]) / (jnp.abs(mu[None, None, :]) + _EPS), -self.delta_clip, self.delta_clip)
        lam = jax.nn.sigmoid(self.gain * delta[..., 0])
        psi = self.weight * (lam * jnp.tanh(delta[..., 2]) + (1.0 - lam) * jnp.tanh(delta[..., 1]))
        psi = jnp.where((state["steps"] > 0) & leaf_on, psi, 0.0)
        where = last_on(x.on) if self.apply_to == "last" else x.on
        bonus = jnp.where(where, jnp.minimum(jax.nn.relu(psi)[..., None], jnp.abs(x.advantages) / self.kappa), 0.0)
        first = state["steps"] == 0
        new_mu = jnp.where(first, batch, (1.0 - self.ema_alpha) * mu + self.ema_alpha * batch)
        metrics = {"er": batch[2], "erv": batch[1], "era": batch[0], "psi_mean": masked_mean(psi, leaf_on),
                   "lambda_mean": masked_mean(lam, leaf_on), "bonus_mean": masked_mean(bonus, where),
                   "bonus_frac": masked_mean((psi > 0).astype(jnp.float32), leaf_on)}
        return (Shaped(x.advantages + bonus, x.eps_scale, metrics),
                {"mu": new_mu, "steps": state["steps"] + 1})
