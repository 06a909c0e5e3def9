"""NudgeRL's advantage (estimator ``nudge``): inter- and intra-context parts over a problem's hinted and plain
rollouts, whitened per problem; distillation rows get ``distill_coef`` x their rollout's. Formulas, source and the
rows it reads: :mod:`treejax.rl.nudge` (the rollout source that builds them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import check_rewards
from treejax.rl.advantages.registry import Advantages, register_estimator

#: Estimator inputs :class:`treejax.rl.nudge.NudgeRollouts` supplies (per prompt row and leaf, ``[P, W]``).
NUDGE_INPUTS = ("nudge_problem_PxW", "nudge_context_PxW", "nudge_source_PxW")


@dataclasses.dataclass(frozen=True)
class NudgeOptions:
    """The advantage side: ``lam`` the inter-context weight, ``eps`` the std guard, ``distill_coef`` lambda_d."""

    lam: float = 1.1
    eps: float = 1e-5
    distill_coef: float = 0.1


def nudge_core(rewards_N, problem_N, context_N, source_N, options: NudgeOptions):
    """``[N]`` per-row advantages (module docstring) over flat rows: rollout rows (``source < 0``) grouped by
    ``problem``, distillation rows copy ``distill_coef`` x their source row's."""
    r = rewards_N.astype(jnp.float32)
    roll = source_N < 0
    same_p = (problem_N[:, None] == problem_N[None, :]) & roll[None, :]
    same_c = same_p & (context_N[:, None] == context_N[None, :])
    mean = lambda m: jnp.sum(jnp.where(m, r[None, :], 0.0), 1) / jnp.maximum(jnp.sum(m, 1), 1)  # noqa: E731
    mu_c, mu = mean(same_c), mean(same_p)
    a = jnp.where(context_N > 0, (r - mu_c) + options.lam * (mu_c - mu), r - mu)
    a = jnp.where(roll, a, 0.0)
    a_mean = jnp.sum(jnp.where(same_p, a[None, :], 0.0), 1) / jnp.maximum(jnp.sum(same_p, 1), 1)
    dev = jnp.where(same_p, a[None, :] - a_mean[:, None], 0.0)
    std = jnp.sqrt(jnp.sum(dev * dev, 1) / jnp.maximum(jnp.sum(same_p, 1), 1))
    a = jnp.where(roll, (a - a_mean) / (std + options.eps), 0.0)
    return jnp.where(roll, a, options.distill_coef * a[jnp.maximum(source_N, 0)])


@register_estimator("nudge", NudgeOptions, inputs=NUDGE_INPUTS)
def nudge(forest: Forest, rewards_PxW: jax.Array, options: NudgeOptions = NudgeOptions(), *,
          nudge_problem_PxW: jax.Array, nudge_context_PxW: jax.Array, nudge_source_PxW: jax.Array) -> Advantages:
    """NudgeRL's advantages (module docstring), one per leaf, on every response token; the rows come from
    :class:`NudgeRollouts` (``nudge_source_PxW``: the flat leaf index a distillation row re-scores, -1 for
    rollouts)."""
    r = check_rewards(forest, rewards_PxW)
    shape = r.shape
    for name, x in (("nudge_problem_PxW", nudge_problem_PxW), ("nudge_context_PxW", nudge_context_PxW),
                    ("nudge_source_PxW", nudge_source_PxW)):
        if x.shape != shape:
            raise ValueError(f"nudge: {name} has shape {x.shape}, expected {shape}")
    a = nudge_core(r.reshape(-1), nudge_problem_PxW.reshape(-1), nudge_context_PxW.reshape(-1),
                   nudge_source_PxW.reshape(-1), options).reshape(shape)
    mask = forest.loss_mask
    return Advantages(tokens=jnp.where(mask > 0, a[:, :, None], 0.0), loss_mask=mask, leaves=a)


__all__ = ["NUDGE_INPUTS", "NudgeOptions", "nudge", "nudge_core"]
