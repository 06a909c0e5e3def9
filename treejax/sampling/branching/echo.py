"""ECHO's entropy-confidence branching and pruning (user683/ECHO ``verl/workers/rollout/deepconf_branching.py``,
``DeepConfBranchController``), at segment boundaries.

Per token ``t`` of a path (windows are over the path's own tokens, shorter at its start):

    ``H_t``   policy entropy;
    ``C_t``   ``-(1/5) sum_{i <= 5} log(p_(i) + 1e-9)`` over the 5 most probable ids (DeepConf form: larger = more
              peaked);
    ``G_t``   group confidence, the mean of ``C`` over the last ``group_window`` tokens (``t`` included);
    ``Q_t``   tail confidence, the mean of ``C`` over the last ``tail_window`` tokens;
    ``dH_t``  ``H_t - mean(H over the previous entropy_window tokens)`` (0 at ``t = 0``).

Branch (``plan_branch``): the first token ``t >= min_depth`` with ``H_t >= entropy_high``, ``G_t <= tau_b`` and
``dH_t >= delta_min`` triggers, with width
    ``w = clip(round(1 + alpha (H_t - entropy_low) / (entropy_high - entropy_low) - beta (G_t - tau_b) / |tau_b|),
    1, max_branches)``.
Prune (``should_prune``) when, at some token: the running minimum of ``G`` is ``< prune_threshold``; or ``Q`` has
declined for ``>= tail_decline_steps`` consecutive tokens and ``Q_t <= tail_threshold``; or ``dH > 0`` for ``>=
delta_rise_steps`` consecutive tokens and ``dH_t > delta_upper``. Defaults are the code's ``DeepConfParams``.

**Adaptation to segment boundaries**: a live path's branch trigger is the first one among its last segment's tokens;
it may take ``w - 1`` extra children (ranked by ``w``, :func:`capped_allocation`; with ``spill`` the rest of the
budget is spread evenly so ECHO spends TreePO's budget). Pruning is checked at the boundary on every token of the
path so far (the code checks the whole trace too), and a pruned path keeps its segment's tokens as a ``PRUNED``
leaf (ECHO stops it at the token). ``H_t`` is the full-vocabulary entropy and ``C_t`` uses the full-vocabulary
log-probs (ECHO renormalises both over the top 64 ids first; for a peaked distribution the difference is small):
the sampler then stores 5 log-probs per token instead of 64.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from treejax.sampling.branching.base import BranchingRule, PathStats, capped_allocation, register, windowed_mean


@struct.dataclass
class TokenSignals:
    """Per-token ECHO signals ``[P, W, T]`` (module docstring) and the valid-token mask."""

    entropy: jax.Array
    confidence: jax.Array
    group: jax.Array
    tail: jax.Array
    delta_entropy: jax.Array
    valid: jax.Array


def _run_length(cond_PxWxT: jax.Array) -> jax.Array:
    """int32[P, W, T]: consecutive True entries ending at ``t`` (0 where False)."""
    t = jnp.arange(cond_PxWxT.shape[-1])
    last_false = lax.cummax(jnp.where(cond_PxWxT, -1, t[None, None, :]), axis=2)
    return jnp.where(cond_PxWxT, t[None, None, :] - last_false, 0)


@register("echo")
@dataclasses.dataclass(frozen=True)
class ECHO(BranchingRule):
    """ECHO's branching and pruning at segment boundaries (module docstring); ``pruning=False`` branches only."""

    min_depth: int = 4
    entropy_window: int = 4
    group_window: int = 4
    tail_window: int = 8
    tail_decline_steps: int = 3
    tail_threshold: float = 1.0
    delta_rise_steps: int = 3
    delta_upper: float = 0.5
    entropy_high: float = 3.5
    entropy_low: float = 1.0
    branch_threshold: float = 1.2
    entropy_delta_threshold: float = 0.2
    max_branches: int = 4
    alpha: float = 2.0
    beta: float = 1.0
    prune_threshold: float = 0.4
    confidence_top_k: int = 5
    pruning: bool = True
    spill: bool = True

    needs_entropy = True

    def __post_init__(self):
        if self.max_branches < 1 or self.confidence_top_k < 1:
            raise ValueError("ECHO.max_branches and ECHO.confidence_top_k must be >= 1")
        if min(self.entropy_window, self.group_window, self.tail_window) < 1:
            raise ValueError("ECHO windows must be >= 1")
        if not self.entropy_high > self.entropy_low:
            raise ValueError("ECHO.entropy_high must exceed ECHO.entropy_low")

    @property
    def top_k(self) -> int:  # type: ignore[override]
        return self.confidence_top_k

    @property
    def prunes(self) -> bool:  # type: ignore[override]
        return self.pruning

    def signals(self, stats: PathStats) -> TokenSignals:
        valid = stats.response_mask()
        length = stats.length_PxW
        h = jnp.where(valid, stats.entropy_PxWxT, 0.0)
        c = -jnp.mean(jnp.log(jnp.exp(stats.topk_PxWxTxK) + 1e-9), axis=-1)
        T, ew = h.shape[-1], self.entropy_window
        t = jnp.arange(T)
        cs = jnp.cumsum(h, axis=-1)
        before = jnp.pad(cs, ((0, 0), (0, 0), (1, 0)))[:, :, :T]  # sum_{u < t} H_u
        window_start = jnp.pad(cs, ((0, 0), (0, 0), (ew + 1, 0)))[:, :, :T]  # sum_{u < t - ew} H_u
        prev = (before - window_start) / jnp.maximum(jnp.minimum(t, ew), 1)[None, None, :]
        dh = jnp.where(valid & (t[None, None, :] > 0), h - prev, 0.0)
        return TokenSignals(entropy=h, confidence=c, group=windowed_mean(c, length, self.group_window),
                            tail=windowed_mean(c, length, self.tail_window), delta_entropy=dh, valid=valid)

    def width(self, h: jax.Array, g: jax.Array) -> jax.Array:
        """int32: ``w`` of the module docstring."""
        raw = (1.0 + self.alpha * (h - self.entropy_low) / (self.entropy_high - self.entropy_low)
               - self.beta * (g - self.branch_threshold) / max(abs(self.branch_threshold), 1e-9))
        return jnp.clip(jnp.round(raw), 1, self.max_branches).astype(jnp.int32)

    def branch_width(self, stats: PathStats) -> jax.Array:
        """int32[P, W]: the width at the first trigger token of the last segment (1 if none)."""
        s = self.signals(stats)
        t = jnp.arange(s.entropy.shape[-1])
        trig = (stats.segment_mask() & (t[None, None, :] >= self.min_depth) & (s.entropy >= self.entropy_high)
                & (s.group <= self.branch_threshold) & (s.delta_entropy >= self.entropy_delta_threshold))
        first = jnp.argmax(trig, axis=-1)[:, :, None]
        h_first = jnp.take_along_axis(s.entropy, first, -1)[..., 0]
        w = self.width(h_first, jnp.take_along_axis(s.group, first, -1)[..., 0])
        return jnp.where(jnp.any(trig, axis=-1), w, 1)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        w = self.branch_width(stats)
        return capped_allocation(w.astype(jnp.float32), w - 1, stats.live_PxW, total_P, spill=self.spill)

    def prune_flags(self, stats: PathStats) -> jax.Array:
        """bool[P, W]: some token of the path meets a pruning rule (module docstring)."""
        s = self.signals(stats)
        low = lax.cummin(jnp.where(s.valid, s.group, jnp.inf), axis=2) < self.prune_threshold
        decline = jnp.pad(s.tail[:, :, 1:] < s.tail[:, :, :-1], ((0, 0), (0, 0), (1, 0)))
        tail = (_run_length(decline & s.valid) >= self.tail_decline_steps) & (s.tail <= self.tail_threshold)
        rise = (_run_length((s.delta_entropy > 0) & s.valid) >= self.delta_rise_steps) & (
            s.delta_entropy > self.delta_upper)
        return jnp.any(s.valid & (low | tail | rise), axis=-1)

    def prune(self, stats: PathStats) -> jax.Array:
        return self.prune_flags(stats) if self.pruning else jnp.zeros_like(stats.live_PxW)
