"""The estimator interface and its name registry.

Every advantage estimator is one pure function

    fn(forest: Forest, rewards_PxW: Array, options: OptionsCls, **inputs) -> Advantages

registered by name with :func:`register_estimator`. ``options`` is a frozen (hashable) dataclass, so it is
static under ``jax.jit`` (pass it with ``static_argnames="options"`` or close over it). ``inputs`` are extra
*arrays* an estimator needs beyond the forest and the rewards (e.g. ReMax's ``greedy_reward_P``); each
estimator lists them in ``EstimatorSpec.inputs`` so a trainer knows what to supply. The registry is read once
when a config is built (``get_estimator(name)``), never inside compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import struct

from treejax.registry import Registry


@struct.dataclass
class Advantages:
    """Output of every estimator.

    * ``tokens``    [P, W, T] per-token advantages, exactly 0 where ``loss_mask`` is 0;
    * ``loss_mask`` [P, W, T] the mask the policy loss must use: the forest's ``loss_mask`` possibly narrowed by
      the estimator (SPO's probability mask, MC-GRPO's excluded pivot rollout);
    * ``leaves``    [P, W] one scalar per leaf for estimators that give one (final, i.e. after whitening),
      else ``None``;
    * ``segments``  [P, W, D] per-segment advantages *before* any batch whitening for segment-level estimators
      (0 past a leaf's last segment), else ``None``;
    * ``clip_scale`` [P, W, T] an optional per-token multiplier of both PPO clip ranges (A2TGPO's adaptive turn
      clip), exactly 1 where ``loss_mask`` is 0 (observations, padding), else ``None`` (no per-token clip; the
      learner then builds exactly the programs it builds without this field). The learner carries it per
      (leaf, token) pair through either layout to ``policy_loss(..., eps_scale_BxT=...)``, where it multiplies
      any per-sequence clip scale (``StepConfig.clip_scale_fn``, the shapers' ``eps_scale``).
    """

    tokens: jax.Array
    loss_mask: jax.Array
    leaves: jax.Array | None = None
    segments: jax.Array | None = None
    clip_scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator: its function, its options dataclass and the names of its extra array inputs."""

    name: str
    fn: Callable[..., Advantages]
    options_cls: type
    inputs: tuple[str, ...] = ()
    ragged: bool = False  # honours unused leaf slots (leaf_path[..., 0] = -1): prompt-level allocation's groups

    def default_options(self, **overrides: Any):
        return self.options_cls(**overrides)


#: Every estimator by name (``get`` raises a ``KeyError`` listing the valid names, closest first).
ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator", identity=lambda spec: spec.fn)
_REGISTRY = ESTIMATORS  # the name tests and notebooks use to undo a registration (``_REGISTRY.pop(name)``)


def register_estimator(name: str, options_cls: type, inputs: tuple[str, ...] = (), *, ragged: bool = False,
                       overwrite: bool = False):
    """Decorator registering ``fn`` under ``name``. ``options_cls`` must be a frozen dataclass. ``ragged``: the
    estimator honours unused leaf slots (``leaf_path[p, w, 0] = -1``: no rollout there; every group statistic
    runs over the used slots only and unused slots get 0), so prompts may hold different numbers of rollouts
    (prompt-level allocation, :mod:`treejax.rl.allocation`).

    Registering a second function under an existing name is an error (names are the gin-facing API), unless
    ``overwrite=True`` (a notebook cell run twice, or a deliberate replacement).
    """
    if not (dataclasses.is_dataclass(options_cls) and options_cls.__dataclass_params__.frozen):
        raise TypeError(f"options for estimator {name!r} must be a frozen dataclass, got {options_cls!r}")

    def decorator(fn):
        ESTIMATORS.add(name, EstimatorSpec(name=name, fn=fn, options_cls=options_cls, inputs=tuple(inputs),
                                           ragged=ragged), overwrite=overwrite)
        return fn

    return decorator


def estimator_spec(name: str) -> EstimatorSpec:
    """The :class:`EstimatorSpec` registered under ``name``; unknown names raise a ``KeyError`` listing valid ones."""
    return ESTIMATORS.get(name)


def get_estimator(name: str) -> Callable[..., Advantages]:
    """The estimator function registered under ``name`` (see :func:`estimator_spec` for its options class)."""
    return estimator_spec(name).fn


def list_estimators() -> list[str]:
    return ESTIMATORS.names()
