"""Collect: where each step's rollouts come from — sampled now, or taken from a queue that a sampler thread fills
while the learner trains (asynchronous rollouts, :class:`treejax.rl.config.AsyncConfig`).

The loop's step, for either collector::

    item = collector.collect(i, state)              # the rollouts step i learns from (Collected)
    state, ... = learn(learner, state, item.rollouts, fold_in(key, i), ref, behaviour_params=item.behaviour_params)
    collector.publish(i + 1, state)                 # policy version i + 1: the weights after i + 1 updates

**Policy versions.** Version ``v`` is the parameters after ``v`` updates (the initial or restored weights are
the start step's version). Step ``i``'s rollouts are sampled with key ``fold_in(key, i)`` (the key ``learn`` gets
too) by version ``max(s, i - k)``, ``s`` the version the run (or its resumption) started from:

* :class:`SyncCollector` (``k = 0``, today's loop): samples step ``i`` when the loop asks, with the newest weights;
* :class:`AsyncCollector` (``AsyncConfig.max_staleness = k``): a worker thread samples step ``j`` as soon as
  version ``max(0, j - k)`` is published and puts it in a queue; the learner takes step ``i``'s rollouts from it.
  The lag is the bound itself (a fixed schedule: the run is reproducible, resumes exactly, and it is the fastest
  schedule the bound allows, since sampling step ``j`` cannot start before version ``j - k`` exists). With
  ``k = 0`` the worker samples step ``i + 1`` while the loop logs step ``i``: the same numbers as the synchronous
  loop, bit for bit.

**Off-policy correction** (:mod:`treejax.rl.step`, decoupled PPO as in AReaL): the sampler records the behaviour
log-probs ``log q`` of the version that sampled; the learner recomputes ``log pi_prox`` with its current weights
(``old_logp = "trainer"``) — the PPO ratio's denominator, so the clip acts on the current policy's trust region —
and ``LossConfig.tis_cap`` weights each token by ``min(pi_prox / q, C)`` (truncated importance sampling).
Metrics: ``async/staleness`` (``i - v``), ``offpolicy/iw_mean|min|max`` (``pi_prox / q``), and with
``AsyncConfig.split_staleness`` the staleness part ``offpolicy/stale_iw_...`` (exactly 1 when nothing is stale).

**Devices.** :func:`split_devices`: the first ``AsyncConfig.sampler_devices`` devices sample, the rest learn; the
learner publishes a copy of its weights cast to the sampler dtype and moved to the sampler's devices after each
update (``sampler_weights``; a device-to-device copy that waits for the update on the device, not on the host);
rollouts move to the learner's devices when taken (``to_learner``). Held-out evaluation runs on the learner's
devices in the loop's thread. One process only (a sampler group spanning processes is not built).

**Checkpoints.** :meth:`AsyncCollector.checkpoint_state` first waits until the worker can go no further (it is
waiting for a version the learner has not published, or it is done), then returns the prompt pipeline's state
after the last prompts drawn and the queued rollouts (host copies, pickled, compressed and base64-encoded into
the checkpoint's JSON data state: saved, not regenerated). Resuming puts them back in the queue, so a resumed
run learns from exactly the rollouts the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.config import AsyncConfig
from treejax.rl.rollouts import RolloutSource, Rollouts
from treejax.rl.step import rollout_metrics
from treejax.sampling import probe as probe_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Collected:
    """One step's rollouts as the learner takes them. ``version``: the policy version that sampled them;
    ``host``: their host metrics (``time/rollout_s`` ...; :func:`treejax.rl.step.rollout_metrics`, computed by
    the worker thread for queued rollouts, after the learning's dispatch for synchronous ones);
    ``behaviour_params``: the learner's weights of ``version`` (``AsyncConfig.split_staleness``), else ``None``."""

    step: int
    version: int
    rollouts: Rollouts
    host: dict
    behaviour_params: Any = None

    def host_metrics(self) -> dict:
        if "reward/mean" not in self.host:
            self.host.update(rollout_metrics(self.rollouts))
        return self.host


def source_state(source) -> dict:
    """What a checkpoint saves of a rollout source: its prompt pipeline's state and the source's own state, when it
    keeps one (``source.checkpoint_state()``: the allocator's state, the replay buffer, DOTS's difficulties; copies,
    so the sampler thread may go on changing its own)."""
    out = {"pipeline": source.pipeline.get_state()}
    if hasattr(source, "checkpoint_state"):
        out.update(source.checkpoint_state())
    return out


def split_devices(cfg: AsyncConfig, devices: list, process_count: int = 1) -> tuple[list, list]:
    """``(sampler devices, learner devices)``: both all ``devices`` unless ``cfg`` splits them; a
    :class:`~treejax.errors.ConfigError` with the fix for a split that cannot run."""
    if not cfg.enabled:
        return list(devices), list(devices)
    if process_count > 1:
        raise ConfigError(f"AsyncConfig.enabled = True in a run of {process_count} processes: asynchronous rollouts "
                          "run in one process (several devices of one host are fine); fix: one process, or "
                          "AsyncConfig.enabled = False")
    n = cfg.sampler_devices
    if n == 0:
        if len(devices) > 1:
            raise ConfigError(f"AsyncConfig.sampler_devices = 0 shares the devices between the sampler and the "
                              f"learner, which works on one device only ({len(devices)} here: two threads' "
                              f"programs could interleave their collectives differently on different devices); "
                              f"fix: AsyncConfig.sampler_devices = {len(devices) // 2} (the first devices sample, "
                              f"the rest learn)")
        return list(devices), list(devices)
    if n >= len(devices):
        fix = ("AsyncConfig.sampler_devices = 0 (the sampler and the learner share the device)" if len(devices) == 1
               else f"AsyncConfig.sampler_devices = {len(devices) - 1} or fewer")
        raise ConfigError(f"AsyncConfig.sampler_devices = {n} leaves no device to learn on ({len(devices)} "
                          f"device{'s' if len(devices) > 1 else ''}); fix: {fix}")
    return list(devices[:n]), list(devices[n:])


def sampled_version(step: int, max_staleness: int, base: int = 0) -> int:
    """The policy version that samples step ``step``'s rollouts: ``step - max_staleness``, but none older than
    ``base``, the version a run starts from (a resumed run without a saved queue has no older weights)."""
    return max(base, step - max_staleness)


def with_probes(weights, probes: Callable | None, state):
    """The sampler's ``weights`` with ``probes(state)`` attached (:func:`treejax.sampling.probe.attach`)."""
    return weights if probes is None else probe_lib.attach(weights, probes(state))


class SyncCollector:
    """Samples each step's rollouts when the loop asks, with the newest weights (the synchronous loop).
    ``sampler_weights(params)``: the sampler's copy; ``queued``: rollouts an asynchronous run had queued when it
    was checkpointed (learned first, as saved); ``probes(state)``: the stateful shapers' probes that travel with
    the weights (:mod:`treejax.sampling.probe`; copies, never the state's own buffers). A sampler on its own
    layout of the devices (``RunConfig.sampler_mesh``): ``sampler_weights`` re-lays the weights out for it (timed:
    ``time/relayout_s``, included in ``time/rollout_s``), the rollout runs under ``context()`` (its mesh) and
    ``to_learner`` moves the rollouts back to the learner's mesh."""

    def __init__(self, source: RolloutSource, sampler_weights: Callable, key: jax.Array, queued=(),
                 probes: Callable | None = None, to_learner: Callable | None = None,
                 context: Callable | None = None):
        self.source, self.sampler_weights, self.key = source, sampler_weights, key
        self.queued = {item.step: item for item in queued}
        self.probes = probes
        self.to_learner, self.context = to_learner, context

    def collect(self, step: int, state) -> Collected:
        if step in self.queued:
            item = self.queued.pop(step)
            item.host.update({"async/staleness": step - item.version})
            return item
        t0 = time.perf_counter()
        weights, host = self.sampler_weights(state.params), {}
        if self.to_learner is not None:  # the sampler's own layout: the re-layout timed on its own
            weights = jax.block_until_ready(weights)
            host["time/relayout_s"] = time.perf_counter() - t0
        with self.context() if self.context is not None else contextlib.nullcontext():
            ro = self.source.sample(with_probes(weights, self.probes, state), jax.random.fold_in(self.key, step),
                                    step)
        if self.to_learner is not None:
            ro = self.to_learner(ro)
        host["time/rollout_s"] = time.perf_counter() - t0 - ro.counters.scoring_s
        return Collected(step, step, ro, host)

    def publish(self, version: int, state) -> None:
        """Nothing to send: the next ``collect`` reads ``state`` itself."""

    def checkpoint_state(self) -> dict:
        out = source_state(self.source)
        if self.queued:
            out["rollout_queue"] = encode_queue([self.queued[s] for s in sorted(self.queued)])
        return out

    def close(self) -> None:
        pass


class AsyncCollector:
    """A worker thread samples ahead with bounded staleness (module docstring) into a queue the learner reads.

    Args:
      source: the rollout source (its ``sample`` runs in the worker thread).
      sampler_weights: ``fn(learner params) -> sampler params``: the sampler's copy, never aliasing the learner's
        buffers (the update donates them while the sampler may still read the copy).
      key: the run's key (step ``j`` samples with ``fold_in(key, j)``).
      start_step / num_steps: the steps this run learns (``start_step`` = the restored state's version).
      max_staleness: ``k``.
      thread_context: ``fn() -> context manager`` the worker runs in (the sampler's mesh and matmul precision:
        JAX's contexts are per thread).
      to_learner: ``fn(rollouts) -> rollouts`` on the learner's devices.
      queued: :class:`Collected` items restored from a checkpoint.
      keep_params: ``fn(learner params) -> copy`` to keep each published version's learner weights for
        ``behaviour_params`` (``AsyncConfig.split_staleness``), or ``None``.
      probes: ``fn(state) -> {name: probe}`` on the sampler's devices, never aliasing the state (the stateful
        shapers' probes, :mod:`treejax.sampling.probe`), or ``None``.
    """

    def __init__(self, source: RolloutSource, sampler_weights: Callable, key: jax.Array, start_step: int,
                 num_steps: int, max_staleness: int, thread_context: Callable = contextlib.nullcontext,
                 to_learner: Callable = lambda ro: ro, queued=(), keep_params: Callable | None = None,
                 probes: Callable | None = None):
        self.source, self.sampler_weights, self.key = source, sampler_weights, key
        self.probes = probes
        self.num_steps, self.thread_context = num_steps, thread_context
        self.to_learner, self.keep_params = to_learner, keep_params
        self._cv = threading.Condition()
        self._weights: dict[int, Any] = {}  # version -> the sampler's copy
        self._learner_params: dict[int, Any] = {}  # version -> the learner's copy (split_staleness)
        self._ready: dict[int, Collected] = {item.step: item for item in queued}
        self._next = max([start_step - 1] + list(self._ready)) + 1  # the next step the worker samples
        self._version = lambda step: sampled_version(step, max_staleness, start_step)  # noqa: E731
        self._busy, self._stop, self._error = False, False, None
        self._thread = threading.Thread(target=self._run, name="treejax-sampler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ learner side
    def publish(self, version: int, state) -> None:
        """Makes ``version`` (``state``'s weights) available to the sampler (dispatched, not waited for)."""
        weights = with_probes(self.sampler_weights(state.params), self.probes, state)
        kept = self.keep_params(state.params) if self.keep_params is not None else None
        with self._cv:
            self._weights[version] = weights
            if kept is not None:
                self._learner_params[version] = kept
            self._cv.notify_all()

    def collect(self, step: int, state=None) -> Collected:
        """Step ``step``'s rollouts, waiting for the worker if they are not ready."""
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: step in self._ready or self._error is not None or self._stop)
            self._raise_worker_error()
            if step not in self._ready:
                raise RuntimeError(f"the sampler thread was stopped before step {step + 1}'s rollouts")
            item = self._ready.pop(step)
            queued = len(self._ready)
            item.behaviour_params = self._learner_params.get(item.version)
            floor = self._version(step)  # no later step needs an older version
            for v in [v for v in self._learner_params if v < floor]:
                del self._learner_params[v]
        item.rollouts = self.to_learner(item.rollouts)
        item.host.update({"time/wait_rollout_s": time.perf_counter() - t0, "async/staleness": step - item.version,
                          "async/queued": queued})
        return item

    def checkpoint_state(self) -> dict:
        """The prompt pipeline's state and the queued rollouts, once the worker can go no further."""
        with self._cv:
            self._cv.wait_for(lambda: self._error is not None or self._stop or not self._busy and (
                self._next >= self.num_steps or self._version(self._next) not in self._weights))
            self._raise_worker_error()
            items = [self._ready[s] for s in sorted(self._ready)]
            out = source_state(self.source)
        if items:
            out["rollout_queue"] = encode_queue(items)
        return out

    def close(self) -> None:
        """Stops the worker after the rollout it is sampling (if any)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------------------------------- worker side
    def _run(self) -> None:
        try:
            with self.thread_context():
                while True:
                    t0 = time.perf_counter()
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or self._next >= self.num_steps
                                          or self._version(self._next) in self._weights)
                        if self._stop or self._next >= self.num_steps:
                            return
                        step = self._next
                        version = self._version(step)
                        params, self._busy = self._weights[version], True
                        for v in [v for v in self._weights if v < version]:
                            del self._weights[v]
                    t1 = time.perf_counter()
                    ro = self.source.sample(params, jax.random.fold_in(self.key, step), step)
                    t2 = time.perf_counter()
                    host = {"time/rollout_s": t2 - t1 - ro.counters.scoring_s, "time/sampler_wait_s": t1 - t0,
                            **rollout_metrics(ro)}
                    with self._cv:
                        self._ready[step] = Collected(step, version, ro, host)
                        self._next, self._busy = step + 1, False
                        self._cv.notify_all()
        except BaseException as e:  # handed to the learner at its next collect / checkpoint
            with self._cv:
                self._error, self._busy = e, False
                self._cv.notify_all()


# ------------------------------------------------------------------------------------------------ the queue
def encode_queue(items: list[Collected]) -> str:
    """Queued rollouts as one JSON-safe string (host copies; the learner's weight copies are not saved)."""
    host = [dataclasses.replace(item, rollouts=rollouts_to_host(item.rollouts), behaviour_params=None)
            for item in items]
    return encode_blob(host)


def decode_queue(text: str | None) -> list[Collected]:
    """The inverse of :func:`encode_queue` (``None``: nothing queued)."""
    if not text:
        return []
    return decode_blob(text)


def rollouts_to_host(ro: Rollouts) -> Rollouts:
    """``ro`` with every device array as a NumPy array."""
    forest, rewards, inputs = jax.device_get((ro.forest, ro.rewards_PxW, ro.estimator_inputs))
    return dataclasses.replace(ro, forest=forest, rewards_PxW=rewards, estimator_inputs=inputs)


def rollouts_to(ro: Rollouts, sharding) -> Rollouts:
    """``ro``'s arrays placed with ``sharding`` (e.g. replicated over the learner's mesh)."""
    put = lambda x: jax.device_put(x, sharding)  # noqa: E731
    return dataclasses.replace(ro, forest=put(ro.forest), rewards_PxW=put(ro.rewards_PxW),
                               estimator_inputs={k: put(v) for k, v in ro.estimator_inputs.items()})


__all__ = ["Collected", "SyncCollector", "AsyncCollector", "split_devices", "sampled_version", "encode_queue",
           "decode_queue", "rollouts_to_host", "rollouts_to"]
