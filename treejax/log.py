"""Logging for the main job: the ``treejax`` logger gets its own handler.

``logging.basicConfig`` does nothing once the root logger has a handler, and importing ``orbax.checkpoint``
installs one (leaving the root at WARNING), so ``basicConfig(level=INFO)`` in ``main()`` silently lost the
per-step lines. Instead the
``treejax`` logger (parent of every ``treejax.*`` module logger) gets its own stderr handler and does not
propagate, whatever a library did to the root logger.

From Python, :func:`treejax.rl.loop.run` calls :func:`show_progress`: unless the caller configured the
``treejax`` logger, its INFO records (the per-step lines) are made visible without taking them from the
handlers the caller's program already has (the root's, pytest's).
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "treejax"
FORMAT = "%(asctime)s %(message)s"
NOISY_LOGGERS = ("absl", "jax._src", "orbax", "grain")


class _TreejaxHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is emitted (pytest and notebooks replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        del value  # always the current sys.stderr


def configure_logging(quiet: bool = False, process: tuple[int, int] | None = None) -> logging.Logger:
    """Sends ``treejax.*`` records to stderr (INFO and up, WARNING and up when ``quiet``); returns the logger.

    ``process = (index, count)`` of a multi-process run (``count > 1``): every line is prefixed with
    ``[process i/N]``, and only process 0 logs INFO; the others log warnings and errors only (so a run's log is
    one process's, yet a failure on any process is visible).

    Idempotent: a second call replaces the handler of the first (its class marks it). The libraries of
    ``NOISY_LOGGERS`` are lowered to WARNING.
    """
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if isinstance(h, _TreejaxHandler)]:
        logger.removeHandler(handler)
    handler = _TreejaxHandler()
    multi = process is not None and process[1] > 1
    fmt = f"%(asctime)s [process {process[0]}/{process[1]}] %(message)s" if multi else FORMAT
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet or (multi and process[0] != 0) else logging.INFO)
    logger.propagate = False
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return logger


def show_progress() -> logging.Logger:
    """Makes the ``treejax`` logger's INFO records (progress lines) visible when nobody configured it.

    A logger with a handler or an explicit level of its own is left alone (``configure_logging`` ran, or the
    caller chose). Otherwise its level becomes INFO (records still propagate to the root's handlers, e.g. a
    ``logging.basicConfig`` of the caller's), and when no handler exists on the way to the root it gets the
    stderr handler of :func:`configure_logging`.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logger.level != logging.NOTSET:
        return logger
    logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        handler = _TreejaxHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    return logger
