"""Checkpoints: an orbax ``CheckpointManager`` around the ``TrainState`` + a JSON data-iterator state, and a
SIGTERM handler that asks the loop to save and exit at the next step boundary (preemptible TPU/GPU VMs).

Layout under ``directory``: one folder per saved step holding two items, ``state`` (the TrainState pytree:
params, optimizer state, step, key; orbax ``StandardSave``, sharded arrays written by every host in parallel)
and ``data`` (a JSON dict, e.g. a grain iterator's ``get_state()`` and anything else the loop needs to resume).
Saves are asynchronous by default: ``save`` returns after the device->host copy and the write runs in a
background thread; :meth:`Checkpointer.wait` blocks until it is durable (call it before exiting).

Exact resume: restoring gives bit-identical params, optimizer state, step and key, so a deterministic loop
(keys derived with ``fold_in(key, step)``, data iterator restored from ``data``) continues exactly like the
uninterrupted run.

Usage in a loop::

    ckpt = Checkpointer(dir, max_to_keep=3)
    stop = PreemptionHandler().install()
    if ckpt.latest_step() is not None:
        state, data = ckpt.restore(abstract_state_with_shardings(state, shardings))
    for step in ...:
        state, metrics = update(state, batch)
        if step % every == 0 or stop.should_stop(step, ckpt):
            ckpt.save(step, state, data_state, force=True)
        if stop.should_stop(step, ckpt):
            ckpt.wait(); break
"""

from __future__ import annotations

import base64
import contextlib
import errno
import glob
import logging
import os
import pickle
import shutil
import signal
import threading
import zlib
from typing import Any

import jax
import numpy as np

from treejax.errors import UserError
from treejax.parallel.multihost import any_process

log = logging.getLogger(__name__)


def _ocp():
    """``orbax.checkpoint``, imported on first use: 0.3 s that the CLI's fail-fast config check should not pay."""
    import orbax.checkpoint

    return orbax.checkpoint


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (disk full, read-only file system, no permission): one line naming the
    folder, the cause and the bytes the state needs; the partial ``*.orbax-checkpoint-tmp`` folder is removed."""


class _OrbaxFailureNoise(logging.Filter):
    """orbax reports a failed background save on the ``absl`` logger from several threads (each with its
    traceback: ~460 lines for one full disk) before :class:`Checkpointer` re-raises it as one line: those records
    (an ``OSError`` in an orbax thread, and the shutdown errors that follow a failed save) are dropped."""

    failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname or record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()} {exc}"
        return not (_OrbaxFailureNoise.failed or isinstance(exc, OSError) or "Errno" in text
                    or "orbax-checkpoint-tmp" in text)


def _install_noise_filter() -> None:
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxFailureNoise) for f in absl.filters):
        absl.addFilter(_OrbaxFailureNoise())


def encode_blob(obj: Any) -> str:
    """Host data (NumPy arrays, dataclasses) as one JSON-safe string for a checkpoint's data state: pickled,
    compressed, base64 (the asynchronous loop's queued rollouts, the replay buffer)."""
    return base64.b64encode(zlib.compress(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))).decode("ascii")


def decode_blob(text: str) -> Any:
    """The inverse of :func:`encode_blob` (the run's own checkpoint: trusted)."""
    return pickle.loads(zlib.decompress(base64.b64decode(text)))  # noqa: S301


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (itself, or in its cause/context chain), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _tree_bytes(tree: Any) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def abstract_state_with_shardings(state_like: Any, shardings: Any | None = None) -> Any:
    """``jax.ShapeDtypeStruct`` pytree (shape, dtype and target sharding) for :meth:`Checkpointer.restore`.

    ``state_like`` may be real arrays or the output of ``jax.eval_shape``; ``shardings`` a matching pytree of
    ``Sharding`` (default: each array's current sharding, if it has one).
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                            state_like)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state_like, shardings)


class Checkpointer:
    """Keep-N, optionally asynchronous checkpoints of ``(TrainState, JSON data state)``.

    Args:
      directory: checkpoint root (created if missing; local path or any path orbax supports, e.g. ``gs://``).
      max_to_keep: keep the newest N steps (``None`` keeps all).
      save_interval_steps: ``save`` without ``force`` only writes on multiples of this.
      async_save: write in a background thread.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, save_interval_steps: int = 1,
                 async_save: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self._pending: tuple[int, int] | None = None  # (step, bytes) of the save in flight
        _install_noise_filter()
        options = _ocp().CheckpointManagerOptions(
            max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save, create=True)
        self._manager = _ocp().CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def save(self, step: int, state: Any, data_state: dict | None = None, *, force: bool = False) -> bool:
        """Saves ``state`` and ``data_state`` (JSON-serialisable dict) as ``step``; returns whether it saved."""
        args = _ocp().args.Composite(state=_ocp().args.StandardSave(state), data=_ocp().args.JsonSave(data_state or {}))
        nbytes = _tree_bytes(state)
        with self._failures(int(step), nbytes):
            saved = self._manager.save(int(step), args=args, force=force)
        if saved:
            self._pending = (int(step), nbytes)
            log.info("checkpoint step %d -> %s", step, self.directory)
        return saved

    def restore(self, abstract_state: Any, step: int | None = None, *, new_aux: dict | None = None
                ) -> tuple[Any, dict]:
        """Restores ``(state, data_state)`` at ``step`` (default: latest) into ``abstract_state``'s structure,
        dtypes and shardings (see :func:`abstract_state_with_shardings`).

        ``new_aux``: ``{name: state}`` values for the entries of ``abstract_state.aux`` (a ``TrainState``'s
        stateful shapers and trainable scorers) that the saved state does not hold: a checkpoint written before
        they existed, or by a run without them, restores everything it has and these fresh values for the rest
        (logged). Without ``new_aux`` a missing entry is an error naming it."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        missing = self._missing_aux(abstract_state, int(step))
        if missing and (new_aux is None or any(k not in new_aux for k in missing)):
            raise ValueError(f"the checkpoint of step {step} in {self.directory} holds no state for {missing} "
                             "(TrainState.aux); pass new_aux={name: initial state} to start them fresh")
        target = abstract_state.replace(aux={k: v for k, v in abstract_state.aux.items() if k not in missing}) \
            if missing else abstract_state
        args = _ocp().args.Composite(state=_ocp().args.StandardRestore(target), data=_ocp().args.JsonRestore())
        out = self._manager.restore(int(step), args=args)
        state = out["state"]
        if missing:
            log.info("checkpoint step %d holds no state for %s: starting them fresh", step, missing)
            state = state.replace(aux={k: new_aux[k] if k in missing else state.aux[k] for k in abstract_state.aux})
        return state, dict(out["data"] or {})

    def _missing_aux(self, abstract_state: Any, step: int) -> list[str]:
        """The names in ``abstract_state.aux`` that the saved state of ``step`` lacks (``[]`` for a state without
        ``aux``)."""
        aux = getattr(abstract_state, "aux", None)
        if not isinstance(aux, dict) or not aux:
            return []
        meta = _ocp().PyTreeCheckpointer().metadata(os.path.join(self.directory, str(step), "state"))
        meta = getattr(meta, "item_metadata", meta)  # StepMetadata (newer orbax) or the tree metadata itself
        meta = getattr(meta, "tree", meta)
        saved = meta.get("aux") if isinstance(meta, dict) else None
        return [k for k in aux if not (isinstance(saved, dict) and k in saved)]

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def reached_preemption(self, step: int) -> bool:
        """orbax/JAX multi-host preemption sync point (True on every host at the same step after a notice)."""
        return bool(self._manager.reached_preemption(int(step)))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are durable; a failed write raises :class:`CheckpointSaveError`."""
        with self._failures(*(self._pending or (None, None))):
            self._manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def _failures(self, step: int | None, nbytes: int | None):
        """Turns an ``OSError`` of a save (raised here or by orbax's background thread) into one
        :class:`CheckpointSaveError` line, after removing the partial ``*.orbax-checkpoint-tmp`` folders."""
        @contextlib.contextmanager
        def guard():
            try:
                yield
            except Exception as e:  # noqa: BLE001 -- an OSError is the user's disk; anything else is re-raised
                cause = _os_error(e)
                if cause is None:
                    raise
                _OrbaxFailureNoise.failed = True
                self._pending = None
                raise self._save_error(step, nbytes, cause) from e

        return guard()

    def _save_error(self, step: int | None, nbytes: int | None, cause: OSError) -> CheckpointSaveError:
        removed = self.remove_partial()
        try:
            free = f", {shutil.disk_usage(self.directory).free:,} bytes free" if cause.errno == errno.ENOSPC else ""
        except OSError:
            free = ""
        need = f" (the state needs about {nbytes:,} bytes{free})" if nbytes else ""
        what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
        tmp = f"; removed the partial {', '.join(os.path.basename(r) for r in removed)}" if removed else ""
        return CheckpointSaveError(f"could not save {what} to {self.directory}: {cause.strerror or cause}{need}"
                                   f"{tmp}; free space or choose another RunConfig.log_dir, then rerun to resume "
                                   "from the last saved step")

    def remove_partial(self) -> list[str]:
        """Removes the ``*.orbax-checkpoint-tmp*`` folders a failed save left (after orbax's other save threads
        have stopped writing into them); returns their paths."""
        for t in threading.enumerate():
            if t is not threading.current_thread() and type(t).__module__.startswith("orbax"):
                t.join(timeout=60)
        removed = []
        for path in sorted(glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*"))):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
        return removed

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PreemptionHandler:
    """Turns SIGTERM and SIGINT (Ctrl-C) into a flag the training loop polls at step boundaries.

    The handler only sets a flag (and writes one line to stderr); the loop saves and exits cleanly at the next
    step boundary. A second SIGINT aborts at once (``KeyboardInterrupt``), as Ctrl-C does without the handler.
    On multi-process runs :meth:`should_stop` combines the flags of all processes and the checkpointer's
    preemption sync point, so all processes stop at the same step.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.requested = False
        self.signal_received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # the second Ctrl-C: abort now
        self.requested = True
        self.signal_received = signum
        if signum == signal.SIGINT:  # os.write: safe in a signal handler, unlike logging
            os.write(2, b"treejax: Ctrl-C: finishing this step, then saving a checkpoint and stopping "
                        b"(Ctrl-C again aborts at once)\n")

    def install(self) -> "PreemptionHandler":
        """Installs the handler (main thread only); returns self."""
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()

    def should_stop(self, step: int, checkpointer: Checkpointer | None = None) -> bool:
        """Whether to save and stop after ``step``. With several processes every process must call it at every
        step: a signal received by any process stops all of them at the same step (one all-gather of a flag), and
        so does JAX's preemption sync point (orbax ``reached_preemption``)."""
        if jax.process_count() == 1:
            return self.requested
        if any_process(self.requested):
            return True
        return checkpointer is not None and checkpointer.reached_preemption(step)

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def restore_params(directory: str | os.PathLike, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
    """Only the ``params`` of a :class:`Checkpointer`'s saved ``TrainState`` (optimizer state, step and key are not
    read), cast to ``abstract_params``' dtypes; returns ``(params, step)``. Read-only: nothing is created or written.

    ``directory``: a checkpoint root as given to :class:`Checkpointer` (one folder per step); ``step``: default the
    latest. ``abstract_params``: the params pytree (arrays or ``jax.ShapeDtypeStruct``) the checkpoint was trained
    from, e.g. the output of ``load_model`` for the same model; leaves come back as host (NumPy) arrays.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    manager = _ocp().CheckpointManager(directory, options=_ocp().CheckpointManagerOptions(read_only=True, create=False))
    steps = sorted(manager.all_steps())
    if not steps:
        raise FileNotFoundError(f"no checkpoint steps in {directory}")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {directory}; have {steps}")
    path = os.path.join(directory, str(step), "state")
    checkpointer = _ocp().PyTreeCheckpointer()
    # Check names and shapes against the checkpoint's metadata first: a partial restore does not.
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)  # StepMetadata (newer orbax) or the tree metadata itself
    meta = getattr(meta, "tree", meta)
    if not isinstance(meta, dict) or "params" not in meta:
        raise ValueError(f"{path} holds no 'params' (is it a treejax TrainState checkpoint?)")

    def shapes(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in leaves}

    saved, wanted = shapes(meta["params"]), shapes(abstract_params)
    if saved != wanted:
        diff = sorted(set(saved.items()) ^ set(wanted.items()))[:6]
        raise ValueError(f"the params saved in {path} do not match the model's ({len(saved)} saved, {len(wanted)} "
                         f"expected arrays); first differences (name, shape): {diff}")
    target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params)}
    restore_args = jax.tree.map(lambda x: _ocp().RestoreArgs(restore_type=np.ndarray, dtype=x.dtype), target)
    out = checkpointer.restore(
        path, args=_ocp().args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
    return out["params"], step
