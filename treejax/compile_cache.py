"""A persistent JAX compilation cache, on by default for runs: the second run of a config skips most compiles.

Every small CPU run used to recompile its programs (the eval decoder, the tree sampler, the update: minutes on a
2-core machine). :func:`enable_compilation_cache` points JAX's persistent cache at a folder in the user's cache
directory, so a second run with the same shapes loads the compiled executables instead.

Where, in order (the first that is set wins):

* ``TREEJAX_COMPILATION_CACHE``: ``off`` (or ``0``, ``false``, ``none``, empty) turns it off; anything else is
  the folder;
* ``JAX_COMPILATION_CACHE_DIR`` (JAX's own variable): left to JAX, treejax changes nothing;
* ``RunConfig.compilation_cache`` (gin): ``'auto'`` (default) = :func:`default_cache_dir`, ``'off'`` turns it
  off, anything else is the folder.

:func:`default_cache_dir` is ``$XDG_CACHE_HOME/treejax/jax`` (``~/.cache/treejax/jax``). JAX only caches programs
that took at least :data:`MIN_COMPILE_SECONDS` to compile; the folder can be deleted at any time.

:func:`compile_clock` counts the seconds the process spends making programs (JAX's own monitoring events: tracing
to a jaxpr, lowering to StableHLO, and the XLA compile or the persistent-cache load), which the training loop logs
as ``time/compile_s`` and ``time/compile_programs`` (running totals, under ``time/`` with the other
machine-dependent numbers that a resumed run need not repeat) so a run shows what its recompiles cost.
"""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["MIN_COMPILE_SECONDS", "COMPILE_EVENTS", "CompileClock", "compile_clock", "default_cache_dir",
           "enable_compilation_cache", "resolve_cache_dir"]

log = logging.getLogger(__name__)

#: Programs that compile faster than this are not written to the cache (JAX's own default is 1 s).
MIN_COMPILE_SECONDS = 0.5
_OFF = ("off", "0", "false", "no", "none", "")


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/treejax/jax``, ``~/.cache/treejax/jax`` without it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "treejax", "jax")


def resolve_cache_dir(setting: str | None = "auto") -> str | None:
    """The folder the cache should use for gin ``setting`` and the environment (module docstring); ``None``: off
    or left to JAX."""
    env = os.environ.get("TREEJAX_COMPILATION_CACHE")
    if env is not None:
        return None if env.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(env))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if setting is None or setting.strip().lower() in _OFF:
        return None
    return default_cache_dir() if setting == "auto" else os.path.abspath(os.path.expanduser(setting))


def enable_compilation_cache(setting: str | None = "auto") -> str | None:
    """Turns JAX's persistent compilation cache on for the folder :func:`resolve_cache_dir` gives (created);
    returns it, or ``None`` when the cache is off or left to ``JAX_COMPILATION_CACHE_DIR``. A folder that cannot
    be created turns the cache off with a warning (a cache never stops a run)."""
    import jax

    folder = resolve_cache_dir(setting)
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s)", folder, e.strerror)
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


#: JAX's monitoring events (``jax._src.dispatch``) whose durations :class:`CompileClock` sums; the last one is
#: recorded once per program (an XLA compile or a load from the persistent cache).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Running totals of program-making time: ``seconds`` (every :data:`COMPILE_EVENTS` duration) and ``programs``
    (backend compiles or cache loads). One listener per process (:func:`compile_clock`)."""

    def __init__(self):
        self.seconds = 0.0
        self.programs = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self.seconds += float(duration_secs)
                self.programs += event == COMPILE_EVENTS[-1]

    def totals(self) -> dict[str, float]:
        """``{"time/compile_s": seconds, "time/compile_programs": count}`` so far."""
        return {"time/compile_s": self.seconds, "time/compile_programs": self.programs}


_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
    """The process's :class:`CompileClock`, registered with ``jax.monitoring`` on first use."""
    global _CLOCK
    if _CLOCK is None:
        from jax import monitoring

        _CLOCK = CompileClock()
        monitoring.register_event_duration_secs_listener(_CLOCK)
    return _CLOCK
