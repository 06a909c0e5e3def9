"""Is the run healthy? The checks that stop or flag a diverged run.

* :func:`check_sampled_ids`: the sampler produced ids outside the vocabulary or non-finite log-probs (what a model
  with non-finite logits does) -> :class:`~treejax.errors.DivergenceError` before any text is decoded;
* :func:`divergence`: a step's host metrics look diverged (rules in its docstring) -> logged and listed in the
  summary, or raised with ``RunConfig.nonfinite = "raise"``;
* :func:`nonfinite_update_error`: the update's own non-finite check (a host callback) as a DivergenceError.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import DivergenceError
from treejax.forest import Forest


def check_sampled_ids(forest: Forest, vocab_size: int, step: int) -> None:
    """Raises :class:`~treejax.errors.DivergenceError` if the sampler produced ids outside the vocabulary or
    non-finite log-probs (what a model with non-finite logits does; decoding such ids would crash the tokenizer)."""
    # counted on the device: two replicated scalars come back, not the forest (which may span other processes)
    bad_ids, bad_logp = (int(v) for v in _bad_samples(forest.tokens, forest.logprobs, forest.segment_index,
                                                      vocab_size))
    if bad_ids or bad_logp:
        raise DivergenceError(f"step {step + 1}: the sampler produced {bad_ids} token ids outside the vocabulary "
                              f"and {bad_logp} non-finite log-probs: the policy has diverged (non-finite logits); "
                              "lower OptimizerConfig.learning_rate")


@functools.partial(jax.jit, static_argnums=3)
def _bad_samples(tokens, logprobs, segment_index, vocab_size: int):
    """(ids outside ``[0, vocab_size)``, non-finite log-probs) among the forest's valid tokens."""
    valid = segment_index >= 0
    bad_ids = jnp.sum(valid & ((tokens < 0) | (tokens >= vocab_size)))
    return bad_ids, jnp.sum(valid & ~jnp.isfinite(logprobs))


#: Divergence rules on a step's host metrics: entropy within 2% of the uniform distribution's ln(V), or the
#: parameter norm moving by more than half of its value in one step (typical AdamW steps move it by < 1%).
ENTROPY_UNIFORM_FRACTION = 0.98
PARAM_NORM_JUMP = 0.5


def divergence(row: dict, prev_param_norm: float | None, vocab_size: int,
               initial_entropy: float | None = None) -> str | None:
    """Why step ``row`` looks diverged (``None`` if it does not). The rules, first match wins:

    * the parameter norm after the update is not finite;
    * the policy entropy ``H >= 0.98 ln V`` (uniform over the vocabulary) — only when the run's first measured
      entropy ``initial_entropy`` was below that (a randomly initialised model starts uniform: that is no
      divergence); ``None``: unknown, the rule applies;
    * ``|norm - prev_param_norm| > 0.5 prev_param_norm``, where ``prev_param_norm`` is the norm after the previous
      step (before the first step: the initial, or restored, parameters' norm).

    ``update/entropy`` is measured in the update's forward, i.e. under the parameters before that step's update,
    and ``update/param_norm`` after it: a learning rate that wrecks the model in step ``s`` shows as a norm jump
    in step ``s`` and as entropy at ln V in step ``s + 1``.
    """
    ent, norm = row.get("update/entropy"), row.get("update/param_norm")
    if norm is not None and not np.isfinite(norm):
        return f"the parameter norm is {norm}"
    uniform = ENTROPY_UNIFORM_FRACTION * np.log(vocab_size)
    if ent is not None and ent >= uniform and (initial_entropy is None or initial_entropy < uniform):
        return f"the policy entropy {ent:.2f} is at the uniform distribution's ln(V) = {np.log(vocab_size):.2f}"
    if norm is not None and prev_param_norm and abs(norm - prev_param_norm) > PARAM_NORM_JUMP * prev_param_norm:
        return f"the parameter norm jumped from {prev_param_norm:.4g} to {norm:.4g} in one step"
    return None


def nonfinite_update_error(e: BaseException):
    """The :class:`~treejax.errors.DivergenceError` for a jax runtime error that carries the update's
    ``nonfinite='raise'`` check (:func:`treejax.rl.update._raise_nonfinite`, raised in a host callback, so it
    reaches the loop wrapped in jax's error with a traceback as text); ``None`` for any other error."""
    found = re.search(r"FloatingPointError: (non-finite update at step \d+[^\n]*)", str(e))
    if not isinstance(e, RuntimeError) or found is None:
        return None
    what = found.group(1).split("; params and optimizer state")[0]
    return DivergenceError(f"{what}; stopped before export (nonfinite='raise'); lower OptimizerConfig.learning_rate")


__all__ = ["check_sampled_ids", "divergence", "nonfinite_update_error", "ENTROPY_UNIFORM_FRACTION", "PARAM_NORM_JUMP"]
