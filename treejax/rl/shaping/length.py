"""ROSE's length-aware penalty: correct answers longer than their group's shortest correct answer lose part of
their advantage after the point where the two diverge.

Source: ROSE (arXiv 2601.05053), code ``ZiqiZhao1/ROSE-rl``, ``verl/trainer/ppo/core_algos.py::
compute_grpo_iterative_branching_outcome_advantage`` (``algorithm.length_penalty`` = ``lambda``). Per prompt, with
``S`` the correct leaves (score >= 1), ``L_s`` the length of the shortest one (``s``: the first such leaf) and,
for every other correct leaf ``b`` with ``L_b > L_s``, ``k_c`` the last position the two responses share::

    phi_b = 1 - ((L_s - k_c) / (L_b - k_c))^lambda                      in (0, 1)
    A_{b,t} <- A_{b,t} - |A_{b,t}| phi_b        for response tokens t >= k_c (only when phi_b > 0)

so a positive advantage shrinks by the share ``phi``, a negative one grows by it; tokens before ``k_c`` (shared with
the shortest answer) and wrong leaves are unchanged.

In ROSE ``k_c`` is the largest branch position in both responses' branch-position sets (at most ``min(L_b, L_s)``,
else 0). In a treejax tree two leaves share exactly the nodes of their common ancestor path, so ``k_c`` is the
number of response tokens in the nodes both paths hold: ``S x #{d >= 1 : path_b[d] = path_s[d]}`` (a depth-``d``
node holds tokens ``[(d - 1) S, d S)``), capped at ``L_s``; for independent samples (every path its own root
child) ``k_c = 0``. The released code ships ``lambda = 0`` (penalty off) and the paper's value was not found:
``lam = 1`` (``phi = (L_b - L_s) / (L_b - k_c)``, the share of the extra length) is treejax's default.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, correct, masked_mean, register


def shared_prefix(leaf_path_PxWxD1: jnp.ndarray, ref_W_P: jnp.ndarray, segment_length: int) -> jnp.ndarray:
    """``[P, W]`` response tokens leaf ``w`` shares with leaf ``ref[p]`` of its prompt (node-count x ``S``; callers
    cap it at the shorter length)."""
    ref_path = jnp.take_along_axis(leaf_path_PxWxD1, ref_W_P[:, None, None], axis=1)  # [P, 1, D + 1]
    same = (leaf_path_PxWxD1 == ref_path) & (leaf_path_PxWxD1 >= 0)
    return jnp.sum(same[:, :, 1:], axis=-1) * segment_length


@register("rose_length")
@dataclasses.dataclass(frozen=True)
class RoseLengthPenalty(Shaper):
    """ROSE: correct leaves longer than the shortest correct one lose |A| phi after the shared prefix."""

    lam: float = 1.0

    def __post_init__(self):
        if self.lam <= 0:
            raise ValueError(f"RoseLengthPenalty.lam must be > 0, got {self.lam}")

    def shape(self, x: ShapingInputs) -> Shaped:
        ok = correct(x) & jnp.any(x.on, axis=-1)
        L = x.leaf_length.astype(jnp.float32)
        big = jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.float32)
        L_ok = jnp.where(ok, L, big)
        s = jnp.argmin(L_ok, axis=1)  # first shortest correct leaf
        L_s = jnp.min(L_ok, axis=1, keepdims=True)  # [P, 1]
        k_c = jnp.minimum(shared_prefix(x.leaf_path, s, x.segment_length).astype(jnp.float32), L_s)
        penalised = ok & (L > L_s)
        ratio = (L_s - k_c) / jnp.where(penalised, L - k_c, 1.0)
        phi = jnp.where(penalised, 1.0 - jnp.power(jnp.clip(ratio, 0.0, 1.0), self.lam), 0.0)  # [P, W]
        after = x.t >= k_c[:, :, None]
        adv = x.advantages - jnp.where(after & x.on, jnp.abs(x.advantages) * phi[:, :, None], 0.0)
        return Shaped(adv, x.eps_scale, {"penalised_frac": masked_mean(penalised.astype(jnp.float32), ok),
                                         "phi_mean": masked_mean(phi, penalised)})


__all__ = ["RoseLengthPenalty", "shared_prefix"]
