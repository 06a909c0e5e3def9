"""Is the run healthy? The checks that stop or flag a diverged run.

* :func:`check_sampled_ids`: the sampler produced ids outside the vocabulary or non-finite log-probs (what a model
  with non-finite logits does) -> :class:`~treejax.errors.DivergenceError` before any text is decoded;
* :func:`divergence`: a step's host metrics look diverged (rules in its docstring) -> logged and listed in the
  summary, or raised with ``RunConfig.nonfinite = "raise"``;
* :func:`nonfinite_update_error`: the update's own non-finite check (a host callback) as a DivergenceError;
* :func:`out_of_memory_error`: a device out-of-memory error as a :class:`~treejax.errors.DeviceMemoryError` that
  names the settings bounding the failing program's memory.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import DeviceMemoryError, DivergenceError
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


def out_of_memory_error(e: BaseException, *, remat, micro_batches: int, packed: bool = False,
                        row_length: int | None = None):
    """The :class:`~treejax.errors.DeviceMemoryError` for a jax runtime error that says the device ran out of
    memory (XLA's ``RESOURCE_EXHAUSTED: Out of memory ...`` on a GPU or TPU, ``INTERNAL: ... Out of memory
    allocating N bytes`` from XLA:CPU, which names no program); ``None`` for any other error.

    The message keeps XLA's line (the allocation and the program, ``executable_name``) and, when the program is
    the update, the settings that bound its activations: ``remat`` (``RunConfig.remat``), ``micro_batches`` and,
    for the tree-packed update (``packed``; ``row_length``: its layout's row length when known), the fact that a
    packed row holds whole trees: a tree of ``L`` tokens (TreePO's 14 x 512 setting: ~100k) is one micro-batch's
    minimum whatever ``micro_batches`` is, so ``remat = 'full'`` (one layer's activations live at a time) is what
    bounds it."""
    text = str(e)
    found = (re.search(r"RESOURCE_EXHAUSTED: (Out of memory[^\n]*)", text)
             or re.search(r"(Out of memory allocating (\d+) bytes)", text))
    if not isinstance(e, RuntimeError) or found is None:
        return None
    line = found.group(1).split(" [tf-allocator")[0].split(" [executable_name")[0].rstrip(". ")
    if line.startswith("Out of memory allocating"):  # XLA:CPU: host memory, and no program named
        line += f" ({int(found.group(2)) / 2 ** 30:.1f} GiB of host memory)"
    program = re.search(r"executable_name='([^']+)'", text)
    if program is None:  # which program is unknown: the batch sizes and the update's settings both bound it
        fixes = ["smaller RunConfig.prompts_per_step / TreeConfig.num_leaves / EvalConfig.batch_size",
                 f"more RunConfig.micro_batches (now {micro_batches})"]
        fixes += [] if remat in ("full", True) else [f"RunConfig.remat = 'full' (now {remat!r})"]
        return DeviceMemoryError(f"the run ran out of memory in a compiled program: {line}; fixes: "
                                 + "; or ".join(fixes))
    program = program.group(1)
    if "update" not in program:
        return DeviceMemoryError(f"the device ran out of memory in {program}: {line}; the run's batch sizes bound "
                                 "its memory (RunConfig.prompts_per_step, TreeConfig.num_leaves, EvalConfig.batch_size)")
    fixes = [] if remat in ("full", True) else [f"RunConfig.remat = 'full' (now {remat!r})"]
    if packed:
        rows = f"rows of {row_length} tokens" if row_length else "rows"
        where = (f"the tree-packed update ran out of device memory in {program}: {line}. Its {rows} hold whole "
                 f"trees, which RunConfig.micro_batches (now {micro_batches}) cannot split")
        fixes += ["smaller trees (TreeConfig.max_depth, segment_length, num_leaves)",
                  "RunConfig.packed_update = False with more RunConfig.micro_batches"]
    else:
        where = f"the update ran out of device memory in {program}: {line}"
        fixes.insert(0, f"more RunConfig.micro_batches (now {micro_batches})")
    return DeviceMemoryError(f"{where}; fixes: " + "; or ".join(fixes))


__all__ = ["check_sampled_ids", "divergence", "nonfinite_update_error", "out_of_memory_error",
           "ENTROPY_UNIFORM_FRACTION", "PARAM_NORM_JUMP"]
