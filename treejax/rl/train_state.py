"""The trainer's state pytree: params, optimizer state, step counter and PRNG key."""

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
      key: raw ``uint32[2]`` PRNG key (``jax.random.PRNGKey`` format, which checkpoints as a plain array).
        The update does not consume it; derive per-step keys with ``jax.random.fold_in(key, step)``.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    key: jax.Array

    @classmethod
    def create(cls, params: Any, optimizer: optax.GradientTransformation, key: jax.Array) -> "TrainState":
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                   key=jnp.asarray(key, jnp.uint32))
