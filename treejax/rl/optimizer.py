"""The policy optimizer: optax chain of global-norm clipping and AdamW with warmup + decay and a decay mask.

    g      <- g * min(1, max_grad_norm / ||g||_2)                     (global norm over every leaf)
    m, v   <- Adam moments of g (b1, b2, eps)
    theta  <- theta - lr_t * (m_hat / (sqrt(v_hat) + eps) + wd * mask * theta)   (decoupled weight decay,
                                                                               Loshchilov & Hutter 2019)
    lr_t   = lr * t / warmup                                   for t < warmup (linear warmup from 0)
           = lr * decay((t - warmup) / (total - warmup))       afterwards, decay in {cosine, linear, constant}
             cosine: f + (1 - f) * (1 + cos(pi u)) / 2;  linear: 1 - (1 - f) u;  constant: 1   (f = end_lr_factor)

Weight decay skips normalisation weights and biases (HF/verl convention: "bias" and "LayerNorm.weight" get no
decay): a leaf is decayed iff its name contains no ``norm``/``bias``/``scale``, is not a q/k/v/o bias
(``bq``, ``bk``, ``bv``, ``bo``) and it has at least 2 dimensions besides a leading stacked ``layers`` axis.
Embeddings are decayed (as in HF Trainer and verl).

Precision: master weights, gradients and both Adam moments are fp32 when the params are fp32
(``ModelConfig(param_dtype="float32", compute_dtype="bfloat16")`` gives fp32 master weights with bf16 matmuls:
the model casts each weight to the activation dtype where it is used, so gradients flow back to fp32).
``moments_dtype`` can store ``m`` in bf16 to save memory; updates are still computed in fp32.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from treejax.choices import check_choice
from treejax.config_types import check_types

DECAY_SCHEDULES = ("cosine", "linear", "constant")
_NO_DECAY_NAME = re.compile(r"(norm|bias|scale)|^b[qkvo]$")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + schedule + clipping hyper-parameters (TreePO's run: lr 1e-6, warmup 10, wd 0.1, clip 1.0)."""

    learning_rate: float = 1e-6
    warmup_steps: int = 10
    total_steps: int = 1000
    decay: str = "constant"
    end_lr_factor: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    moments_dtype: str | None = None  # None: same dtype as the params; "bfloat16" to halve m's memory
    proximal_ewma: float | None = None  # PPO-EWMA: keep an EMA of the params with this decay (old_logp = "ewma")

    def __post_init__(self):
        check_types(self)  # OptimizerConfig(learning_rate="1e-5") names the field, not a failed comparison
        check_choice("OptimizerConfig.decay", self.decay, DECAY_SCHEDULES)
        check_choice("OptimizerConfig.moments_dtype", self.moments_dtype, (None, "float32", "bfloat16", "float16"))
        if self.learning_rate < 0 or self.weight_decay < 0:
            raise ValueError("OptimizerConfig.learning_rate and weight_decay must be >= 0")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"OptimizerConfig: warmup_steps >= 0 and total_steps >= 1 needed, got "
                             f"{self.warmup_steps}, {self.total_steps}")
        if self.decay != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"OptimizerConfig.total_steps ({self.total_steps}) must exceed warmup_steps "
                             f"({self.warmup_steps}) for a {self.decay} decay")
        if not 0.0 <= self.end_lr_factor <= 1.0:
            raise ValueError(f"OptimizerConfig.end_lr_factor must be in [0, 1], got {self.end_lr_factor}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.proximal_ewma is not None and not 0.0 <= self.proximal_ewma < 1.0:
            raise ValueError(f"OptimizerConfig.proximal_ewma must be in [0, 1) or None, got {self.proximal_ewma}")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``learning_rate`` over ``warmup_steps``, then the configured decay to
    ``end_lr_factor * learning_rate`` at ``total_steps`` (held there afterwards)."""
    lr, f = config.learning_rate, config.end_lr_factor
    decay_steps = max(config.total_steps - config.warmup_steps, 1)
    if config.decay == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=f)
    elif config.decay == "linear":
        after = optax.linear_schedule(lr, lr * f, decay_steps)
    else:
        after = optax.constant_schedule(lr)
    if config.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, lr, config.warmup_steps)
    return optax.join_schedules([warm, after], [config.warmup_steps])


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def weight_decay_mask(params: Any) -> Any:
    """Pytree of bools like ``params``: True where decoupled weight decay applies (rule in module docstring)."""

    def decide(path, leaf) -> bool:
        names = [_key_name(p) for p in path]
        leaf_name = names[-1] if names else ""
        if _NO_DECAY_NAME.search(leaf_name):
            return False
        ndim = len(getattr(leaf, "shape", ()))
        if "layers" in names[:-1]:
            ndim -= 1  # stacked per-layer axis
        return ndim >= 2

    return jax.tree_util.tree_map_with_path(decide, params)


class ProximalEWMAState(NamedTuple):
    """:func:`proximal_ewma`'s state: the exponential moving average of the parameters (shaped like them, so it is
    sharded, checkpointed and restored with the optimizer state)."""

    ewma_params: Any


def proximal_ewma(decay: float) -> optax.GradientTransformation:
    """PPO-EWMA's proximal policy (Hilton, Cobbe and Schulman 2021, "Batch size-invariance for policy
    optimization", arXiv 2110.00641): an exponential moving average of the parameters after every applied update,

        theta_prox <- decay theta_prox + (1 - decay) (theta + u)        (u: this update, theta + u the new params)

    starting at the initial parameters. A pass-through for the updates themselves (the last link of the chain,
    where ``u`` is final); a skipped non-finite update leaves it unchanged with the rest of the optimizer state.
    ``RunConfig.old_logp = "ewma"`` computes the PPO ratio's denominator with ``theta_prox``
    (:func:`proximal_params`), so the clip keeps the policy near an average of its recent versions instead of the
    last one; the behaviour correction ``min(pi_prox / q, C)`` is ``LossConfig.tis_cap``'s."""

    def init(params):
        return ProximalEWMAState(ewma_params=jax.tree.map(jnp.copy, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("proximal_ewma needs the params: call optimizer.update(grads, state, params)")
        ewma = jax.tree.map(lambda e, p, u: (decay * e + (1.0 - decay) * (p + u)).astype(e.dtype),
                            state.ewma_params, params, updates)
        return updates, ProximalEWMAState(ewma_params=ewma)

    return optax.GradientTransformation(init, update)


def proximal_params(opt_state: Any) -> Any:
    """The EWMA parameters of :func:`proximal_ewma` inside an optimizer state (a ``ValueError`` without it)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ProximalEWMAState))
             if isinstance(s, ProximalEWMAState)]
    if len(found) != 1:
        raise ValueError("the optimizer keeps no EWMA of the parameters: set OptimizerConfig.proximal_ewma "
                         "(e.g. 0.9) for RunConfig.old_logp = 'ewma'")
    return found[0].ewma_params


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw(schedule, mask=weight_decay_mask)`` (math in the module docstring), then
    with ``proximal_ewma`` the parameters' EMA (:func:`proximal_ewma`)."""
    mu_dtype = None if config.moments_dtype is None else jnp.dtype(config.moments_dtype)
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
            weight_decay=config.weight_decay, mask=weight_decay_mask, mu_dtype=mu_dtype,
        )
    )
    if config.proximal_ewma is not None:
        parts.append(proximal_ewma(config.proximal_ewma))
    return optax.chain(*parts)
