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

Several processes of one run share the folder (:func:`claim_log_dir`): process 0 alone takes the lock and applies
the mode (an ``"overwrite"`` deletes files once, before any process writes), then tells the others whether the
folder is theirs, so a refused folder stops every process with the same message rather than leaving the others
waiting in the first collective. A multi-host run needs the folder on a file system every host sees (as orbax's
checkpoints do); flock on a network file system is only as reliable as that file system's locking.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from typing import Iterator

from treejax.errors import ConfigError, UserError

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
        os.write(fd, f"{os.getpid()} on {socket.gethostname()}".encode())
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


@contextlib.contextmanager
def claim_log_dir(log_dir: str, mode: str) -> Iterator[None]:
    """:class:`RunLock` + :func:`prepare_log_dir` for a run of one or several processes (module docstring).

    Process 0 locks and prepares ``log_dir``; its outcome is broadcast, so with several processes every process
    raises the same :class:`ConfigError` for a refused folder (process 0 re-raises its own exception). With one
    process this is exactly ``with RunLock(log_dir): prepare_log_dir(log_dir, mode)``.
    """
    from treejax.parallel import multihost

    lock = None
    error: BaseException | None = None
    if multihost.is_primary():
        try:
            lock = RunLock(log_dir).acquire()
            prepare_log_dir(log_dir, mode)
        except Exception as e:  # noqa: BLE001 -- told to the other processes, then re-raised
            if lock is not None:
                lock.release()
                lock = None
            if multihost.process_count() == 1:
                raise
            error = e
    kind_message = multihost.broadcast_text(
        None if error is None else ("user:" if isinstance(error, UserError) else "bug:") + str(error))
    if error is not None:
        raise error
    if kind_message is not None:
        kind, message = kind_message.split(":", 1)
        if kind == "user":
            raise ConfigError(message)
        raise RuntimeError(f"process 0 could not prepare the log folder {log_dir}: {message}")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
