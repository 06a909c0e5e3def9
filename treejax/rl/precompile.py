"""Compiling a packed run's other layouts ahead of time, in the background, so a layout growth never stalls a step.

A sticky packed run (:mod:`treejax.rl.packing`) fixes the row length ``L`` and the leaf slots ``Wr`` at its first
mini-batch; only the row count can grow, along a ladder known from the config (``R = row_multiple * 2^k``, up to
one tree per row: :meth:`treejax.rl.layouts.Packed.ladder`). Each rung is a new shape for the jitted update and
the old / reference log-prob pass, i.e. a compile (~7 s for SmolLM2 on an H200, more for larger models) in the
middle of the step that first needs it. :func:`precompile_ladder` compiles every other rung once, on a background
thread started when the first step has dispatched its update (so its compiles do not compete with the first
layout's own): ``jit(...).lower(abstract args).compile()`` of the same functions with
the same shardings, the rung's batch shapes obtained from the first batch by changing its leading (row) axis
(:func:`abstract_rows`). The executables are kept by argument signature (:class:`AheadOfTime`,
``treejax.parallel.mesh.sharded_update``) and called when a batch of that shape arrives; until then (or if a
compile fails, which is logged, not raised) the plain jitted function runs as before. The results are the same
programs, so losses and gradients are unchanged; the compiles only move off the step's critical path (XLA compiles
on the host's CPU cores while the device trains).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import jax

log = logging.getLogger(__name__)


def signature(args: tuple) -> tuple:
    """A call's key: the arguments' tree structure, shapes and dtypes."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class AheadOfTime:
    """A jitted function plus executables compiled ahead of time for argument shapes it may meet later.

    ``__call__`` runs the executable of the arguments' :func:`signature` when :meth:`precompile` made one, else
    the jitted function (which compiles and caches as usual). Thread-safe: :meth:`precompile` may run on another
    thread while the function is called."""

    def __init__(self, jitted: Callable):
        self.jitted = jitted
        self.compiled: dict = {}

    def __call__(self, *args):
        if self.compiled:
            key = signature(args)
            fn = self.compiled.get(key)
            if fn is not None:
                try:
                    return fn(*args)
                except ValueError as e:  # arguments placed unlike the abstract values it was compiled for
                    log.warning("ahead-of-time executable refused its arguments (%s); using the jitted function", e)
                    self.compiled.pop(key, None)
        return self.jitted(*args)

    def precompile(self, *abstract_args) -> None:
        """Compiles for ``abstract_args`` (``jax.ShapeDtypeStruct`` with shardings, or arrays)."""
        key = signature(abstract_args)
        if key not in self.compiled:
            self.compiled[key] = self.jitted.lower(*abstract_args).compile()


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` of every array of ``tree``, with its sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def abstract_rows(batch: Any, rows: int) -> Any:
    """``batch`` (every array with the row axis first) as abstract values with ``rows`` rows. An array placed on a
    mesh gets the sharding ``treejax.parallel.mesh.batch_sharding`` gives the new shape (rows over the batch axes
    where they divide it: what the learner's ``place`` will do); any other keeps its sharding."""
    from jax.sharding import NamedSharding

    from treejax.parallel.mesh import batch_sharding

    def one(x):
        shape = (rows,) + tuple(x.shape[1:])
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            sharding = batch_sharding(sharding.mesh, jax.ShapeDtypeStruct(shape, x.dtype))
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, batch)


def precompile_ladder(rungs: list[int], jobs: list[tuple[Callable, tuple, int]], *,
                      on_done: Callable[[int, float], None] | None = None,
                      stop: threading.Event | None = None) -> threading.Thread:
    """Starts a daemon thread that, for every row count in ``rungs``, calls ``precompile(*args)`` of each job
    ``(precompile, args, batch_position)`` with the argument at ``batch_position`` re-shaped to that row count
    (:func:`abstract_rows`). ``on_done(count, seconds)`` is called at the end. Failures are logged and skipped.
    ``stop`` (set by the run's end): no further compile starts; join the thread to wait for the one running."""

    def work():
        t0, done = time.perf_counter(), 0
        for rows in rungs:
            for precompile, args, at in jobs:
                if stop is not None and stop.is_set():
                    break
                args = list(args)
                args[at] = abstract_rows(args[at], rows)
                try:
                    precompile(*args)
                    done += 1
                except Exception as e:  # noqa: BLE001  a failed ahead-of-time compile only costs the stall it avoids
                    log.warning("packed layout with %d rows: ahead-of-time compile failed (%s: %s); it will compile "
                                "when first needed", rows, type(e).__name__, e)
        if on_done is not None:
            on_done(done, time.perf_counter() - t0)

    thread = threading.Thread(target=work, name="treejax-precompile", daemon=True)
    thread.start()
    return thread


__all__ = ["AheadOfTime", "abstract", "abstract_rows", "precompile_ladder", "signature"]
