"""PRL: process rewards from the entropy-regularised objective, as a per-step correction of the outcome advantage.

Source: "Process Reward Learning" (arXiv 2601.10201), code ``MaxwellJryao/Process-Reward-Learning``
(``verl/trainer/ppo/core_algos.py::compute_prm_outcome_advantage``, ``left_fill_by_next_nonzero``, the
``ray_trainer.py`` branch ``prm.adv = orm``). The objective ``E[r] - (1/eta) KL(pi || pi_0)`` has the optimal
policy ``pi* ~ pi_0 exp(eta r)``; its per-step decomposition credits each step with the outcome minus the
log-ratio still to come. With the response cut into steps, ``e(t)`` the last token of the step holding token
``t``, and ``d_u = log pi_old(y_u) - log pi_ref(y_u)`` on trained tokens (0 elsewhere)::

    A'_t = A_t - (1/eta) sum_{u >= e(t)} d_u          (suffix sum from the step's end token to the response's end)

``A_t`` is the estimator's outcome advantage (the code's ``orm`` mode uses GRPO's), so every token of a step gets
the value at its step's end. ``pi_ref`` is the frozen initial policy (the KL reference). Steps
(``step_length``): fixed blocks of that many response tokens, the last block ending at the leaf's last token (the
code's ``step_split = length``); ``None`` uses the tree's own segments (``Forest.segment_length``), the natural
steps of a segment tree. The code's constants: ``eta`` 100 with step 64 (Qwen2.5-Math-7B), 200 with step 256
(Llama-3.2-3B); defaults here ``eta = 100``, steps = segments. Noted: a summary of the paper's figure describes a
prefix sum up to the step; the code (followed here) takes the suffix from the step's end.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register


@register("prl")
@dataclasses.dataclass(frozen=True)
class ProcessRewardShaping(Shaper):
    """PRL: A_t - (1/eta) x the log-ratio to the reference from the step's end on (module docstring)."""

    eta: float = 100.0
    step_length: int | None = None

    needs = ("ref_logp",)

    def __post_init__(self):
        if self.eta <= 0:
            raise ValueError(f"ProcessRewardShaping.eta must be > 0, got {self.eta}")
        if self.step_length is not None and self.step_length < 1:
            raise ValueError(f"ProcessRewardShaping.step_length must be >= 1 (or None), got {self.step_length}")

    def shape(self, x: ShapingInputs) -> Shaped:
        on = x.on
        S = self.step_length or x.segment_length
        d = jnp.where(on, x.old_logp - x.ref_logp, 0.0)
        to_go = jnp.cumsum(d[..., ::-1], axis=-1)[..., ::-1]  # sum_{u >= t}
        T = d.shape[-1]
        step_end = jnp.minimum((x.t // S + 1) * S - 1, x.leaf_length[:, :, None] - 1)  # e(t)
        kl_to_go = jnp.take_along_axis(to_go, jnp.clip(step_end, 0, T - 1) * jnp.ones_like(d, jnp.int32), axis=-1)
        adv = jnp.where(on, x.advantages - kl_to_go / self.eta, 0.0)
        return Shaped(adv, x.eps_scale, {"kl_to_go_mean": masked_mean(kl_to_go, on),
                                         "logratio_mean": masked_mean(d, on)})


__all__ = ["ProcessRewardShaping"]
