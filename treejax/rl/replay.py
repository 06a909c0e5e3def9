"""Rollout replay (DOTS + rollout replay, arXiv 2506.05316): part of each step's batch is recent rollouts again.

:class:`ReplayRollouts` wraps the loop's source: each step it samples ``prompts_per_step`` fresh prompt rows
(the source's own call), appends ``ReplayConfig.rows`` rows from a FIFO buffer of earlier steps' rows (newest
first), and then pushes the fresh rows into the buffer (``capacity`` rows; the oldest drop out, and so does any
row older than ``max_age`` steps). Before the buffer holds enough, the missing replay rows are copies of fresh
row 0 that train on nothing (``loss_mask = 0``). With ``informative_only`` only rows whose ``W`` rewards are not
all equal enter the buffer (an all-equal group has zero group-relative advantage: replaying it costs a forward
and teaches nothing).

A replayed row keeps what it was sampled with: its tokens, rewards and the sampler's log-probs ``log q`` of the
policy version that decoded it. The learner recomputes ``log pi_prox`` with the current weights (``old_logp =
"trainer"``: the PPO ratio's denominator, so the clip acts on the current policy's trust region) and the loss
weights each token by ``min(pi_prox / q, C)`` (``LossConfig.tis_cap = C``): the importance correction of
decoupled PPO, the same as for asynchronous rollouts (:mod:`treejax.rl.collect`). Both are required.
The estimator sees every row as its prompt's own group (replayed rewards are not re-scored).

Metrics: ``replay/buffer_rows``, ``replay/replayed_rows``, ``replay/mean_age`` / ``replay/max_age`` (steps since
a replayed row was sampled). The buffer is saved in the checkpoint (host copies, pickled, compressed and
base64-encoded into the JSON data state): a resumed run replays exactly what the uninterrupted one would.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import OFF_POLICY, VERIFIER


@dataclasses.dataclass(frozen=True)
class ReplayConfig(Stage):
    """Rollout replay (module docstring): ``rows`` replayed prompt rows per step, a FIFO of ``capacity`` rows,
    none older than ``max_age`` steps, only informative rows with ``informative_only``."""

    rows: int = 4
    capacity: int = 32
    max_age: int = 4
    informative_only: bool = True

    role: ClassVar[str] = "wrapper"  # stores the rows of the source before it and trains some again
    requires: ClassVar[tuple] = (VERIFIER, OFF_POLICY)
    needs: ClassVar[frozenset[str]] = frozenset({"replayable_rows"})
    keeps: ClassVar[frozenset[str]] = frozenset()
    passes_inputs: ClassVar[bool] = False  # a replayed row keeps no estimator inputs

    def added_rows(self) -> int:
        return self.rows

    def build(self, inner, ctx):
        return ReplayRollouts(inner, self)

    def __post_init__(self):
        if self.rows < 1 or self.capacity < self.rows or self.max_age < 1:
            raise ConfigError(f"ReplayConfig: rows >= 1, capacity >= rows and max_age >= 1 required, got {self}")


@dataclasses.dataclass
class _Row:
    """One prompt row as host arrays: its forest row, rewards, scores, example, prompt, estimator inputs."""

    step: int
    forest: object
    rewards: np.ndarray
    scores: np.ndarray | None
    reward_scores: np.ndarray | None
    example: object
    prompt: np.ndarray
    length: np.ndarray
    inputs: dict


class ReplayRollouts:
    """The loop's source with rollout replay (module docstring). ``base``: a source whose ``sample`` returns
    ``prompts_per_step`` rows (``TaskRollouts``)."""

    def __init__(self, base, config: ReplayConfig):
        self.base, self.config = base, config
        self.pipeline = base.pipeline  # the prompt pipeline a checkpoint saves and a resume restores
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.buffer: collections.deque[_Row] = collections.deque()

    # -------------------------------------------------------------------------------------------- the step
    def sample(self, params, key, step):
        fresh = self.base.sample(params, key, step)
        cfg = self.config
        self.buffer = collections.deque(r for r in self.buffer if step - r.step <= cfg.max_age)
        chosen = list(self.buffer)[-cfg.rows:][::-1]  # newest first
        host = _host_rows(fresh, step)
        filler = cfg.rows - len(chosen)
        rows = chosen + [dataclasses.replace(host[0], step=step)] * filler
        ages = [step - r.step for r in chosen]
        ro = append_rows(fresh, rows, len(chosen), {
            "replay/buffer_rows": len(self.buffer), "replay/replayed_rows": len(chosen),
            "replay/mean_age": float(np.mean(ages)) if ages else 0.0, "replay/max_age": max(ages) if ages else 0})
        for r in host:  # the fresh rows join the buffer after the step's replay was chosen
            if not cfg.informative_only or not np.all(r.rewards == r.rewards[0]):
                self.buffer.append(r)
        while len(self.buffer) > cfg.capacity:
            self.buffer.popleft()
        return ro

    # -------------------------------------------------------------------------------------- checkpoints
    def state(self) -> str:
        """The buffer as one JSON-safe string (host copies)."""
        return encode_blob(list(self.buffer))

    def set_state(self, text: str | None) -> None:
        self.buffer = collections.deque(decode_blob(text) if text else [])

    def checkpoint_state(self) -> dict:
        """The wrapped source's state and the buffer (``"replay_buffer"``)."""
        return {**getattr(self.base, "checkpoint_state", dict)(), "replay_buffer": self.state()}

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        self.set_state(data_state.get("replay_buffer"))


def _host_rows(ro, step: int) -> list[_Row]:
    """The fresh rollouts' rows as host copies (one device read)."""
    forest, rewards, inputs = jax.device_get((ro.forest, ro.rewards_PxW, ro.estimator_inputs))
    out = []
    for p in range(np.asarray(rewards).shape[0]):
        out.append(_Row(step=step, forest=jax.tree.map(lambda x: np.asarray(x)[p], forest),
                        rewards=np.asarray(rewards)[p],
                        scores=None if ro.scores_PxW is None else np.asarray(ro.scores_PxW)[p],
                        reward_scores=None if ro.reward_scores_PxW is None else np.asarray(ro.reward_scores_PxW)[p],
                        example=None if ro.examples is None else ro.examples[p], prompt=np.asarray(ro.prompts_PxLp)[p],
                        length=np.asarray(ro.lengths_P)[p], inputs={k: np.asarray(v)[p] for k, v in inputs.items()}))
    return out


def _forest_of(rows: list[_Row]):
    """The rows' forest rows stacked into one forest."""
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *[r.forest for r in rows])


def append_rows(fresh, rows: list[_Row], live: int, metrics: dict):
    """``fresh`` (this step's :class:`~treejax.rl.rollouts.Rollouts`) with the host ``rows`` appended after its own
    rows (replayed rows here, rows shared by other processes in :mod:`treejax.rl.sapo`); rows ``live..`` of
    ``rows`` are fillers that train on nothing (``loss_mask = 0``). ``fresh_rows`` marks the fresh ones (the
    step's ``reward/accuracy``); ``metrics`` join the source's ``extra_metrics``."""
    from treejax.rl.rollouts import Rollouts, concat_forests

    added = _forest_of(rows)
    mask = np.ones((len(rows), 1, 1), np.float32)
    mask[live:] = 0.0
    added = added.replace(loss_mask=added.loss_mask * jnp.asarray(mask))
    return Rollouts(
        forest=concat_forests([fresh.forest, added]),
        rewards_PxW=jnp.concatenate([fresh.rewards_PxW, jnp.asarray(np.stack([r.rewards for r in rows]))]),
        scores_PxW=None if fresh.scores_PxW is None else np.concatenate(
            [fresh.scores_PxW, np.stack([r.scores for r in rows])]),
        prompts_PxLp=np.concatenate([fresh.prompts_PxLp, np.stack([r.prompt for r in rows])]),
        lengths_P=np.concatenate([fresh.lengths_P, np.stack([r.length for r in rows])]),
        counters=fresh.counters,
        estimator_inputs={k: jnp.concatenate([v, jnp.asarray(np.stack([r.inputs[k] for r in rows]))])
                          for k, v in fresh.estimator_inputs.items()},
        examples=None if fresh.examples is None else list(fresh.examples) + [r.example for r in rows],
        reward_scores_PxW=None if fresh.reward_scores_PxW is None else np.concatenate(
            [fresh.reward_scores_PxW, np.stack([r.reward_scores for r in rows])]),
        fresh_rows=fresh.num_rows, extra_metrics={**(fresh.extra_metrics or {}), **metrics})


__all__ = ["ReplayConfig", "ReplayRollouts", "append_rows"]
