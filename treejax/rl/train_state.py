"""The trainer's state pytree: params, optimizer state and step counter."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class TrainState:
    """Everything an update changes, as one pytree (jit in/out, donated, checkpointed as a whole).

    Attributes:
      params: the policy parameters (fp32 master weights when the model's ``param_dtype`` is float32).
      opt_state: the optax state of the optimizer built by ``treejax.rl.optimizer.make_optimizer``.
      step: int32 scalar, number of update calls made (skipped non-finite steps count too; the optimizer's own
        count in ``opt_state`` only advances on applied steps).

    Randomness is not state: the loop derives each step's key as ``fold_in(key(RunConfig.seed), step)``.
    """

    params: Any
    opt_state: Any
    step: jax.Array

    @classmethod
    def create(cls, params: Any, optimizer: optax.GradientTransformation) -> "TrainState":
        return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
