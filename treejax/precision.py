"""The precision policy: one object decides every dtype of a run, so kernels never see mixed inputs by accident.

Roles (mixed-precision training as in Micikevicius et al. 2018; MaxText's ``weight_dtype`` / ``dtype``)::

    param_dtype       master weights and optimizer state (fp32: updates of size lr * O(1) must not round away)
    compute_dtype     activations and matmul inputs of the update's forward/backward and of the sampler
    sampler_dtype     the weight copy the sampler reads, cast ONCE per RL step (not per token)
    cache_dtype       the sampler's KV cache (equal to the compute dtype by default: the decode attention then
                      sees queries and keys of one dtype)
    matmul_precision  how float32 matmuls run: "highest" = full fp32 products; "tensorfloat32" = TF32 (GPU) /
                      bf16x3 passes (TPU); "default" = the backend's default (TF32 on Ampere+/Hopper GPUs)

``"auto"`` resolves per platform: bf16 compute, sampler weights and cache on GPU/TPU, fp32 everywhere on CPU;
matmul precision "highest" when the compute dtype is float32 (so "fp32" means fp32 on a GPU too: XLA would
otherwise run fp32 products as TF32 and lose about three digits), "default" for 16-bit compute (bf16 products
with fp32 accumulation).

bf16 master weights and small learning rates. A bf16 number has 8 significant bits: the spacing of weights of
magnitude ``|w|`` is ``ulp(w) = 2^(floor(log2 |w|) - 7)``, and an update smaller than half of it rounds away
(round to nearest even). Adam's per-step update has magnitude ~``lr``, so with bf16 ``param_dtype`` a learning
rate below ``ulp(median |w|) / 2`` leaves most weights unchanged: :func:`warn_if_updates_round_away` says so
with both numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treejax.choices import check_choice

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
MATMUL_PRECISIONS = ("highest", "tensorfloat32", "default")


@dataclasses.dataclass(frozen=True)
class Precision:
    """The gin-facing precision policy (``RunConfig.precision``); ``"auto"`` fields resolve per platform."""

    param_dtype: str = "float32"
    compute_dtype: str = "auto"
    sampler_dtype: str = "auto"
    cache_dtype: str = "auto"
    matmul_precision: str = "auto"

    def __post_init__(self):
        check_choice("Precision.param_dtype", self.param_dtype, DTYPES)
        for name in ("compute_dtype", "sampler_dtype", "cache_dtype"):
            check_choice(f"Precision.{name}", getattr(self, name), ("auto", *DTYPES))
        check_choice("Precision.matmul_precision", self.matmul_precision, ("auto", *MATMUL_PRECISIONS))

    def resolve(self, backend: str | None = None) -> "ResolvedPrecision":
        """Concrete dtypes for ``backend`` (default: ``jax.default_backend()``)."""
        backend = backend or jax.default_backend()
        compute = self.compute_dtype
        if compute == "auto":
            compute = "float32" if backend == "cpu" else "bfloat16"
        sampler = compute if self.sampler_dtype == "auto" else self.sampler_dtype
        cache = compute if self.cache_dtype == "auto" else self.cache_dtype
        matmul = self.matmul_precision
        if matmul == "auto":
            matmul = "highest" if compute == "float32" else "default"
        return ResolvedPrecision(self.param_dtype, compute, sampler, cache, matmul)


@dataclasses.dataclass(frozen=True)
class ResolvedPrecision:
    """A :class:`Precision` with every ``"auto"`` replaced by a dtype / precision name (hashable)."""

    param_dtype: str
    compute_dtype: str
    sampler_dtype: str
    cache_dtype: str
    matmul_precision: str

    def matmul_context(self):
        """Context under which jitted programs are traced: float32 matmuls run at ``matmul_precision``.

        ``jax.default_matmul_precision`` is part of jit's cache key, so programs traced inside and outside
        the context never share a compiled executable. ``"default"`` is set too (XLA's default: TF32 for float32
        on a GPU), so the model's entry points (:func:`apply_policy`) see it was asked for."""
        return jax.default_matmul_precision(self.matmul_precision)

    def sampler_params(self, params: Any) -> Any:
        """The weight copy the sampler reads (a cast of the floating leaves; identity when dtypes agree)."""
        return cast_floating(params, self.sampler_dtype)


def policy_matmul_precision(compute_dtype) -> str | None:
    """The matmul precision the policy gives a program computing in ``compute_dtype``: ``"highest"`` for float32
    (so fp32 is not silently TF32 on a GPU, whose XLA default it is), ``None`` (leave the default) for 16-bit
    compute, and ``None`` whenever a precision was already asked for (``jax.default_matmul_precision(...)``, the
    ``jax_default_matmul_precision`` flag, or the trainer's :meth:`ResolvedPrecision.matmul_context`, e.g.
    ``Precision.matmul_precision = 'tensorfloat32'``): an explicit choice always wins."""
    if jax.config.jax_default_matmul_precision is not None:
        return None
    return "highest" if jnp.dtype(compute_dtype) == jnp.float32 else None


def apply_policy(fn):
    """Decorates a public model entry point ``fn(params, config, ...)`` (forward, prefill, decode step, logits,
    log-prob head) so its matmuls follow :func:`policy_matmul_precision` of ``config.compute_dtype``, also when
    called directly from Python or a notebook (and so inside ``generate`` and the tree rollout, which call them)."""
    @functools.wraps(fn)
    def wrapped(params, config, *args, **kwargs):
        precision = policy_matmul_precision(config.compute_dtype)
        if precision is None:
            return fn(params, config, *args, **kwargs)
        with jax.default_matmul_precision(precision):
            return fn(params, config, *args, **kwargs)

    return wrapped


def current_matmul_precision() -> str | None:
    """The matmul precision in effect where this is called (``jax.default_matmul_precision``'s context or the
    ``jax_default_matmul_precision`` flag; None: the backend's default)."""
    return jax.config.jax_default_matmul_precision


def matmul_precision_scope(precision: str | None):
    """``jax.default_matmul_precision(precision)``, or no change for None.

    A ``jax.custom_vjp``'s backward function is traced when the gradient is transposed, after the entry point
    that called it has returned (and left :func:`apply_policy`'s context): a gradient taken outside the trainer,
    ``jax.grad(lambda h: token_logprobs(params, config, h, t).sum())``, would trace its matmuls at the backend's
    default (TF32 on a GPU). The entry point passes :func:`current_matmul_precision` to the custom_vjp as a
    static argument, and the backward re-enters it here. (Autodiff's own transposes need nothing: each
    ``dot_general`` carries the precision it was traced with, and its transpose copies it.)"""
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def cast_floating(tree: Any, dtype: str) -> Any:
    """Casts the floating-point leaves of ``tree`` to ``dtype`` (others, and leaves already in it, unchanged)."""
    dt = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt else x

    return jax.tree.map(cast, tree)


def bf16_update_resolution(params: Any, dtype: str = "bfloat16", sample: int = 1 << 16) -> float:
    """Half the spacing of ``dtype`` numbers at the median ``|w|`` of the weight matrices (ndim >= 2).

    An optimizer update below this value leaves a median-sized weight unchanged (round to nearest)."""
    mant = {"bfloat16": 8, "float16": 11, "float32": 24}[dtype]
    mats = [np.asarray(jax.device_get(x)).ravel() for x in jax.tree.leaves(params) if np.ndim(x) >= 2]
    if not mats:
        return 0.0
    vals = np.concatenate([m[:: max(1, m.size // sample)] for m in mats]).astype(np.float32)
    vals = np.abs(vals[vals != 0])
    if vals.size == 0:
        return 0.0
    med = float(np.median(vals))
    return 2.0 ** (math.floor(math.log2(med)) - (mant - 1)) / 2


def warn_if_updates_round_away(params: Any, param_dtype: str, learning_rate: float) -> str | None:
    """Logs (and returns) a warning when 16-bit master weights cannot represent updates of size ``learning_rate``."""
    if param_dtype == "float32":
        return None
    res = bf16_update_resolution(params, param_dtype)
    if learning_rate >= res:
        return None
    msg = (f"param_dtype={param_dtype} with learning rate {learning_rate:g}: updates below {res:.3g} (half the "
           f"{param_dtype} spacing at the median weight magnitude) round away, so most weights will not change; "
           "keep fp32 master weights (Precision.param_dtype='float32', the default) and set a 16-bit "
           "Precision.compute_dtype instead")
    log.warning(msg)
    return msg
