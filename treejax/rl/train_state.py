"""The trainer's state pytree: params, optimizer state and step counter."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from treejax.models import lora


@struct.dataclass
class TrainState:
    """Everything an update changes, as one pytree (jit in/out, donated, checkpointed as a whole).

    Attributes:
      params: the policy parameters (fp32 master weights when the model's ``param_dtype`` is float32); with LoRA
        the frozen base and the adapters in one tree (:mod:`treejax.models.lora`), of which only the adapters train.
      opt_state: the optax state of the optimizer built by ``treejax.rl.optimizer.make_optimizer``.
      step: int32 scalar, number of update calls made (skipped non-finite steps count too; the optimizer's own
        count in ``opt_state`` only advances on applied steps).
      aux: ``{name: state}`` of the stateful shapers (:mod:`treejax.rl.shaping`: an EMA baseline, an auxiliary
        head with its own optimizer state); ``{}`` without them. Replicated on a mesh; the PPO update passes it
        through and :func:`treejax.rl.step.learn` replaces it after the shapers ran.

    Randomness is not state: the loop derives each step's key as ``fold_in(key(RunConfig.seed), step)``.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    aux: Any = struct.field(default_factory=dict)

    @classmethod
    def create(cls, params: Any, optimizer: optax.GradientTransformation, aux: Any = None) -> "TrainState":
        """The optimizer's state covers the trainable params only: all of them, or the LoRA adapters when the
        params carry some (:func:`treejax.models.lora.split`; the frozen base has no moments)."""
        return cls(params=params, opt_state=optimizer.init(lora.split(params)[0]), step=jnp.zeros((), jnp.int32),
                   aux={} if aux is None else aux)
