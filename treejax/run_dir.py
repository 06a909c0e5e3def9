"""A run's log folder: what is already in it, what a new run may do with it, and a lock for the run.

A folder holds a *finished* run once ``summary.json`` is written (the last thing a run does); an *unfinished* run
has checkpoints but no summary (preempted or killed). ``RunConfig.log_dir_mode``:

* ``"new"`` (default): an empty folder starts a run, an unfinished run resumes from its newest checkpoint (as a
  preempted job's rerun should), and a finished run is refused — rerunning a command must never silently train
  nothing and overwrite the summary;
* ``"resume"``: continue whatever is there (e.g. a finished run with a larger ``RunConfig.num_steps``);
* ``"overwrite"``: delete the previous run's files and start over: only the entries a run writes
  (:data:`RUN_ENTRIES`: summary, checkpoints, event files, pictures, export, ...) are deleted; anything else in
  the folder (a user's ``thesis.tex``) is kept and named in the log, and a folder holding no run is refused.

``"resume"`` into a folder with no run is an error naming the runs next to it (a mistyped folder must not silently
start a fresh run from step 0). :func:`check_log_dir` refuses a log folder that is a file or not writable.

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
import logging
import os
import re
import shutil
import socket
from typing import Iterator

from treejax.choices import closest_first
from treejax.errors import ConfigError, UserError

log = logging.getLogger(__name__)

LOG_DIR_MODES = ("new", "resume", "overwrite")
LOCK_NAME = ".treejax.lock"
#: Every top-level entry a run writes into its log folder; ``--overwrite`` deletes these and nothing else.
RUN_ENTRIES = re.compile(r"summary\.json|checkpoints|operative_config\.gin|failure(\.process\d+)?\.json|hf_export"
                         r"|tree_step\d+\.png|events\.out\.tfevents\..+|" + re.escape(LOCK_NAME))


def is_finished(log_dir: str) -> bool:
    return os.path.isfile(os.path.join(log_dir, "summary.json"))


def has_run(log_dir: str) -> bool:
    """Whether ``log_dir`` holds a run to resume (a summary or a checkpoint folder)."""
    return is_finished(log_dir) or os.path.isdir(os.path.join(log_dir, "checkpoints"))


def run_files(log_dir: str) -> tuple[list[str], list[str]]:
    """``(entries a run writes, other entries)`` of the folder ``log_dir`` (:data:`RUN_ENTRIES`), sorted."""
    entries = sorted(os.listdir(log_dir))
    own = [e for e in entries if RUN_ENTRIES.fullmatch(e)]
    return own, [e for e in entries if e not in own]


def _runs_next_to(log_dir: str) -> list[str]:
    """The run folders beside ``log_dir`` (same parent), closest name first."""
    parent = os.path.dirname(os.path.abspath(log_dir))
    try:
        names = [n for n in os.listdir(parent) if os.path.isdir(os.path.join(parent, n))
                 and has_run(os.path.join(parent, n))]
    except OSError:
        return []
    return [os.path.join(os.path.dirname(log_dir), n) for n in closest_first(os.path.basename(log_dir), names)]


def check_log_dir(log_dir: str) -> None:
    """Refuses, in one line, a log folder the run could not write: a path that is a file (or under one), or a
    folder (or the nearest existing parent of a new one) that is not writable."""
    path = os.path.abspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"RunConfig.log_dir={log_dir!r} is a file, not a folder; choose another RunConfig.log_dir")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"RunConfig.log_dir={log_dir!r} cannot be created: {existing} is a file; choose another "
                          "RunConfig.log_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"RunConfig.log_dir={log_dir!r}: {existing} is not writable (read-only file system or no "
                          "permission); choose another RunConfig.log_dir")
    if existing == path:  # os.access ignores a read-only mount for root: try a write
        probe = os.path.join(path, f".treejax_write_test.{os.getpid()}")
        try:
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"RunConfig.log_dir={log_dir!r} is not writable ({e.strerror}); choose another "
                              "RunConfig.log_dir") from None


def prepare_log_dir(log_dir: str, mode: str) -> None:
    """Applies ``mode`` to ``log_dir`` (module docstring); raises :class:`ConfigError` for a refused folder."""
    if mode not in LOG_DIR_MODES:
        raise ConfigError(f"RunConfig.log_dir_mode must be one of {LOG_DIR_MODES}, got {mode!r}")
    if mode == "resume" and not has_run(log_dir):
        near = _runs_next_to(log_dir)
        raise ConfigError(f"--resume: {log_dir} holds no run to resume (no checkpoints/ or summary.json); "
                          + (f"runs next to it: {', '.join(near[:5])}" if near else "no runs next to it")
                          + "; fix the RunConfig.log_dir, or drop --resume to start a new run there")
    if not os.path.isdir(log_dir):
        return
    if mode == "overwrite":
        own, foreign = run_files(log_dir)
        if foreign and not [e for e in own if e != LOCK_NAME]:
            raise ConfigError(f"refusing to overwrite {log_dir}: it does not look like a treejax run folder "
                              f"(no summary.json, checkpoints/ or event files; it holds {', '.join(foreign[:5])}); "
                              "choose another RunConfig.log_dir")
        for e in own:
            if e == LOCK_NAME:
                continue
            path = os.path.join(log_dir, e)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        if foreign:
            log.warning("--overwrite deleted the previous run's files in %s and kept %d it did not write: %s",
                        log_dir, len(foreign), ", ".join(foreign))
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
        folder_existed = os.path.isdir(log_dir)
        lock_existed = os.path.exists(os.path.join(log_dir, LOCK_NAME))
        try:
            check_log_dir(log_dir)
            if mode == "resume":
                prepare_log_dir(log_dir, mode)  # no run to resume: refused before anything is created
            lock = RunLock(log_dir).acquire()
            prepare_log_dir(log_dir, mode)
        except Exception as e:  # noqa: BLE001 -- told to the other processes, then re-raised
            if lock is not None:
                lock.release()
                lock = None
                if not lock_existed:  # a refused folder is left as it was found
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(log_dir, LOCK_NAME))
                        if not folder_existed:
                            os.rmdir(log_dir)
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
