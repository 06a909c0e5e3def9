"""DeepTravel's replay of failures (Ning et al. 2025, "DeepTravel: An End-to-End Agentic Reinforcement Learning
Framework for Autonomous Travel Planning Agents", arXiv 2509.21842): prompts the agent failed are kept in a buffer
and, periodically, rolled out again beside the step's fresh prompts.

The method has three parts in treejax: the sandbox is the travel world (:mod:`treejax.envs.travel`, generated
offline from a seed); the hierarchical reward is that world's verifiers (:func:`treejax.envs.travel_world.
hierarchical_reward`: the trajectory-level feasibility verifier, then, only on feasible plans, the turn-level
consistency verifier), so any estimator trains on it (``configs/multiturn_travel_deeptravel.gin``: GRPO); the
replay-augmented RL is this wrapper stage, ``RunConfig.rollouts = [@MultiTurnConfig(), @FailureReplayConfig()]``.

**The buffer.** After each step, a fresh prompt row whose success rate ``s_p = (1/W) sum_w 1[score_{p,w} >= 1]``
is at most ``max_success`` joins a FIFO buffer of failed prompts (its example and prompt tokens; not twice; at most
``capacity``, the oldest leave first). On every step ``t`` with ``t % period == 0``, the ``rows`` oldest entries
are rolled out again by the wrapped multi-turn source with the current policy (its own ``roll``, a key folded from
the step's with stream :data:`REPLAY_STREAM`), as ``rows`` extra prompt rows after the fresh ones. A replayed
prompt whose new success rate exceeds ``max_success`` is recovered and leaves the buffer; one still failing goes
to the back, until ``max_attempts`` replays. Steps without replay, and steps where the buffer holds fewer than
``rows`` entries, fill the missing rows with copies of fresh row 0 that train on nothing (``loss_mask = 0``; the
fixed row count keeps the learner's shapes static), as :mod:`treejax.rl.replay` does; the rows are joined with its
:func:`~treejax.rl.replay.append_rows`.

Unlike :class:`~treejax.rl.replay.ReplayConfig`, which trains stored *rollouts* again (off-policy, with decoupled
PPO's correction), a replayed failure is *re-rolled*: its rows are a fresh sample of the current policy on that
prompt, so no importance correction is needed, every estimator input of the wrapped source is computed for them,
and the estimator sees each replayed prompt as its own group. ``reward/accuracy`` counts the fresh rows only.

Metrics: ``deeptravel/buffer_prompts``, ``replayed_prompts``, ``replay_success`` (mean success rate of the
replayed rows), ``recovered`` / ``dropped`` (replayed prompts that left the buffer solved / after
``max_attempts``), ``added`` (fresh failures that joined). The buffer is saved in the checkpoint
(``"failure_replay"``: host copies, pickled, compressed and base64-encoded, as the rollout replay's buffer).

Reconstructed (only the paper's abstract and secondary summaries were available): what counts as a failure (a
success rate at most ``max_success``, by default 0: the prompts every rollout failed, whose GRPO group carries no
signal when they are drawn), re-rolling instead of re-training stored trajectories, the FIFO order, the period,
the number of replayed rows and the attempt limit; the paper says only that the agent "periodically replays from a
failures experience buffer".
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.replay import _host_rows, append_rows
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import VERIFIER

#: ``fold_in`` stream of the replayed prompts' rollout key (the fresh rollout keeps the step's key).
REPLAY_STREAM = 48_021


@dataclasses.dataclass(frozen=True)
class FailureReplayConfig(Stage):
    """DeepTravel's failure replay (module docstring): ``rows`` replayed prompt rows per step, every ``period``
    steps, from a FIFO of at most ``capacity`` failed prompts (success rate <= ``max_success``), each replayed at
    most ``max_attempts`` times."""

    rows: int = 2
    capacity: int = 64
    period: int = 1
    max_success: float = 0.0
    max_attempts: int = 3

    role: ClassVar[str] = "wrapper"  # rolls failed prompts of the multi-turn source again
    requires: ClassVar[tuple] = (VERIFIER,)
    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})

    def __post_init__(self):
        for name, default in (("rows", 2), ("period", 1), ("max_attempts", 3)):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"FailureReplayConfig.{name} must be an integer >= 1, got {v!r}; fix: "
                                  f"FailureReplayConfig.{name} = {default}")
        if not (isinstance(self.capacity, int) and self.capacity >= self.rows):
            raise ConfigError(f"FailureReplayConfig.capacity must be an integer >= rows ({self.rows}), got "
                              f"{self.capacity!r}; fix: FailureReplayConfig.capacity = {max(64, self.rows)}")
        if not (isinstance(self.max_success, (int, float)) and 0.0 <= self.max_success < 1.0):
            raise ConfigError(f"FailureReplayConfig.max_success must be in [0, 1) (a prompt solved by every rollout is "
                              f"no failure), got {self.max_success!r}; fix: FailureReplayConfig.max_success = 0.0")

    def added_rows(self) -> int:
        return self.rows

    def build(self, inner, ctx):
        return FailureReplayRollouts(inner, self)


@dataclasses.dataclass
class Failed:
    """A failed prompt in the buffer: its example, prompt tokens and length, ``uid``, the step it failed at and how
    often it was replayed."""

    example: Any
    prompt: np.ndarray
    length: np.ndarray
    uid: str
    step: int
    attempts: int = 0


def uid_of(example) -> str:
    meta = getattr(example, "metadata", None) or {}
    return str(meta.get("uid", meta.get("question", id(example))))


def success_rates(ro) -> np.ndarray:
    """float[P]: each row's share of leaf slots scored correct (``Rollouts.correct_PxW``)."""
    return np.asarray(ro.correct_PxW, np.float64).mean(axis=1)


class FailureReplayRollouts:
    """The loop's source with DeepTravel's failure replay (module docstring). ``base``: a multi-turn source (its
    ``sample`` draws the step's prompts, its ``roll`` rolls given ones)."""

    def __init__(self, base, config: FailureReplayConfig):
        if not callable(getattr(base, "roll", None)):
            raise ConfigError(f"FailureReplayConfig wraps a source that can roll given prompts again (multi-turn "
                              f"rollouts), not {type(base).__name__}; fix: RunConfig.rollouts = [@MultiTurnConfig(), "
                              "@FailureReplayConfig()]")
        self.base, self.config = base, config
        self.pipeline = base.pipeline
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.buffer: collections.deque[Failed] = collections.deque()

    def sample(self, params, key, step):
        cfg = self.config
        fresh = self.base.sample(params, key, step)
        chosen = list(self.buffer)[:cfg.rows] if step % cfg.period == 0 else []
        filler = dataclasses.replace(_host_rows(fresh, step)[0], step=step)
        replayed, rates = [], np.zeros(0)
        if chosen:
            again = self.base.roll(params, jax.random.fold_in(key, REPLAY_STREAM), [f.example for f in chosen],
                                   np.stack([f.prompt for f in chosen]), np.stack([f.length for f in chosen]))
            replayed, rates = _host_rows(again, step), success_rates(again)
            fresh_counters = fresh.counters + again.counters
        else:
            fresh_counters = fresh.counters
        metrics = self.update(chosen, rates, fresh, step)
        metrics.update({"deeptravel/replayed_prompts": len(chosen),
                        "deeptravel/replay_success": float(np.mean(rates)) if len(rates) else 0.0})
        out = append_rows(fresh, replayed + [filler] * (cfg.rows - len(chosen)), len(chosen), metrics)
        out.counters = fresh_counters
        return out

    def update(self, chosen: list[Failed], rates: np.ndarray, fresh, step: int) -> dict:
        """The buffer after a step: replayed prompts that now succeed leave (recovered), those still failing go to
        the back until ``max_attempts``; fresh failures join (not twice); the oldest leave past ``capacity``."""
        cfg = self.config
        picked = {id(f) for f in chosen}
        self.buffer = collections.deque(f for f in self.buffer if id(f) not in picked)
        recovered = dropped = added = 0
        for f, rate in zip(chosen, rates):
            if rate > cfg.max_success:
                recovered += 1
            elif f.attempts + 1 >= cfg.max_attempts:
                dropped += 1
            else:
                self.buffer.append(dataclasses.replace(f, attempts=f.attempts + 1))
        held = {f.uid for f in self.buffer} | {f.uid for f in chosen}
        prompts, lengths = np.asarray(fresh.prompts_PxLp), np.asarray(fresh.lengths_P)
        for p, rate in enumerate(success_rates(fresh)[:fresh.main_rows]):
            uid = uid_of(fresh.examples[p])
            if rate <= cfg.max_success and uid not in held:
                self.buffer.append(Failed(fresh.examples[p], prompts[p], lengths[p], uid, step))
                held.add(uid)
                added += 1
        while len(self.buffer) > cfg.capacity:
            self.buffer.popleft()
        return {"deeptravel/buffer_prompts": len(self.buffer), "deeptravel/recovered": recovered,
                "deeptravel/dropped": dropped, "deeptravel/added": added}

    def checkpoint_state(self) -> dict:
        """The wrapped source's state and the buffer (``"failure_replay"``)."""
        return {**getattr(self.base, "checkpoint_state", dict)(), "failure_replay": encode_blob(list(self.buffer))}

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        text = data_state.get("failure_replay")
        self.buffer = collections.deque(decode_blob(text) if text else [])


__all__ = ["Failed", "FailureReplayConfig", "FailureReplayRollouts", "REPLAY_STREAM", "success_rates", "uid_of"]
