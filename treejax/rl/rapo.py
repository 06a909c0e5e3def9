"""RAPO's rollout side for agentic search (issue 48): curriculum pruning and per-prompt replay, as a wrapper of the
multi-turn source (:class:`treejax.rl.multiturn.MultiTurnRollouts`). Its credit side, the reward-aware advantage
scaling and the step-level tool-call reward, is the estimator ``rapo`` (:mod:`treejax.rl.advantages.rapo`).

gin: ``RunConfig.rollouts = [@MultiTurnConfig(), @RAPOConfig()]`` (``configs/multiturn_retrieval_rapo.gin``).
Per prompt, keyed by :func:`treejax.rl.allocation.base.prompt_key` (a hash of its question), and per step:

1. **Curriculum pruning.** ``k_q`` counts prompt q's consecutive visits whose every episode was solved (verifier
   score ``>= min_score``; any other visit resets it to 0). Once ``k_q >= prune_after`` the prompt is *mastered*:
   GRPO's group gives it zero advantage, so its episodes cost decode time and teach nothing, and it leaves the
   curriculum. The wrapper filters the inner source's prompt draw (its ``draw`` seam): each step draws batches of
   ``P`` from the pipeline until ``P`` unpruned prompts are found, at most ``max_draws`` batches; surplus unpruned
   prompts of the last batch are dropped (a later epoch draws them again); if the stream runs short, pruned prompts
   of the drawn batches fill the step (``rapo/refilled``), so a step always has ``P`` prompts.
2. **Per-prompt replay.** A bank keeps each prompt's newest solved episode (the first distinct slot of the step
   with score ``>= min_score``; its tokens, the sampler's log-probs, who wrote each token, its turn spans, task
   reward, and its per-slot estimator inputs, e.g. ``tool_match_PxWxD``), at most ``bank_size`` prompts and none
   older than ``max_age`` steps. When a prompt's group this step has **no** solved episode and the bank holds one
   of its own, that episode replaces the group's last slot (``W - 1``): the group is no longer all-fail, and its
   group-relative advantage is not zero. The replayed episode keeps the behaviour log-probs of the policy that
   decoded it; the learner recomputes ``log pi_prox`` (``old_logp = "trainer"``) and weights each token by
   ``min(pi_prox / q, LossConfig.tis_cap)`` (decoupled PPO, as :mod:`treejax.rl.replay`): required with
   ``replay``. The verifier's scores (``reward/accuracy``) keep the policy's own slot; only the reward the
   estimator sees changes.

What is reconstructed: the paper that describes RAPO's four parts as the issue names them was not found (a search
found only a different RAPO, arXiv 2603.03078, whose rollouts condition on retrieved off-policy step traces).
Chosen here: "pruning" = dropping mastered prompts from the draw (not too-hard ones: those are what the replay is
for), the all-solved streak rule and ``prune_after = 2``, pruning for the rest of the run, one stored episode per
prompt (the newest), injecting only into all-fail groups and into the last slot, and keeping the behaviour
log-probs with TIS (the behaviour policy of a replayed episode is known, so no re-scoring is needed).

Metrics: ``rapo/pruned_prompts`` (pruned so far), ``rapo/skipped`` (pruned prompts passed over by this step's
draw), ``rapo/refilled``, ``rapo/draws`` (pipeline batches drawn), ``rapo/zero_success_prompts``,
``rapo/replayed`` (slots replaced), ``rapo/replay_mean_age``, ``rapo/bank_size``. The streaks, the pruned set and
the bank are saved in the checkpoint (``"rapo_state"``); the pipeline's position is saved by the loop, so a
resumed run draws exactly what the uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.allocation.base import prompt_key
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import EXPANDED, OFF_POLICY, VERIFIER
from treejax.rl.spear import Trajectory
from treejax.rl.spear import _trajectory as slot_trajectory


@dataclasses.dataclass(frozen=True)
class RAPOConfig(Stage):
    """RAPO's curriculum pruning and per-prompt replay (module docstring): ``prune_after`` consecutive all-solved
    visits prune a prompt (0: no pruning); ``max_draws`` pipeline batches at most per step; ``replay``: replay a
    prompt's stored solved episode into its all-fail group; ``min_score``: a solved episode's verifier score;
    ``max_age``: steps a stored episode stays replayable; ``bank_size``: prompts whose newest solved episode is
    kept."""

    prune_after: int = 2
    max_draws: int = 4
    replay: bool = True
    min_score: float = 1.0
    max_age: int = 50
    bank_size: int = 4096

    role: ClassVar[str] = "wrapper"  # filters the multi-turn source's draw and replays solved episodes into it
    requires: ClassVar[tuple] = (VERIFIER,)
    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})
    keeps: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self):
        for name, low in (("prune_after", 0), ("max_draws", 1), ("max_age", 1), ("bank_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ConfigError(f"RAPOConfig.{name} must be an integer >= {low}, got {v!r}; fix: "
                                  f"RAPOConfig.{name} = {getattr(RAPOConfig, name)}")
        if not 0.0 < self.min_score <= 1.0:
            raise ConfigError(f"RAPOConfig.min_score must be in (0, 1] (a verifier score), got {self.min_score!r}; "
                              "fix: RAPOConfig.min_score = 1.0")
        if self.prune_after == 0 and not self.replay:
            raise ConfigError("RAPOConfig with prune_after = 0 and replay = False does nothing; fix: "
                              "RAPOConfig.prune_after = 2 (or drop @RAPOConfig() from RunConfig.rollouts)")

    def check(self, facts) -> None:
        """Replay trains tokens of older policies (decoupled PPO's correction), through the expanded update (its
        rebuilt rows are not verified with the packed one), and carries only per-slot estimator inputs."""
        if not self.replay:
            return
        for req in (OFF_POLICY, EXPANDED):
            if not req.holds(facts):
                raise ConfigError(req.message(f"{self.stage_name} (replay)", facts) + " (or RAPOConfig.replay = "
                                                                                       "False)")
        other = [i for i in facts.estimator_inputs if "_PxW" not in i]
        if other:
            raise ConfigError(f"RAPOConfig.replay moves whole episodes into a group and carries only per-slot "
                              f"estimator inputs ([P, W, ...]); estimator {facts.estimator!r} reads {other}; fix: "
                              "RunConfig.estimator = 'rapo' (or RAPOConfig.replay = False)")

    def build(self, inner, ctx):
        cfg = getattr(inner, "config", None)
        roots = getattr(cfg, "roots", None)
        W = ctx.cfg.rollout.num_leaves
        if self.replay and roots is not None and roots != W:
            raise ConfigError(f"RAPOConfig.replay writes one slot's whole episode, which needs independent episodes "
                              f"(MultiTurnConfig.roots = {roots}, {W} slots); fix: MultiTurnConfig.roots = None (or "
                              "RAPOConfig.replay = False)")
        return RAPORollouts(inner, self)


@dataclasses.dataclass
class Stored:
    """One prompt's stored solved episode: the episode, its per-slot estimator inputs, its clean tool calls."""

    episode: Trajectory
    inputs: dict
    tool_calls: int


class CurriculumDraw:
    """The inner source's prompt draw without the pruned prompts (module docstring, 1). ``last``: the metrics of
    the latest call."""

    def __init__(self, draw, config: RAPOConfig, pruned: set):
        self.inner, self.config, self.pruned, self.last = draw, config, pruned, {}

    def __call__(self):
        kept, spare, draws, P = [], [], 0, None
        while draws < self.config.max_draws:
            examples, prompts, lens = self.inner()
            draws, P = draws + 1, len(examples) if P is None else P
            for i, ex in enumerate(examples):
                (spare if prompt_key(ex) in self.pruned else kept).append((ex, prompts[i], lens[i]))
            if len(kept) >= P:
                break
        refilled = max(0, P - len(kept))
        rows = (kept + spare[:refilled])[:P]
        self.last = {"rapo/skipped": len(spare) - refilled, "rapo/refilled": refilled, "rapo/draws": draws}
        return ([r[0] for r in rows], np.stack([np.asarray(r[1]) for r in rows]),
                np.asarray([r[2] for r in rows]))


class RAPORollouts:
    """The multi-turn source with RAPO's curriculum pruning and per-prompt replay (module docstring). ``base``: a
    :class:`~treejax.rl.multiturn.MultiTurnRollouts` (any source with a ``draw`` seam and turn forests)."""

    def __init__(self, base, config: RAPOConfig):
        self.base, self.config = base, config
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.streak: dict[str, int] = {}
        self.pruned: set[str] = set()
        self.bank: dict[str, Stored] = {}
        self.draw = None
        if config.prune_after > 0:
            self.draw = base.draw = CurriculumDraw(base.draw, config, self.pruned)

    def sample(self, params, key, step):
        cfg = self.config
        fresh = self.base.sample(params, key, step)
        host = jax.device_get(fresh.forest)
        scores = np.asarray(fresh.scores_PxW if fresh.reward_scores_PxW is None else fresh.reward_scores_PxW)
        solved = scores >= cfg.min_score
        keys = [prompt_key(e) for e in fresh.examples]
        self.bank = {k: s for k, s in self.bank.items() if step - s.episode.step <= cfg.max_age}
        targets = [p for p in range(len(keys)) if cfg.replay and not solved[p].any() and keys[p] in self.bank]
        ro = self.replay_into(fresh, host, [self.bank[keys[p]] for p in targets], targets) if targets else fresh
        ages = [step - self.bank[keys[p]].episode.step for p in targets]
        if cfg.replay:
            self.store(fresh, host, keys, solved, step)
        self.update_curriculum(keys, solved)
        metrics = {**(self.draw.last if self.draw is not None else {}), "rapo/pruned_prompts": len(self.pruned),
                   "rapo/zero_success_prompts": int((~solved.any(-1)).sum()), "rapo/replayed": len(targets),
                   "rapo/replay_mean_age": float(np.mean(ages)) if ages else 0.0, "rapo/bank_size": len(self.bank)}
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics}
        return ro

    def update_curriculum(self, keys, solved) -> None:
        """Each drawn prompt's all-solved streak; a streak of ``prune_after`` prunes it (module docstring, 1)."""
        if self.config.prune_after == 0:
            return
        for k, row in zip(keys, solved):
            self.streak[k] = self.streak.get(k, 0) + 1 if row.all() else 0
            if self.streak[k] >= self.config.prune_after:
                self.pruned.add(k)

    def store(self, fresh, host, keys, solved, step) -> None:
        """Each prompt's newest solved episode joins the bank (its first distinct solved slot); the oldest stored
        prompts leave past ``bank_size``."""
        distinct = np.asarray(host.distinct_leaves())
        prompts, lens = np.asarray(fresh.prompts_PxLp), np.asarray(fresh.lengths_P)
        rewards = np.asarray(jax.device_get(fresh.rewards_PxW), np.float32)
        inputs = {k: np.asarray(jax.device_get(v)) for k, v in fresh.estimator_inputs.items()}
        calls = None if fresh.tool_calls_PxW is None else np.asarray(fresh.tool_calls_PxW)
        for p, k in enumerate(keys):
            hit = np.flatnonzero(solved[p] & distinct[p])
            if not hit.size:
                continue
            w = int(hit[0])
            ep = slot_trajectory(host, prompts[p], int(lens[p]), p, w, step, float(rewards[p, w]),
                                 float(np.asarray(fresh.scores_PxW)[p, w]), fresh.examples[p])
            self.bank.pop(k, None)
            self.bank[k] = Stored(ep, {n: v[p, w].copy() for n, v in inputs.items()},
                                  0 if calls is None else int(calls[p, w]))
        while len(self.bank) > self.config.bank_size:
            self.bank.pop(next(iter(self.bank)))

    def replay_into(self, fresh, host, stored: list[Stored], targets: list[int]):
        """``fresh`` with ``stored[i]`` in slot ``W - 1`` of prompt row ``targets[i]``: the row's forest rebuilt
        from its episodes (:func:`episodes_forest`), its reward and per-slot inputs replaced."""
        from treejax.rl.rollouts import Rollouts

        W, T, N, D = host.num_leaves, host.max_response_length, host.node_parent.shape[1], host.max_depth
        prompts, lens = np.asarray(fresh.prompts_PxLp), np.asarray(fresh.lengths_P)
        rows = [[slot_trajectory(host, prompts[p], int(lens[p]), p, w, 0, 0.0, 0.0, None) for w in range(W - 1)]
                + [s.episode] for p, s in zip(targets, stored)]
        built = episodes_forest(rows, T, N, D).replace(segment_length=host.segment_length)
        out = splice_rows(host.replace(leaf_weight=np.asarray(host.leaf_weights())), built, targets)
        rewards = np.array(jax.device_get(fresh.rewards_PxW), np.float32)
        inputs = {k: np.array(jax.device_get(v)) for k, v in fresh.estimator_inputs.items()}
        calls = None if fresh.tool_calls_PxW is None else np.array(fresh.tool_calls_PxW)
        for p, s in zip(targets, stored):
            rewards[p, W - 1] = s.episode.reward
            for k in inputs:
                inputs[k][p, W - 1] = s.inputs[k]
            if calls is not None:
                calls[p, W - 1] = s.tool_calls
        return dataclasses.replace(fresh, forest=out, rewards_PxW=jnp.asarray(rewards), tool_calls_PxW=calls,
                                   estimator_inputs={k: jnp.asarray(v) for k, v in inputs.items()})

    # -------------------------------------------------------------------------------------- checkpoints
    def state(self) -> str:
        """The streaks, the pruned set and the bank as one JSON-safe string (host copies)."""
        return encode_blob({"streak": dict(self.streak), "pruned": sorted(self.pruned), "bank": dict(self.bank)})

    def set_state(self, text: str | None) -> None:
        data = decode_blob(text) if text else {"streak": {}, "pruned": [], "bank": {}}
        self.streak, self.bank = dict(data["streak"]), dict(data["bank"])
        self.pruned.clear()  # the same set object the draw reads
        self.pruned.update(data["pruned"])

    def checkpoint_state(self) -> dict:
        """The wrapped source's state and RAPO's (``"rapo_state"``)."""
        return {**getattr(self.base, "checkpoint_state", dict)(), "rapo_state": self.state()}

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        self.set_state(data_state.get("rapo_state"))


def episodes_forest(rows: list[list[Trajectory]], T: int, N: int, D: int):
    """A forest of independent episodes: row ``r``'s slot ``w`` is ``rows[r][w]`` as a chain of turn nodes
    ``1 + w D .. w D + d`` (weight 1 each; ``N >= 1 + W D``); ``loss_mask`` = its ``policy_mask``."""
    from treejax.forest import forest_from_spans

    R, W = len(rows), len(rows[0])
    if N < 1 + W * D:
        raise ValueError(f"episodes_forest: {N} node slots cannot hold {W} episodes of up to {D} turns")
    path = np.full((R, W, D + 1), -1, np.int32)
    path[:, :, 0] = 0
    node_length = np.zeros((R, N), np.int64)
    tokens, logprobs, pmask = (np.zeros((R, W, T), np.int32), np.zeros((R, W, T), np.float32),
                               np.zeros((R, W, T), np.float32))
    status = np.zeros((R, W), np.int32)
    for r, row in enumerate(rows):
        for w, t in enumerate(row):
            d, L = len(t.node_lengths), len(t.tokens)
            if d > D or L > T:
                raise ValueError(f"RAPORollouts: a stored episode ({d} turns, {L} tokens) does not fit the forest "
                                 f"(D={D}, T={T})")
            ids = 1 + w * D + np.arange(d)
            path[r, w, 1:d + 1] = ids
            node_length[r, ids] = t.node_lengths
            tokens[r, w, :L], logprobs[r, w, :L], pmask[r, w, :L] = t.tokens, t.logprobs, t.policy_mask
            status[r, w] = t.status
    return forest_from_spans(path, node_length, tokens, logprobs=logprobs, policy_mask=pmask, leaf_status=status,
                             max_response_length=T, leaf_weight=np.ones((R, W), np.float32))


def splice_rows(host, built, targets: list[int]):
    """The host forest ``host`` with its rows ``targets`` replaced by the rows of ``built`` (same shapes), as
    device arrays."""
    idx = np.asarray(targets)

    def put(full, new):
        if full is None:
            return None
        out = np.array(full)
        out[idx] = np.asarray(new)
        return jnp.asarray(out)

    return jax.tree.map(put, host, built, is_leaf=lambda x: x is None)


__all__ = ["CurriculumDraw", "RAPOConfig", "RAPORollouts", "Stored", "episodes_forest", "splice_rows"]
