"""Metrics: TensorBoard event files (tensorboardX), a one-line console summary, and non-blocking readback.

Don't block the host (nanodo's pattern): JAX dispatches ``update`` asynchronously, so reading step N's metrics
right after dispatching it would stall the host until the device finishes. :class:`DeferredMetrics` keeps
step N's device arrays and hands back step N-1's values only after step N has been dispatched, so the device
always has the next step queued while the host converts and writes the previous one::

    deferred = DeferredMetrics()
    for step in range(num_steps):
        state, metrics = update(state, batch)        # dispatch step N
        for s, host in deferred.push(step, metrics):  # read step N-1 (already finished or nearly)
            writer.write_scalars(s, host)
    for s, host in deferred.flush():
        writer.write_scalars(s, host)
"""

from __future__ import annotations

import itertools
import math
import os
import time
from typing import Any, Callable, Iterator

import numpy as np


_WRITERS = itertools.count()  # event-file names: time (s), host, pid, writer number -> never shared


def to_host_scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flattens a (nested) dict of scalar arrays into ``{"prefix/key": float}``; non-scalars raise ValueError."""
    from treejax.parallel.multihost import host_tree

    out: dict[str, float] = {}
    host = host_tree(metrics)  # scalars are replicated: a local copy on every process
    for k, v in host.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(to_host_scalars(v, name))
            continue
        arr = np.asarray(v)
        if arr.size != 1:
            raise ValueError(f"metric {name!r} is not a scalar (shape {arr.shape})")
        out[name] = float(arr.reshape(()))
    return out


class DeferredMetrics:
    """Keeps the newest step's device metrics; :meth:`push` returns the previous step's as host floats."""

    def __init__(self):
        self._pending: list[tuple[int, dict]] = []

    def push(self, step: int, device_metrics: dict[str, Any]) -> list[tuple[int, dict[str, float]]]:
        ready = self._pending
        self._pending = [(step, device_metrics)]
        return [(s, to_host_scalars(m)) for s, m in ready]

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        ready, self._pending = self._pending, []
        return [(s, to_host_scalars(m)) for s, m in ready]


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def format_console(step: int, metrics: dict[str, float], keys: tuple[str, ...] | None = None,
                   total_steps: int | None = None) -> str:
    """``"step 12/100 | loss -0.0123 | reward 0.45 | ..."`` with ``keys`` in order (default: all, sorted);
    keys missing from ``metrics`` are left out."""
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    names = sorted(metrics) if keys is None else [k for k in keys if k in metrics]
    return " | ".join([head] + [f"{k} {_fmt(metrics[k])}" for k in names])


class NullWriter:
    """A :class:`MetricsWriter` that writes nothing: the writer of every process but process 0 in a multi-process
    run (one process writes the event files and the console lines)."""

    def write_scalars(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        del step, metrics, console

    def write_image(self, step: int, tag: str, image: Any) -> None:
        del step, tag, image

    def write_text(self, step: int, tag: str, text: str) -> None:
        del step, tag, text

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricsWriter:
    """TensorBoard scalars/images/text under ``logdir`` plus an optional console line per :meth:`write_scalars`.

    Args:
      logdir: event-file directory (created).
      console_keys: metrics shown on the console line (``None``: all); ``console_every`` steps apart
        (0 disables the console).
      print_fn: where console lines go (``print`` by default; pass ``logging.info`` or a list's append).
    """

    def __init__(self, logdir: str | os.PathLike, *, console_keys: tuple[str, ...] | None = None,
                 console_every: int = 1, total_steps: int | None = None,
                 print_fn: Callable[[str], Any] = print):
        from tensorboardX import SummaryWriter  # imported lazily: only the trainer needs it

        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        # the pid in the name: two writers started in the same second never share an event file
        self._writer = SummaryWriter(self.logdir, filename_suffix=f".{os.getpid()}.{next(_WRITERS)}")
        self.console_keys = console_keys
        self.console_every = console_every
        self.total_steps = total_steps
        self.print_fn = print_fn
        self._t0 = time.time()

    def write_scalars(self, step: int, metrics: dict[str, Any], console: bool = True) -> None:
        scalars = to_host_scalars(metrics)
        for k, v in scalars.items():
            self._writer.add_scalar(k, v, global_step=step)
        if console and self.console_every and step % self.console_every == 0:
            line = format_console(step, scalars, self.console_keys, self.total_steps)
            self.print_fn(f"{line} | elapsed {time.time() - self._t0:.1f}s")

    def write_image(self, step: int, tag: str, image: np.ndarray | str | os.PathLike) -> None:
        """An ``[H, W, 3|4]`` uint8/float image, or the path of a PNG file (e.g. from ``treejax.viz``)."""
        if not isinstance(image, np.ndarray):
            from matplotlib import image as mpimg

            image = mpimg.imread(os.fspath(image))
        arr = np.asarray(image)
        if arr.ndim != 3 or arr.shape[-1] not in (3, 4):
            raise ValueError(f"write_image: expected an [H, W, 3|4] image, got shape {arr.shape}")
        self._writer.add_image(tag, arr[..., :3], global_step=step, dataformats="HWC")

    def write_text(self, step: int, tag: str, text: str) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_event_scalars(logdir: str | os.PathLike) -> Iterator[tuple[str, int, float]]:
    """Reads back ``(tag, step, value)`` from the TensorBoard event files under ``logdir`` (tests, notebooks)."""
    from tensorboardX.proto import event_pb2  # tensorboardX ships the protos; no tensorflow needed
    import struct

    for root, _, files in os.walk(os.fspath(logdir)):
        for name in sorted(files):
            if "tfevents" not in name:
                continue
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            pos = 0
            while pos + 12 <= len(data):
                (length,) = struct.unpack("<Q", data[pos:pos + 8])
                payload = data[pos + 12:pos + 12 + length]
                pos += 12 + length + 4
                event = event_pb2.Event()
                event.ParseFromString(payload)
                for v in event.summary.value:
                    if v.HasField("simple_value"):
                        yield v.tag, int(event.step), float(v.simple_value)
