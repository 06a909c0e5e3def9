"""The shaping interface: what a shaper sees after the trainer's old-log-prob pass, what it returns, the registry.

A **shaper** rewrites the per-token advantages (and optionally each leaf's clip range) of one step *after* the
estimator and *after* the trainer's forward under the pre-update weights, so it can read statistics of the very
forward the PPO ratio is taken against, without a second forward::

    adv = estimator(forest, rewards)                               treejax.rl.advantages
    pool = layout.pool(rollouts, adv, ...)                        pairs of the step, the layout's full form
    old_logp, stats = trainer forward on the pool                  one pass (entropy, top-k log-probs)
    adv, eps_scale = shaper_n(... shaper_1(ShapingInputs))         this package, in RunConfig.shapers order
    PPO updates

Everything a shaper reads is in the forest's **response layout** ``[P, W, T]``: prompt ``p``, leaf ``w``, response
token ``t`` (the layout's pairs moved there by :meth:`treejax.rl.layouts.Layout.to_response`, and the shaped
advantages moved back), so a shaper never depends on the layout and both layouts shape bit-identically. Per-leaf
inputs are ``[P, W]``.

A shaper is a frozen (hashable) dataclass registered with :func:`register` (gin knows it by its class name:
``RunConfig.shapers = [@EchoShaping(), @RoseLengthPenalty()]``). It declares what it needs (``needs``: a subset of
:data:`STATS`, computed only when some shaper asks) and
implements ``shape(inputs) -> Shaped``. Shapers compose: each sees the previous one's advantages and clip scale.

A shaper may carry **state across steps** (``stateful = True``): an EMA baseline (VERL's effective-rank
channels) or a trainable auxiliary head with its own optimizer (ARRoL's quality head). ``init_state(hidden_size)``
builds it once; it lives in ``TrainState.aux[shaper.name]`` (checkpointed and restored with the run) and
``shape_stateful(inputs, state) -> (Shaped, new_state)`` replaces :meth:`Shaper.shape`. A state may also offer
the sampler a **probe** (:meth:`Shaper.probe`): a small pytree the branching rules read during decoding (the
quality head's weights for ARRoL's pruning, :mod:`treejax.sampling.probe`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from treejax.registry import Registry

#: Per-pair statistics a shaper may ask for (``Shaper.needs``), from the trainer's forward under the pre-update
#: weights (the pass that gives ``old_logp``): ``entropy``: ``H_t = -sum_v p_v log p_v`` of the next-token
#: distribution that produced the pair's token; ``topk``: its ``k`` largest log-probs ``log p_(1) >= ... >= log
#: p_(k)`` (``k = Shaper.top_k``; confidences such as DeepConf's or ECHO's are functions of them);
#: ``ref_logp``: the frozen reference policy's log-prob of the token (the KL reference, computed for shapers even
#: when ``LossConfig.kl_coef = 0``); ``hidden``: the last layer's output (after the final norm) at the token's own
#: position, ``[P, W, T, E]`` in the compute dtype (P W T E values: for hidden-state methods such as effective
#: rank or a quality head; mind the memory at long responses).
STATS = ("entropy", "topk", "ref_logp", "hidden")


@struct.dataclass
class ShapingInputs:
    """One step's pairs in response layout ``[P, W, T]`` (module docstring) and per-leaf values ``[P, W]``.

    ``advantages``/``loss_mask``: the estimator's (after leaf weighting and earlier shapers); ``old_logp``: the PPO
    ratio's denominator; ``entropy`` / ``topk_logp [P, W, T, k]`` / ``ref_logp`` / ``hidden [P, W, T, E]``:
    :data:`STATS` (``None`` unless a shaper needs them).
    ``leaf_path [P, W, D + 1]``: the forest's node ids per depth (-1 past a leaf's last node; a depth-``d`` node
    holds response tokens ``[(d - 1) S, d S)``, ``S`` = ``segment_length``).
    ``rewards``: the estimator's rewards; ``scores``: verifier scores in [0, 1] (correct iff >= 1; with
    pseudo-label rewards the pseudo-scores); ``leaf_length``: response tokens; ``answer_step``: the verifier's
    prefix hook, the first response token at which the correct answer is already in the text (-1: never;
    ``None`` unless a shaper needs it); ``step_scores [P, W, D]``: a PRM's score of each leaf's step (segment) ``k``
    (NaN past its steps; ``None`` unless the chain has the ``PRMStepsConfig`` stage); ``eps_scale``: the per-leaf
    clip-range multiplier so far.
    """

    advantages: jax.Array
    loss_mask: jax.Array
    old_logp: jax.Array
    rewards: jax.Array
    scores: jax.Array
    leaf_length: jax.Array
    eps_scale: jax.Array
    leaf_path: jax.Array
    entropy: jax.Array | None = None
    topk_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    hidden: jax.Array | None = None
    answer_step: jax.Array | None = None
    step_scores: jax.Array | None = None
    segment_length: int = struct.field(pytree_node=False, default=1)

    @property
    def on(self) -> jax.Array:
        """bool ``[P, W, T]``: pairs the loss trains."""
        return self.loss_mask > 0

    @property
    def t(self) -> jax.Array:
        """int32 ``[1, 1, T]``: the response token index of each position."""
        return jnp.arange(self.loss_mask.shape[-1], dtype=jnp.int32)[None, None, :]


@struct.dataclass
class Shaped:
    """A shaper's output: new ``advantages [P, W, T]`` (0 where the loss mask is 0), ``eps_scale [P, W]`` and
    scalar ``metrics`` (logged as ``shaping/<name>``); optionally a ``keep [P, W, T]`` mask (1 keeps a pair) that
    takes pairs out of the loss, numerator and denominator alike (DART's high-entropy steps); ``None``: all kept."""

    advantages: jax.Array
    eps_scale: jax.Array
    metrics: dict
    keep: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Shaper:
    """Base class of the shapers (module docstring)."""

    needs: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    masks: ClassVar[bool] = False  # True: shape() may return Shaped.keep (pairs out of the loss)

    @property
    def top_k(self) -> int:
        """``k`` of the ``"topk"`` statistic (when needed)."""
        return 0

    def shape(self, x: ShapingInputs) -> Shaped:
        raise NotImplementedError

    def init_state(self, hidden_size: int) -> Any:
        """The state of a ``stateful`` shaper before the first step (``hidden_size``: the model's ``E``)."""
        return None

    def shape_stateful(self, x: ShapingInputs, state: Any) -> tuple[Shaped, Any]:
        """:meth:`shape` for stateful shapers: also returns the state after this step (default: unchanged)."""
        return self.shape(x), state

    def probe(self, state: Any) -> Any:
        """What the sampler's branching rules may read of this shaper's state (``None``: nothing)."""
        return None

    def check_run(self, cfg: Any) -> None:
        """The shaper's checks against the whole run (``cfg``: the ``RunConfig``, called from its validation);
        raise :class:`~treejax.errors.ConfigError` with one line naming the fix. Default: none."""


def _check_needs(name: str, cls) -> None:
    bad = [s for s in cls.needs if s not in STATS]
    if bad:
        raise ValueError(f"shaper {name!r} needs unknown statistics {bad}; known: {STATS}")


#: Every shaper class by name (gin knows each by its class name).
SHAPERS: Registry[type] = Registry("shaper", base=Shaper, name_attrs=("name",), check=_check_needs)


def register(name: str, overwrite: bool = False):
    """Class decorator registering a :class:`Shaper` subclass (a frozen dataclass) under ``name`` (a second class
    under a taken name is an error unless ``overwrite=True``)."""
    return SHAPERS.register(name, overwrite=overwrite)


def shaper_classes() -> dict[str, type]:
    """``{name: class}`` of every registered shaper."""
    return SHAPERS.classes()


def check_shapers(shapers) -> tuple:
    """``shapers`` as a tuple of :class:`Shaper` instances; anything else is a ``ValueError`` naming the valid ones."""
    out = tuple(shapers)
    for s in out:
        if not isinstance(s, Shaper):
            classes = sorted(c.__name__ for c in SHAPERS.classes().values())
            raise ValueError(f"RunConfig.shapers takes Shaper instances (one of {classes}, "
                             f"e.g. [@EchoShaping()]), got {s!r}")
    names = [s.name for s in out if s.stateful]
    if len(names) != len(set(names)):
        raise ValueError(f"stateful shapers keep their state under their name: each may appear once, got {names}")
    return out


def init_states(shapers, hidden_size: int) -> dict:
    """``{name: state}`` of the stateful ``shapers`` (``TrainState.aux``)."""
    return {s.name: s.init_state(hidden_size) for s in shapers if s.stateful}


def probes(shapers, states: dict) -> dict:
    """``{name: probe}`` of the shapers that offer the sampler one (:meth:`Shaper.probe`)."""
    out = {}
    for s in shapers:
        if s.stateful and s.name in states:
            p = s.probe(states[s.name])
            if p is not None:
                out[s.name] = p
    return out


def needed_stats(shapers) -> tuple[tuple[str, ...], int]:
    """The statistics any of ``shapers`` needs (in :data:`STATS` order) and the largest top-k they ask for."""
    needs = {n for s in shapers for n in s.needs}
    return tuple(n for n in STATS if n in needs), max([s.top_k for s in shapers if "topk" in s.needs], default=0)


# ----------------------------------------------------------------------------------------------- helpers
def masked_mean(x: jax.Array, on: jax.Array, axis=None) -> jax.Array:
    """Mean of ``x`` over ``on`` (0 where nothing is on)."""
    on = on.astype(jnp.float32)
    return jnp.sum(jnp.where(on > 0, x, 0.0) * on, axis=axis) / jnp.maximum(jnp.sum(on, axis=axis), 1.0)


def whiten(x: jax.Array, on: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the pairs ``on`` of the whole step, ``var`` with Bessel's correction
    (verl's ``masked_whiten``, which ECHO calls); 0 off them."""
    n = jnp.sum(on.astype(jnp.float32))
    mu = masked_mean(x, on)
    var = jnp.sum(jnp.where(on, jnp.square(x - mu), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(on, (x - mu) * jax.lax.rsqrt(var + eps), 0.0)


def group_mean(x_PxW: jax.Array, on_PxW: jax.Array) -> jax.Array:
    """``[P]`` mean over each prompt's leaves ``on`` (0 when none is)."""
    return masked_mean(x_PxW, on_PxW, axis=1)


def correct(x: ShapingInputs) -> jax.Array:
    """bool ``[P, W]``: the leaf's score counts as correct (``>= 1``)."""
    return x.scores >= 1.0


__all__ = ["SHAPERS", "STATS", "ShapingInputs", "Shaped", "Shaper", "register", "shaper_classes", "check_shapers", "init_states",
           "probes",
           "needed_stats", "masked_mean", "whiten", "group_mean", "correct"]
