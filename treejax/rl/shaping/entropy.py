"""ETTRL's entropy-based advantage reshaping (EAR, "Adv-Res"): responses more uncertain than their group's average
get a smaller advantage, more confident ones a larger one.

Source: Liu et al., "ETTRL: Balancing Exploration and Exploitation in LLM Test-Time Reinforcement Learning via
Entropy Mechanism" (arXiv 2508.11356), Sec. "Entropy-based Advantage Reshaping". No code is public; the formula is
taken from the paper's description as summarised in the ETTRL notes we could read (the method section itself was
not reachable), so the choices the text leaves open are stated here. Per leaf ``i`` of a prompt's group ``G``::

    H_i = (1/|T_i|) sum_{t in T_i} H_t          response-level mean entropy over the leaf's trained tokens T_i,
                                                 H_t from the trainer's forward under the pre-update weights
    Y_i = 1 + (mean_{j in G} H_j - H_i) / mean_{j in G} H_j  =  2 - H_i / mean_G H
    A'_{i,t} = clip(Y_i, y_min, y_max) A_{i,t}                (both signs of A)

Choices: the group mean is over the prompt's leaves with a trained token (a filler or empty leaf has no entropy);
``Y`` is clipped to ``[y_min, y_max] = [0, 2]`` so a response with more than twice the group's mean entropy never
has its advantage's sign flipped (the text gives no clip; ``y_min = -inf`` restores the raw form). A group whose
mean entropy is 0 keeps ``Y = 1``. The alternative the paper compares against, "Adv-Clip" (``clip(A, -2, 2)``),
is ``mode = "clip"``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, group_mean, masked_mean, register

EAR_MODES = ("reshape", "clip")


@register("ear")
@dataclasses.dataclass(frozen=True)
class EntropyAdvantageReshaping(Shaper):
    """ETTRL's EAR: each leaf's advantages times 2 - H_leaf / mean_group H (module docstring)."""

    mode: str = "reshape"
    y_min: float = 0.0
    y_max: float = 2.0
    clip_bound: float = 2.0

    needs = ("entropy",)

    def __post_init__(self):
        check_choice("EntropyAdvantageReshaping.mode", self.mode, EAR_MODES)
        if not self.y_min < self.y_max:
            raise ValueError(f"EntropyAdvantageReshaping: y_min < y_max required, got {self.y_min}, {self.y_max}")
        if self.clip_bound <= 0:
            raise ValueError(f"EntropyAdvantageReshaping.clip_bound must be > 0, got {self.clip_bound}")

    def shape(self, x: ShapingInputs) -> Shaped:
        on = x.on
        if self.mode == "clip":
            adv = jnp.where(on, jnp.clip(x.advantages, -self.clip_bound, self.clip_bound), 0.0)
            return Shaped(adv, x.eps_scale, {"clip_frac": masked_mean(
                (jnp.abs(x.advantages) > self.clip_bound).astype(jnp.float32), on)})
        leaf_on = jnp.any(on, axis=-1)
        h_leaf = masked_mean(x.entropy, on, axis=-1)  # [P, W]
        h_group = group_mean(h_leaf, leaf_on)[:, None]
        y = jnp.where(h_group > 0, 2.0 - h_leaf / jnp.where(h_group > 0, h_group, 1.0), 1.0)
        y = jnp.clip(y, self.y_min, self.y_max)
        adv = jnp.where(on, x.advantages * y[:, :, None], 0.0)
        any_on = jnp.any(leaf_on)  # extremes are 1 when no leaf trains
        return Shaped(adv, x.eps_scale, {"scale_mean": masked_mean(y, leaf_on),
                                         "scale_min": jnp.where(any_on, jnp.min(jnp.where(leaf_on, y, jnp.inf)), 1.0),
                                         "scale_max": jnp.where(any_on, jnp.max(jnp.where(leaf_on, y, -jnp.inf)), 1.0)})


__all__ = ["EntropyAdvantageReshaping", "EAR_MODES"]
