"""SPEAR (arXiv 2509.22601, "Learn the Ropes, Then Trust the Wins"): self-imitation with progressive exploration
for multi-turn tool use, as a wrapper of :class:`treejax.rl.multiturn.MultiTurnRollouts`.

:class:`SpearRollouts` changes a step's rollouts in two ways (the learner is untouched but for one hook):

1. **Tool-call bonus** (skill-level exploration early on). Each leaf slot's reward, the one the estimator sees,
   gets ``b(step) = min(bonus_cap, bonus_per_call * c) * d(step)`` added, ``c`` the slot's tool calls that ran
   cleanly (``Rollouts.tool_calls_PxW``) and ``d`` the cosine decay ``(1 + cos(pi * step / bonus_steps)) / 2``
   for ``step <= bonus_steps``, ``0`` after. The official code's bonus is ``min(1, 0.1 * n) * d`` with ``n``
   the episode's environment steps (every step there is a tool call) and ``bonus_steps = 200``; here only calls
   that ran cleanly count (a failed call is not a skill learnt).

2. **Self-imitation (SIL) rows with advantage recalibration** (action-level exploitation later on). A buffer
   keeps successful trajectories: leaf slots with verifier score 1 whose reward (as the estimator sees it) is
   above their prompt's mean (GRPO's advantage sign: the positive-advantage proxy; the advantages themselves are
   the learner's); each distinct path is stored once (a path holding several slots is one trajectory), with its
   prompt, its turn spans, tokens, the sampler's log-probs (the behaviour policy ``q``), ``policy_mask`` and its
   task reward (without the bonus). A sliding window keeps the last ``baseline_window`` prompt-group mean task
   rewards; the baseline is their ``baseline_percentile``-th percentile (official code: the 50th percentile of
   the group means of the last 10240 groups). Each step, after dropping entries older than ``max_age`` steps,
   every entry's advantage is recalibrated: ``A = R - baseline``; entries with ``A <= 0`` (wins no longer better
   than what the policy now gets typically) leave the buffer. Up to ``sil_rows`` entries (a random draw, without
   replacement; each win is replayed once and then leaves the buffer, as the official buffer is emptied after
   it is replayed) become extra rows of the batch, after the fresh rows: one prompt row per trajectory, its ``W``
   slots all copies of the trajectory's chain of turns, only slot 0 in the loss (``loss_mask`` = its
   ``policy_mask``: observations stay out). The row's advantage is fixed by the source
   (``Rollouts.fixed_advantage_PxW``), ``w(step) * A`` on every policy token, with the SIL weight's curriculum
   ``w(step) = sil_coef * (1 - cos(pi * min(step, sil_warmup_steps) / sil_warmup_steps)) / 2`` rising from 0
   (official code: ``replay_loss_coef = 1`` over 100 steps, applied to the replay loss; the PPO-clip loss is
   linear in a non-negative scale of the advantage, so scaling ``A`` is the same thing). Missing rows (short
   buffer) are copies of fresh row 0's first slot with ``loss_mask = 0``.

Staleness (as :mod:`treejax.rl.replay`): a replayed row keeps the sampler's log-probs of the policy that decoded
it; the learner recomputes ``log pi_prox`` with the current weights (``old_logp = "trainer"``) and weights each
token by ``min(pi_prox / q, C)`` (``LossConfig.tis_cap``). The official code instead keeps the behaviour
log-probs as PPO's denominator (its buffer is at most 5 steps old); decoupled PPO keeps the clip on the current
policy's trust region.

Not implemented: the paper's covariance-based clipping of SIL tokens (Clip-Cov on the replay loss: among tokens
whose ``(A - mean A)(log pi - mean log pi)`` lies in ``[lb, ub]`` = ``[2, 60]``, a random ``0.02`` of them get
no gradient). It needs the *current* log-probs inside the jitted update of each mini-batch, a key for the draw,
and a per-row "replayed" flag carried through both update layouts (expanded and packed) into the loss: none of
that passes through the ``Rollouts`` hand-off, so a source wrapper cannot do it (a loss change, left out rather
than half-wired). Also not: the paper's prioritised (power-of-two) subsampling of the buffer.

Metrics: ``spear/tool_bonus`` (``d(step) * bonus_per_call``, the bonus of one call now), ``spear/bonus_mean``
(mean bonus added per slot), ``spear/sil_weight`` (``w(step)``), ``spear/baseline``, ``spear/buffer_size``,
``spear/added`` (wins stored this step), ``spear/stale_dropped`` (dropped by recalibration),
``spear/aged_out``, ``spear/replayed_rows``, ``spear/sil_adv_mean`` (mean recalibrated ``A`` of the replayed
rows, before ``w``), ``spear/mean_age``. The buffer and the baseline window are saved in the checkpoint
(``"spear_state"``); the schedules are functions of the step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import EXPANDED, OFF_POLICY

#: fold_in stream of the SIL rows' draw
SPEAR_STREAM = 0x5BEA2


@dataclasses.dataclass(frozen=True)
class SpearConfig(Stage):
    """SPEAR's knobs (module docstring). Defaults and their sources:

    * ``bonus_per_call = 0.1``, ``bonus_cap = 1.0``, ``bonus_steps = 200``: the official code's tool-call reward
      (``min(1, 0.1 n)``, cosine decay over ``max_toolcall_steps = 200``).
    * ``sil_coef = 1.0``, ``sil_warmup_steps = 100``: the official scripts' ``replay_loss_coef = 1`` and
      100 ascending steps of the SIL loss weight.
    * ``baseline_percentile = 50``: the official recalibration's 50th percentile of recent group means.
    * ``baseline_window = 1024`` group means: ours (official: 10240 groups at 32 groups per step = 320 steps;
      1024 at this repo's 8 prompts per step is 128 steps).
    * ``max_age = 5``: the official ``tolerate_steps = 5`` (entries older than that leave the buffer).
    * ``capacity = 128``, ``sil_rows = 8``: ours, sized for 8 prompts x 8 slots per step (official: 2048
      trajectories, replayed all at once when more than 1.5x that is stored).
    * ``min_score = 1.0``: a win is a slot the verifier scored 1 (the task's success).
    """

    sil_rows: int = 8
    capacity: int = 128
    max_age: int = 5
    baseline_window: int = 1024
    baseline_percentile: float = 50.0
    bonus_per_call: float = 0.1
    bonus_cap: float = 1.0
    bonus_steps: int = 200
    sil_coef: float = 1.0
    sil_warmup_steps: int = 100
    min_score: float = 1.0

    role: ClassVar[str] = "wrapper"  # tool-call bonus and self-imitation rows on multi-turn episodes
    requires: ClassVar[tuple] = (OFF_POLICY, EXPANDED)
    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})
    keeps: ClassVar[frozenset[str]] = frozenset()

    def added_rows(self) -> int:
        return self.sil_rows

    def build(self, inner, ctx):
        return SpearRollouts(inner, self)

    def __post_init__(self):
        if self.sil_rows < 1 or self.capacity < self.sil_rows or self.max_age < 1 or self.baseline_window < 1:
            raise ConfigError(f"SpearConfig: sil_rows >= 1, capacity >= sil_rows, max_age >= 1 and "
                              f"baseline_window >= 1 required, got {self}")
        if not 0.0 <= self.baseline_percentile <= 100.0:
            raise ConfigError(f"SpearConfig.baseline_percentile must be in [0, 100], got {self.baseline_percentile}")
        if self.bonus_per_call < 0 or self.bonus_cap < 0 or self.bonus_steps < 0:
            raise ConfigError(f"SpearConfig: bonus_per_call, bonus_cap >= 0 and bonus_steps >= 0 required "
                              f"(bonus_steps = 0: no bonus), got {self}")
        if self.sil_coef < 0 or self.sil_warmup_steps < 0:
            raise ConfigError(f"SpearConfig: sil_coef >= 0 and sil_warmup_steps >= 0 required (0: full weight "
                              f"from the start), got {self}")

    def bonus_decay(self, step: int) -> float:
        """``d(step) = (1 + cos(pi * step / bonus_steps)) / 2`` for ``step <= bonus_steps``, else 0."""
        if self.bonus_steps == 0 or step > self.bonus_steps:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * step / self.bonus_steps))

    def tool_bonus(self, calls, step: int) -> np.ndarray:
        """The reward bonus of slots with ``calls`` clean tool calls at ``step``."""
        calls = np.asarray(calls, np.float32)
        return (np.minimum(self.bonus_cap, self.bonus_per_call * calls) * self.bonus_decay(step)).astype(np.float32)

    def sil_weight(self, step: int) -> float:
        """``w(step) = sil_coef * (1 - cos(pi * min(step, T) / T)) / 2`` (``T = sil_warmup_steps``; ``sil_coef``
        when ``T = 0``)."""
        if self.sil_warmup_steps == 0:
            return self.sil_coef
        x = min(step, self.sil_warmup_steps) / self.sil_warmup_steps
        return self.sil_coef * 0.5 * (1.0 - math.cos(math.pi * x))


@dataclasses.dataclass
class Trajectory:
    """One stored win (host arrays): its prompt, turn lengths (its chain of nodes), response tokens, the sampler's
    log-probs, who wrote each token, its end status, task reward, score, the step it was sampled at, example."""

    step: int
    prompt: np.ndarray
    prompt_length: int
    node_lengths: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    policy_mask: np.ndarray
    status: int
    reward: float
    score: float
    example: object = None


class SpearRollouts:
    """The multi-turn source with SPEAR (module docstring). ``base``: :class:`MultiTurnRollouts` (or any source
    whose rollouts carry ``tool_calls_PxW`` and a span forest)."""

    def __init__(self, base, config: SpearConfig):
        self.base, self.config = base, config
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.buffer: list[Trajectory] = []
        self.window: collections.deque[float] = collections.deque(maxlen=config.baseline_window)

    def baseline(self) -> float:
        """The recalibration baseline: the ``baseline_percentile``-th percentile of the window (0 when empty)."""
        return float(np.percentile(np.asarray(self.window), self.config.baseline_percentile)) if self.window else 0.0

    # -------------------------------------------------------------------------------------------- the step
    def sample(self, params, key, step):
        from treejax.rl.rollouts import Rollouts, concat_forests

        cfg = self.config
        fresh = self.base.sample(params, key, step)
        if fresh.tool_calls_PxW is None:
            raise ValueError("SpearRollouts: the base source's rollouts carry no tool_calls_PxW (a multi-turn source "
                             "supplies them)")
        task_rewards = np.asarray(jax.device_get(fresh.rewards_PxW), np.float32)
        bonus = cfg.tool_bonus(fresh.tool_calls_PxW, step)
        rewards = task_rewards + bonus
        self.window.extend(float(x) for x in task_rewards.mean(axis=1))
        base_line = self.baseline()
        # ageing, then recalibration: A = R - baseline; stale wins (A <= 0) leave
        n0 = len(self.buffer)
        self.buffer = [t for t in self.buffer if step - t.step <= cfg.max_age]
        aged_out = n0 - len(self.buffer)
        n1 = len(self.buffer)
        self.buffer = [t for t in self.buffer if t.reward - base_line > 0]
        stale = n1 - len(self.buffer)
        rng = np.random.default_rng(np.asarray(jax.random.key_data(jax.random.fold_in(key, SPEAR_STREAM))))
        k = min(cfg.sil_rows, len(self.buffer))
        picked = sorted(rng.choice(len(self.buffer), size=k, replace=False).tolist()) if k else []
        chosen = [self.buffer[i] for i in picked]
        self.buffer = [t for i, t in enumerate(self.buffer) if i not in set(picked)]  # each win replayed once
        host = jax.device_get(fresh.forest)
        filler = _trajectory(host, np.asarray(fresh.prompts_PxLp)[0], int(np.asarray(fresh.lengths_P)[0]), 0, 0,
                             step, float(task_rewards[0, 0]), 0.0, None)
        rows = chosen + [filler] * (cfg.sil_rows - k)
        W, T, N = fresh.forest.num_leaves, fresh.forest.max_response_length, fresh.forest.node_parent.shape[1]
        D = fresh.forest.max_depth
        sil = sil_forest(rows, W, T, N, D).replace(segment_length=fresh.forest.segment_length)
        train = np.zeros((cfg.sil_rows, W, 1), np.float32)
        train[:k, 0] = 1.0  # one trained slot per replayed trajectory; fillers train on nothing
        sil = sil.replace(loss_mask=sil.loss_mask * jnp.asarray(train))
        adv = np.array([t.reward - base_line for t in chosen], np.float32)
        w = cfg.sil_weight(step)
        fixed = np.full((fresh.num_rows + cfg.sil_rows, W), np.nan, np.float32)
        fixed[fresh.num_rows:] = 0.0
        fixed[fresh.num_rows:fresh.num_rows + k] = (w * adv)[:, None]
        Lp = np.asarray(fresh.prompts_PxLp).shape[1]
        prompts = np.stack([_fit(t.prompt, Lp) for t in rows])
        sil_rewards = np.array([[t.reward] * W for t in rows], np.float32)
        sil_scores = np.array([[t.score] * W for t in rows], np.float32)
        ages = [step - t.step for t in chosen]
        metrics = {**(fresh.extra_metrics or {}), "spear/tool_bonus": cfg.bonus_per_call * cfg.bonus_decay(step),
                   "spear/bonus_mean": float(bonus.mean()), "spear/sil_weight": w, "spear/baseline": base_line,
                   "spear/stale_dropped": stale, "spear/aged_out": aged_out, "spear/replayed_rows": k,
                   "spear/sil_adv_mean": float(adv.mean()) if k else 0.0,
                   "spear/mean_age": float(np.mean(ages)) if ages else 0.0}
        inputs = {name: jnp.concatenate([v, jnp.repeat(v[:1], cfg.sil_rows, axis=0)])
                  for name, v in fresh.estimator_inputs.items()}
        ro = Rollouts(
            forest=concat_forests([fresh.forest, sil]),
            rewards_PxW=jnp.asarray(np.concatenate([rewards, sil_rewards])),
            scores_PxW=None if fresh.scores_PxW is None else np.concatenate([np.asarray(fresh.scores_PxW), sil_scores]),
            prompts_PxLp=np.concatenate([np.asarray(fresh.prompts_PxLp), prompts]),
            lengths_P=np.concatenate([np.asarray(fresh.lengths_P), np.array([t.prompt_length for t in rows])]),
            counters=fresh.counters, estimator_inputs=inputs,
            examples=None if fresh.examples is None else list(fresh.examples) + [t.example for t in rows],
            reward_scores_PxW=None if fresh.reward_scores_PxW is None else np.concatenate(
                [np.asarray(fresh.reward_scores_PxW), sil_scores]),
            fresh_rows=fresh.num_rows, extra_metrics=metrics,
            tool_calls_PxW=np.concatenate([np.asarray(fresh.tool_calls_PxW), np.zeros((cfg.sil_rows, W), np.int32)]),
            fixed_advantage_PxW=fixed)
        added = self._store(fresh, host, task_rewards, rewards, step)
        ro.extra_metrics["spear/added"] = added
        ro.extra_metrics["spear/buffer_size"] = len(self.buffer)
        return ro

    def _store(self, fresh, host, task_rewards, rewards, step) -> int:
        """The step's wins join the buffer (after the step's SIL rows were chosen); the oldest leave past
        ``capacity``. Returns how many joined."""
        cfg = self.config
        scores = np.asarray(fresh.scores_PxW if fresh.reward_scores_PxW is None else fresh.reward_scores_PxW)
        distinct = np.asarray(host.distinct_leaves())
        positive = rewards > rewards.mean(axis=1, keepdims=True)
        added = 0
        for p, w in zip(*np.nonzero((scores >= cfg.min_score) & positive & distinct)):
            self.buffer.append(_trajectory(host, np.asarray(fresh.prompts_PxLp)[p], int(np.asarray(fresh.lengths_P)[p]),
                                           int(p), int(w), step, float(task_rewards[p, w]), float(scores[p, w]),
                                           None if fresh.examples is None else fresh.examples[p]))
            added += 1
        if len(self.buffer) > cfg.capacity:
            self.buffer = self.buffer[len(self.buffer) - cfg.capacity:]
        return added

    # -------------------------------------------------------------------------------------- checkpoints
    def state(self) -> str:
        """The buffer and the baseline window as one JSON-safe string (host copies)."""
        return encode_blob({"buffer": list(self.buffer), "window": list(self.window)})

    def set_state(self, text: str | None) -> None:
        data = decode_blob(text) if text else {"buffer": [], "window": []}
        self.buffer = list(data["buffer"])
        self.window = collections.deque(data["window"], maxlen=self.config.baseline_window)

    def checkpoint_state(self) -> dict:
        """The wrapped source's state and SPEAR's (``"spear_state"``)."""
        return {**getattr(self.base, "checkpoint_state", dict)(), "spear_state": self.state()}

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        self.set_state(data_state.get("spear_state"))


def _fit(x: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n,), np.asarray(x).dtype)
    out[:min(n, len(x))] = x[:n]
    return out


def _trajectory(host, prompt, prompt_length, p, w, step, reward, score, example) -> Trajectory:
    """Leaf slot ``(p, w)`` of the host forest ``host`` as a :class:`Trajectory`."""
    path = np.asarray(host.leaf_path)[p, w, 1:]
    ids = path[path >= 0]
    lengths = np.asarray(host.spans())[p, ids, 1]
    L = int(np.asarray(host.leaf_length)[p, w])
    pm = np.asarray(host.policy_tokens())[p, w, :L]
    return Trajectory(step=step, prompt=np.asarray(prompt).copy(), prompt_length=prompt_length,
                      node_lengths=np.asarray(lengths, np.int32).copy(), tokens=np.asarray(host.tokens)[p, w, :L].copy(),
                      logprobs=np.asarray(host.logprobs)[p, w, :L].copy(), policy_mask=pm.astype(np.float32).copy(),
                      status=int(np.asarray(host.leaf_status)[p, w]), reward=reward, score=score, example=example)


def sil_forest(rows: list[Trajectory], W: int, T: int, N: int, D: int):
    """The SIL rows' forest: row ``r`` is trajectory ``rows[r]`` as a chain of turn nodes ``1..d``, held by all
    ``W`` slots (leaf weight 1 each); ``loss_mask`` = its ``policy_mask`` (observations never in the loss)."""
    from treejax.forest import forest_from_spans

    R = len(rows)
    path = np.full((R, W, D + 1), -1, np.int32)
    path[:, :, 0] = 0
    node_length = np.zeros((R, N), np.int64)
    tokens = np.zeros((R, W, T), np.int32)
    logprobs = np.zeros((R, W, T), np.float32)
    pmask = np.zeros((R, W, T), np.float32)
    status = np.zeros((R, W), np.int32)
    for r, t in enumerate(rows):
        d, L = len(t.node_lengths), len(t.tokens)
        if d > D or d + 1 > N or L > T:
            raise ValueError(f"SpearRollouts: a stored trajectory ({d} turns, {L} tokens) does not fit the forest "
                             f"(D={D}, N={N}, T={T})")
        path[r, :, 1:d + 1] = np.arange(1, d + 1)
        node_length[r, 1:d + 1] = t.node_lengths
        tokens[r, :, :L], logprobs[r, :, :L], pmask[r, :, :L] = t.tokens, t.logprobs, t.policy_mask
        status[r] = t.status
    return forest_from_spans(path, node_length, tokens, logprobs=logprobs, policy_mask=pmask, leaf_status=status,
                             max_response_length=T, leaf_weight=np.ones((R, W), np.float32))


__all__ = ["SpearConfig", "SpearRollouts", "Trajectory", "sil_forest"]
