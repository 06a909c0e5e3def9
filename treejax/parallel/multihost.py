"""Several processes, one program: ``jax.distributed`` start-up and the host-side rules of a multi-process run.

A multi-process (multi-controller) JAX run is ``N`` copies of the same program, one per host (or per GPU), joined
by ``jax.distributed.initialize``. ``jax.devices()`` then lists the devices of *every* process, so one mesh
(:func:`treejax.parallel.mesh.make_mesh`) spans all of them and every jitted function runs as one SPMD program
over the global mesh; each process only holds the shards on its own (*addressable*) devices.

The rules this module serves (the failure peers hit is tunix#698: host code that read arrays the process could
not address):

* every process runs the same host code in the same order, so a collective (a jitted step, an all-gather, a
  broadcast) is entered by all of them or by none;
* host code reads a device array only through :func:`host_array` / :func:`host_tree`: a fully addressable or
  fully replicated array is copied locally, any other one is gathered explicitly with
  ``multihost_utils.process_allgather`` (a collective: every process must make the same call);
* host values that every process computes identically (the same prompts, the same gathered forest, a
  deterministic verifier) enter jitted functions as replicated inputs;
* one process (:func:`is_primary`, process 0) writes logs, event files, pictures, ``summary.json`` and exports;
  every process takes part in orbax's checkpoint save and restore (orbax coordinates the writers).

Start-up (:func:`maybe_initialize_distributed`): explicit arguments (``treejax-train --coordinator host:port
--num_processes N --process_id i``), else ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``, else ``TREEJAX_DISTRIBUTED=1`` for JAX's cluster auto-detection (Cloud TPU, SLURM, Open MPI).
CPU processes exchange collectives through gloo (``jax_cpu_collectives_implementation='gloo'``, set before the
start). A process that stops sending heartbeats for ``heartbeat_timeout_s`` seconds is declared dead by the
coordinator and every other process terminates with JAX's message "Terminating process because the JAX
distributed service detected fatal errors. This most likely indicates that another task died" instead of waiting
forever in a collective; when the coordinator (process 0) dies the others terminate at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from treejax.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["any_process", "broadcast_text", "host_array", "host_tree", "is_primary", "maybe_initialize_distributed",
           "process_count", "process_index", "sync"]

#: Bytes of a message broadcast by :func:`broadcast_text` (longer messages are cut).
MESSAGE_BYTES = 2048


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {value!r}") from None


def maybe_initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                                 process_id: int | None = None, *, heartbeat_timeout_s: int | None = None,
                                 initialization_timeout_s: int | None = None) -> bool:
    """Calls ``jax.distributed.initialize`` for a multi-process run; returns whether it did.

    Triggers, first match wins: ``coordinator_address`` given (with ``num_processes`` and ``process_id``, the
    CLI's ``--coordinator/--num_processes/--process_id``); ``JAX_COORDINATOR_ADDRESS`` set (with
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; an explicit GPU-cluster start); ``TREEJAX_DISTRIBUTED=1`` (JAX
    auto-detects the cluster: Cloud TPU pod slices, SLURM, Open MPI). ``heartbeat_timeout_s`` (default
    ``TREEJAX_HEARTBEAT_TIMEOUT_S``, else JAX's 100 s): how long a silent process may go before the others
    terminate. Must run before anything touches the devices; a no-op once initialised.
    """
    if jax.distributed.is_initialized():
        return False
    if coordinator_address is None and (num_processes is not None or process_id is not None):
        raise ConfigError("--num_processes / --process_id need --coordinator HOST:PORT")
    addr = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    auto = os.environ.get("TREEJAX_DISTRIBUTED", "0") == "1"
    if not addr and not auto:
        return False
    kwargs: dict[str, Any] = {}
    heartbeat = heartbeat_timeout_s if heartbeat_timeout_s is not None else _env_int("TREEJAX_HEARTBEAT_TIMEOUT_S")
    if heartbeat is not None:
        if heartbeat < 1:
            raise ConfigError(f"the heartbeat timeout must be >= 1 s, got {heartbeat}")
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat)
    if initialization_timeout_s is not None:
        kwargs["initialization_timeout"] = int(initialization_timeout_s)
    # CPU processes need a cross-process collectives backend (the default has none); GPUs and TPUs ignore it.
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if addr:
        if coordinator_address is not None:
            num, pid, where = num_processes, process_id, "--num_processes / --process_id"
        else:
            num, pid, where = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID"), \
                "JAX_NUM_PROCESSES / JAX_PROCESS_ID"
        if num is None or pid is None:
            raise ConfigError(f"the coordinator address {addr!r} is set but {where} are not")
        if num < 1 or not 0 <= pid < num:
            raise ConfigError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got "
                              f"num_processes={num}, process_id={pid}")
        if ":" not in addr:
            raise ConfigError(f"the coordinator address must be HOST:PORT, got {addr!r}")
        jax.distributed.initialize(coordinator_address=addr, num_processes=int(num), process_id=int(pid), **kwargs)
    else:
        jax.distributed.initialize(**kwargs)
    log.info("jax.distributed initialised: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """Whether this is process 0, the one that writes logs, event files, pictures, summaries and exports."""
    return jax.process_index() == 0


def _local(x: Any) -> bool:
    """Whether ``x`` can be read on this process without communication."""
    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable or x.is_fully_replicated


def host_array(x: Any) -> np.ndarray:
    """The global value of ``x`` as a NumPy array on this process.

    A NumPy value, a fully addressable or a fully replicated array is copied locally; an array sharded over
    other processes' devices is gathered with ``process_allgather`` — a collective, so every process must call
    this for the same array at the same point (``np.asarray`` would raise "spans non-addressable devices").
    """
    return host_tree(x)


def host_tree(tree: Any) -> Any:
    """:func:`host_array` of every leaf of ``tree``, with one all-gather for all the leaves that need one."""
    leaves, treedef = jax.tree.flatten(tree)
    remote = [i for i, x in enumerate(leaves) if not _local(x)]
    out = [np.asarray(x) if i not in remote else None for i, x in enumerate(leaves)]
    if remote:
        gathered = multihost_utils.process_allgather([leaves[i] for i in remote], tiled=True)
        for i, g in zip(remote, gathered):
            out[i] = np.asarray(g)
    return jax.tree.unflatten(treedef, out)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a collective in multi-process runs; local otherwise)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray([bool(flag)]))))


def broadcast_text(text: str | None) -> str | None:
    """Process 0's ``text`` on every process (``None`` stays ``None``; at most :data:`MESSAGE_BYTES` bytes)."""
    if jax.process_count() == 1:
        return text
    buf = np.zeros(MESSAGE_BYTES + 1, np.uint8)
    if text is not None:
        data = text.encode()[:MESSAGE_BYTES]
        buf[0] = 1
        buf[1: 1 + len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    if not out[0]:
        return None
    return bytes(out[1:]).rstrip(b"\0").decode(errors="replace")


def sync(name: str) -> None:
    """A barrier of every process (no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
