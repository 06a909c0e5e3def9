"""A run's log folder: what is already in it, what a new run may do with it, and a lock for the run.

A folder holds a *finished* run once ``summary.json`` is written (the last thing a run does); an *unfinished* run
has checkpoints but no summary (preempted or killed). ``RunConfig.log_dir_mode``:

* ``"new"`` (default): an empty folder starts a run, an unfinished run resumes from its newest checkpoint (as a
  preempted job's rerun should), and a finished run is refused — rerunning a command must never silently train
  nothing and overwrite the summary;
* ``"resume"``: continue whatever is there (e.g. a finished run with a larger ``RunConfig.num_steps``);
* ``"overwrite"``: delete the previous run's files (only a folder that looks like a treejax run) and start over.

:class:`RunLock` holds an exclusive ``flock`` on ``log_dir/.treejax.lock`` for the whole run, so a second run in
the same folder fails at once with the first run's pid instead of corrupting its checkpoints and event files.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from treejax.errors import ConfigError

LOG_DIR_MODES = ("new", "resume", "overwrite")
_RUN_FILES = ("summary.json", "checkpoints", "operative_config.gin", "failure.json")
LOCK_NAME = ".treejax.lock"


def is_finished(log_dir: str) -> bool:
    return os.path.isfile(os.path.join(log_dir, "summary.json"))


def prepare_log_dir(log_dir: str, mode: str) -> None:
    """Applies ``mode`` to ``log_dir`` (module docstring); raises :class:`ConfigError` for a refused folder."""
    if mode not in LOG_DIR_MODES:
        raise ConfigError(f"RunConfig.log_dir_mode must be one of {LOG_DIR_MODES}, got {mode!r}")
    if not os.path.isdir(log_dir):
        return
    if mode == "overwrite":
        entries = os.listdir(log_dir)
        if entries and not any(e in _RUN_FILES or e.startswith("events.out.tfevents") for e in entries):
            raise ConfigError(f"refusing to overwrite {log_dir}: it does not look like a treejax run folder "
                              f"(no summary.json, checkpoints/ or event files); choose another RunConfig.log_dir")
        for e in entries:
            if e == LOCK_NAME:
                continue
            path = os.path.join(log_dir, e)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    elif mode == "new" and is_finished(log_dir):
        raise ConfigError(f"{log_dir} already holds a finished run; pass --resume to continue it (e.g. with a "
                          "larger RunConfig.num_steps), --overwrite to start over, or choose another "
                          "RunConfig.log_dir (gin: RunConfig.log_dir_mode = 'resume' | 'overwrite')")


class RunLock:
    """Exclusive lock on a log folder for the lifetime of a run (``with RunLock(dir): ...`` or acquire/release)."""

    def __init__(self, log_dir: str):
        self.path = os.path.join(log_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"another treejax run (pid {holder}) is using the log folder "
                              f"{os.path.dirname(self.path)}; wait for it or choose another RunConfig.log_dir")
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
