"""SPO-chain (Guo et al. 2025, "Segment Policy Optimization", arXiv 2505.23564, the chain variant for short
chains of thought): segment advantages from Monte-Carlo values at low-probability cut points.

Source: code ``AIFrameResearch/SPO`` (``src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py``,
``trainers/ppo_trainer.py``; configs ``polIter_rho1bSft2_spo_chain_GSM8K.jsonnet``, ``episode_generators/
interval5.jsonnet``, read at b9fc6a2). For one sampled response ``y`` of reward ``r``:

* cut points: the positions ``i`` with ``pi(y_i | y_<i) < rho`` (``rho = 0.9``), every ``interval``-th of them
  (``interval = 5``, "int5"), ``s_0 < s_1 < ... < s_{n-1}`` (:func:`treejax.sampling.continuation.
  low_probability_cuts`); a cut at ``s`` is the state ``x, y_<s``;
* values: ``V(s_k)`` = the mean reward of ``K = 9`` fresh continuations from that state (the response itself not
  included), :mod:`treejax.sampling.continuation` decodes them, the rollout source scores them
  (``cut_value_PxWxB``); ``V(s_n) := r``;
* advantages: token ``t`` in ``[s_k, s_{k+1})`` gets ``A_t = V(s_{k+1}) - V(s_k)`` (``k = 0..n-1``); the tokens
  before the first cut get 0 (the code has no value of the prompt unless ``s_0 = 0``); a response without cut
  points gets 0 everywhere;
* probability mask: only tokens with ``pi(y_t) < rho`` carry the loss (the trainer's ``use_prob_mask``), i.e. the
  cut tokens and the low-probability tokens between them;
* whitening: ``(A - mean) / sqrt(var + 1e-8)`` over the loss's tokens (``whiten_advantages``).

Choices where treejax differs (stated): the probabilities are the policy's at temperature 1 (the forest's
``logprobs``; the code recomputes them at its sampling temperature 0.6, which its PPO also trains at); the
whitening runs over the whole batch (the code whitens each micro-batch of 8 responses); at most ``max_cuts`` cuts
per response (static shapes; the code has none: beyond the cap the last segment runs to the end, still an unbiased
``r - V(s_last)``); identical prefixes of different responses are not pooled into one estimate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import check_rewards, masked_whiten
from treejax.rl.advantages.registry import Advantages, register_estimator
from treejax.rl.advantages.spo import spo_probability_mask
from treejax.sampling.continuation import ContinuationConfig


@dataclasses.dataclass(frozen=True)
class SPOChainOptions:
    """``threshold`` rho, ``interval``, ``max_cuts`` and ``samples`` K: the cut points and the Monte-Carlo
    continuations (the rollout's :class:`~treejax.sampling.continuation.ContinuationConfig` is built from them,
    :meth:`continuation_config`); ``rows_per_round``: continuation rows decoded together (0: K x all leaves);
    ``prob_mask``: train only tokens with ``pi < threshold``; ``whiten``/``whiten_eps``: batch whitening."""

    threshold: float = 0.9
    interval: int = 5
    max_cuts: int = 8
    samples: int = 9
    rows_per_round: int = 0
    prob_mask: bool = True
    whiten: bool = True
    whiten_eps: float = 1e-8

    def __post_init__(self):
        self.continuation_config()  # the same checks

    def continuation_config(self) -> ContinuationConfig:
        return ContinuationConfig(threshold=self.threshold, interval=self.interval, max_cuts=self.max_cuts,
                                  samples=self.samples, rows_per_round=self.rows_per_round)


def chain_token_advantages(cut_PxWxB: jax.Array, value_PxWxB: jax.Array, rewards_PxW: jax.Array,
                           T: int) -> jax.Array:
    """``A [P, W, T]`` of the module docstring (before the mask and whitening): token ``t`` after cut ``k`` (the
    last cut ``s_k <= t``) gets ``V(s_{k+1}) - V(s_k)``, with ``V(s_n) = r``; 0 before the first cut."""
    valid = cut_PxWxB >= 0
    n = jnp.sum(valid, axis=-1)  # cuts per leaf (ascending, -1 padded at the end)
    t = jnp.arange(T)[None, None, :, None]
    at_or_before = valid[..., None, :] & (cut_PxWxB[..., None, :] <= t)  # [P, W, T, B]
    k = jnp.sum(at_or_before, axis=-1) - 1  # index of the last cut at or before t, -1 before the first
    v_here = jnp.take_along_axis(value_PxWxB, jnp.maximum(k, 0), axis=-1)
    nxt = k + 1
    v_next = jnp.where(nxt < n[..., None], jnp.take_along_axis(value_PxWxB, jnp.minimum(nxt, value_PxWxB.shape[-1]
                                                                                          - 1), axis=-1),
                       rewards_PxW[..., None])
    return jnp.where(k >= 0, v_next - v_here, 0.0)


@register_estimator("spo_chain", SPOChainOptions, inputs=("cut_PxWxB", "cut_value_PxWxB"))
def spo_chain(forest: Forest, rewards_PxW: jax.Array, options: SPOChainOptions = SPOChainOptions(), *,
              cut_PxWxB: jax.Array, cut_value_PxWxB: jax.Array) -> Advantages:
    """SPO-chain's segment advantages (module docstring) from the rollout's cut points and their Monte-Carlo
    values."""
    r = check_rewards(forest, rewards_PxW)
    P, W, T = forest.tokens.shape
    if cut_PxWxB.shape[:2] != (P, W) or cut_value_PxWxB.shape != cut_PxWxB.shape:
        raise ValueError(f"spo_chain: cut_PxWxB {cut_PxWxB.shape} and cut_value_PxWxB {cut_value_PxWxB.shape} "
                         f"must both be [P={P}, W={W}, B]")
    adv = chain_token_advantages(jnp.asarray(cut_PxWxB, jnp.int32), jnp.asarray(cut_value_PxWxB, jnp.float32), r, T)
    mask = forest.loss_mask
    if options.prob_mask:
        mask = spo_probability_mask(forest.logprobs, mask, options.threshold)
    adv = jnp.where(mask > 0, adv, 0.0)
    if options.whiten:
        adv = masked_whiten(adv, mask, eps=options.whiten_eps)
    return Advantages(tokens=adv, loss_mask=mask)


__all__ = ["SPOChainOptions", "chain_token_advantages", "spo_chain"]
