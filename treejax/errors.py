"""Errors by kind: what the user asked for is wrong (:class:`UserError`) versus a bug.

``treejax-train`` prints a :class:`UserError` as one line ``treejax-train: error: ...`` (exit status 2); every
other exception keeps its full traceback (exit status 1), so a ``ValueError`` raised inside jax is never mistaken
for a typo in a config. Each subclass also derives from the builtin it replaces (``ValueError``,
``FileNotFoundError``), so code that catches the builtin keeps working.

:func:`record_failure` writes ``failure.json`` next to a run's logs when the run stops on an exception.
"""

from __future__ import annotations

import json
import os
import time
import traceback

__all__ = ["ConfigError", "DataError", "DeviceMemoryError", "DivergenceError", "IsolationUnavailableError",
           "ModelFileError", "UserError", "UserFileError", "record_failure"]


class UserError(Exception):
    """Something the user asked for is invalid; the message alone says what and how to fix it."""


class ConfigError(UserError, ValueError):
    """The run's configuration (gin files, ``--gin_param``, environment variables): gin syntax, an unknown
    configurable or parameter, a value of the wrong type or out of range."""


class DataError(UserError, ValueError):
    """A task or dataset: an unknown name or invalid task options."""


class DivergenceError(UserError, FloatingPointError):
    """Training diverged (invalid sampled ids, non-finite log-probs, entropy at the uniform distribution, a
    parameter-norm jump): the run stops before anything is exported. Usually the learning rate is too high."""


class DeviceMemoryError(UserError, MemoryError):
    """A program of the run needs more accelerator memory than the device has; the message names the program,
    the allocation and the settings that bound its memory."""


class IsolationUnavailableError(UserError, RuntimeError):
    """The code tool's sandbox (:mod:`treejax.envs.sandbox`) found no isolation layer it can use on this machine;
    the message says why and what to install (or how to opt out inside a container of one's own)."""


class UserFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (a gin file, a task file)."""


class ModelFileError(UserFileError):
    """A model name or path that names no embedded model, checkpoint folder or ``.gguf`` file."""


def record_failure(log_dir: str, step: int | None, exc: BaseException, process: int | None = None) -> str:
    """Writes ``log_dir/failure.json`` for a run that stopped on ``exc`` at ``step``; returns its path.

    ``process``: the index of the failing process in a multi-process run; process ``i > 0`` writes
    ``failure.process{i}.json`` so processes sharing the folder never overwrite each other's record.

    The record holds ``step``, ``type`` (qualified class name), ``message``, ``user_error`` (whether ``exc`` is a
    :class:`UserError`), ``traceback`` (the formatted text) and ``time`` (local ISO 8601 with offset).
    """
    os.makedirs(log_dir, exist_ok=True)
    cls = type(exc)
    record = {
        "step": step,
        "type": cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}",
        "message": str(exc),
        "user_error": isinstance(exc, UserError),
        "traceback": "".join(traceback.format_exception(exc)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = os.path.join(log_dir, "failure.json" if not process else f"failure.process{process}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path
