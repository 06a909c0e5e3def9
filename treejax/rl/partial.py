"""Partial rollouts (APRIL, arXiv 2509.18521; code ``RLsys-Foundation/APRIL``): over-sample, stop once enough
groups are done, carry the unfinished responses into the next step and resume them first.

A synchronous batched sampler waits each step for its longest response (the long tail). :class:`PartialRollouts`
launches ``G = prompts_per_step + PartialConfig.over_sample`` groups of ``W`` independent chains per sampler call
(:mod:`treejax.sampling.partial`) and stops the call at the first segment boundary where ``need`` groups are
complete (``need`` = the prompt rows the step still lacks). The step trains ``prompts_per_step`` complete
groups; every other group (complete or not) is *carried*: its finished responses are kept, its unfinished ones
keep their tokens and the per-token log-probs of the policy versions that sampled them. The next call puts the
carried groups first (APRIL's "resume first") and fills the remaining slots with fresh prompts; a carried row is
re-prefilled with the current weights (prompt + partial response) and decodes on from where it stopped.

The carried tokens were sampled by older policies, so the learner needs the decoupled-PPO correction the replay
buffer and asynchronous rollouts use: ``RunConfig.old_logp = "trainer"`` (or ``"ewma"``) recomputes the proximal
log-probs with the current weights, and ``LossConfig.tis_cap`` weights each token by ``min(pi_prox / q, C)``, ``q``
the log-prob recorded when the token was sampled (both required). A carried group therefore trains once, in the
step it completes, with every token's own behaviour probability.

Dynamic sampling (DAPO, ``RunConfig.dynamic_sampling``): complete groups whose ``W`` rewards are all equal are
dropped; while the step has fewer than ``prompts_per_step`` informative groups and refills are left
(``max_refills``), another call runs (carried groups first again, the same weights); slots still empty train on
nothing (masked copies, ``rollout/filler_prompts``). APRIL's paper runs it with GRPO and DAPO.

Bias: a step's complete groups are more often the quick ones; the slow ones train a step or more later, never
dropped (the carry holds at most ``G - 1`` groups). ``partial/stale_token_frac`` is the share of trained tokens
sampled by an earlier policy version.

Metrics: ``partial/carried_groups`` / ``partial/carried_partial_rows`` (after the step), ``partial/resumed_rows``
(rows that continued a stored prefix this step), ``partial/stale_groups`` (trained groups started in an earlier
step), ``partial/stale_token_frac``, ``partial/mean_age`` / ``partial/max_age`` (steps since a trained group
started), ``partial/dropped_groups`` (all-equal groups dropped by dynamic sampling). The carry and the drawn but
not yet launched prompts are saved in the checkpoint: a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.checkpoint import decode_blob, encode_blob
from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import CHAINS, OFF_POLICY, SYNCHRONOUS, VERIFIER
from treejax.forest import NodeStatus, chain_forest
from treejax.parallel import multihost
from treejax.rl import scoring
from treejax.sampling.partial import make_partial_rollout

_ALIVE = int(NodeStatus.ALIVE)
PARTIAL_STREAM = 0xA971  # fold_in stream of the partial-rollout calls


@dataclasses.dataclass(frozen=True)
class PartialConfig(Stage):
    """Partial rollouts (module docstring): ``over_sample`` groups launched per call beyond
    ``RunConfig.prompts_per_step`` (APRIL's over-provisioning, ``N' - N`` in groups)."""

    over_sample: int = 4

    role: ClassVar[str] = "planner"  # it launches, carries and resumes its own groups
    requires: ClassVar[tuple] = (VERIFIER, CHAINS, OFF_POLICY, SYNCHRONOUS)
    dynamic_sampling: ClassVar[bool] = True

    def build(self, inner, ctx):
        return PartialRollouts(ctx.task_rollouts(), self)

    def __post_init__(self):
        if self.over_sample < 1:
            raise ConfigError(f"PartialConfig.over_sample must be >= 1, got {self.over_sample}")


@dataclasses.dataclass
class _Group:
    """One prompt's ``W`` chains as host arrays: the example and prompt, the responses so far (``status_W``
    ``ALIVE``: unfinished), the step that started it and the tokens each row had when this step began."""

    example: object
    prompt: np.ndarray
    prompt_length: int
    tokens_WxT: np.ndarray
    logp_WxT: np.ndarray
    slogp_WxT: np.ndarray
    length_W: np.ndarray
    status_W: np.ndarray
    born: int
    stale_W: np.ndarray

    @property
    def complete(self) -> bool:
        return bool(np.all(self.status_W != _ALIVE))


class PartialRollouts:
    """The loop's source with APRIL's partial rollouts (module docstring). ``base``: the run's
    :class:`~treejax.rl.rollouts.TaskRollouts` (its prompts, tokenizer, task, rewards and sampler fns)."""

    def __init__(self, base, config: PartialConfig):
        self.base, self.config = base, config
        self.pipeline = base.pipeline
        self.estimator_inputs = ()
        tc = base.rollout.tree_config
        self.tree_config = tc
        self.sampler = make_partial_rollout(base.sampler_fns, tc)
        self.carry: list[_Group] = []
        self.queue: list[tuple] = []  # drawn prompts not launched yet: (example, prompt, length)

    # -------------------------------------------------------------------------------------------- the step
    def _fresh(self, n: int, step: int) -> list[_Group]:
        tc = self.tree_config
        W, T = tc.num_leaves, tc.response_capacity
        while len(self.queue) < n:
            examples, prompts, lens = self.base.draw()
            self.queue.extend(zip(examples, prompts, lens))
        taken, self.queue = self.queue[:n], self.queue[n:]
        zeros = np.zeros((W, T), np.float32)
        return [_Group(example=e, prompt=np.asarray(p), prompt_length=int(n_), tokens_WxT=np.zeros((W, T), np.int32),
                       logp_WxT=zeros, slogp_WxT=zeros, length_W=np.zeros(W, np.int32),
                       status_W=np.full(W, _ALIVE, np.int32), born=step, stale_W=np.zeros(W, np.int32))
                for e, p, n_ in taken]

    def _call(self, params, groups: list[_Group], need: int, key) -> dict:
        """One sampler call over ``groups``; updates them in place and returns the call's counters."""
        st = lambda name: np.concatenate([getattr(g, name) for g in groups])  # noqa: E731
        W = self.tree_config.num_leaves
        prompts = np.repeat(np.stack([g.prompt for g in groups]), W, axis=0)
        lens = np.repeat(np.array([g.prompt_length for g in groups], np.int32), W)
        status = st("status_W")
        live = status == _ALIVE
        out = self.sampler(params, prompts, lens, st("tokens_WxT"), st("logp_WxT"), st("slogp_WxT"), st("length_W"),
                           live, status, key, need)
        host = multihost.host_tree(jax.device_get(out))
        resumed = int(np.sum(live & (st("length_W") > 0)))
        for i, g in enumerate(groups):
            rows = slice(i * W, (i + 1) * W)
            g.tokens_WxT, g.logp_WxT = np.asarray(host.tokens_RxT[rows]), np.asarray(host.logprobs_RxT[rows])
            g.slogp_WxT, g.length_W = np.asarray(host.sampling_logprobs_RxT[rows]), np.asarray(host.length_R[rows])
            g.status_W = np.asarray(host.status_R[rows])
        return dict(decoded_tokens=int(host.decoded_tokens), prefilled_tokens=int(host.prefilled_tokens),
                    segments=int(host.segments), complete=int(all(g.complete for g in groups)), resumed=resumed)

    def _score(self, groups: list[_Group]) -> tuple[np.ndarray, np.ndarray]:
        """Verifier scores and shaped rewards ``[n, W]`` of complete groups."""
        b = self.base
        tokens = np.stack([g.tokens_WxT for g in groups])
        lengths = np.stack([g.length_W for g in groups])
        texts = scoring.decode_texts(b.tokenizer, tokens, lengths)
        scores = scoring.score_texts(b.task, [g.example for g in groups], texts)
        return scores, b.rewards(scores, lengths)

    def sample(self, params, key, step):
        from treejax.rl.rollouts import RolloutCounters

        cfg = self.base.cfg
        P = cfg.prompts_per_step
        G = P + self.config.over_sample
        for g in self.carry:  # what the carried rows hold now was sampled by earlier policies
            g.stale_W = g.length_W.copy()
        kept: list[tuple] = []  # (group, scores, rewards)
        spare: list[tuple] = []  # complete groups of the last call (filler source)
        totals = dict(decoded_tokens=0, prefilled_tokens=0, segments=0, complete=0)
        resumed = dropped = calls = 0
        scoring_s = 0.0
        for attempt in range(1 + (cfg.max_refills if cfg.dynamic_sampling else 0)):
            need = P - len(kept)
            groups = self.carry + self._fresh(G - len(self.carry), step)
            c = self._call(params, groups, need, jax.random.fold_in(jax.random.fold_in(key, PARTIAL_STREAM), attempt))
            calls += 1
            for k in totals:
                totals[k] += c[k]
            resumed += c["resumed"]
            done = [g for g in groups if g.complete]
            self.carry = [g for g in groups if not g.complete]
            spare = []
            if done:
                t = time.perf_counter()
                scores, rewards = self._score(done)
                scoring_s += time.perf_counter() - t
                for g, s, r in zip(done, scores, rewards):
                    informative = not cfg.dynamic_sampling or not np.all(r == r[0])
                    if informative and len(kept) < P:
                        kept.append((g, s, r))
                    elif informative:
                        self.carry.append(g)  # complete, waiting: it trains first in the next step
                    else:
                        dropped += 1
                    spare.append((g, s, r))
            self.carry.sort(key=lambda g: g.born)  # oldest first
            if len(kept) >= P:
                break
        missing = P - len(kept)
        rows = kept + [spare[0]] * missing if missing else kept
        stops = np.concatenate([g.status_W for g, _, _ in kept]) if kept else np.zeros(0, np.int32)
        counters = RolloutCounters(
            decoded_tokens=totals["decoded_tokens"], prefilled_tokens=totals["prefilled_tokens"],
            segments=totals["segments"], complete=totals["complete"],
            stops={name: int(np.sum(stops == int(code))) for name, code in zip(NodeStatus.names(), NodeStatus)},
            rollout_calls=calls, filler_prompts=missing, scoring_s=scoring_s)
        return self._rollouts(rows, missing, counters, step, resumed, dropped)

    def _rollouts(self, rows: list[tuple], missing: int, counters, step: int, resumed: int, dropped: int):
        from treejax.rl.rollouts import Rollouts

        tc = self.tree_config
        groups = [g for g, _, _ in rows]
        forest = chain_forest(np.stack([g.length_W for g in groups]), tc.segment_length, tc.max_depth, tc.num_nodes,
                              np.stack([g.status_W for g in groups]), np.stack([g.tokens_WxT for g in groups]),
                              np.stack([g.logp_WxT for g in groups]))
        if missing:  # the slots dynamic sampling could not fill train on nothing
            mask = np.ones((len(rows), 1, 1), np.float32)
            mask[len(rows) - missing:] = 0.0
            forest = forest.replace(loss_mask=forest.loss_mask * jnp.asarray(mask))
        trained = groups[:len(groups) - missing]
        ages = [step - g.born for g in trained]
        tokens = sum(int(g.length_W.sum()) for g in trained)
        stale = sum(int(g.stale_W.sum()) for g in trained)
        scores = np.stack([s for _, s, _ in rows])
        metrics = {"partial/carried_groups": len(self.carry),
                   "partial/carried_partial_rows": int(sum(np.sum(g.status_W == _ALIVE) for g in self.carry)),
                   "partial/resumed_rows": resumed, "partial/stale_groups": int(sum(a > 0 for a in ages)),
                   "partial/stale_token_frac": stale / max(tokens, 1),
                   "partial/mean_age": float(np.mean(ages)) if ages else 0.0,
                   "partial/max_age": max(ages) if ages else 0, "partial/dropped_groups": dropped}
        return Rollouts(forest=forest, rewards_PxW=jnp.asarray(np.stack([r for _, _, r in rows]), jnp.float32),
                        scores_PxW=scores, prompts_PxLp=np.stack([g.prompt for g in groups]),
                        lengths_P=np.array([g.prompt_length for g in groups], np.int32), counters=counters,
                        examples=[g.example for g in groups], reward_scores_PxW=scores, extra_metrics=metrics)

    # -------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict:
        """The carried groups and the drawn prompts not launched yet (``"partial_rollouts"``)."""
        return {"partial_rollouts": encode_blob({"carry": self.carry, "queue": self.queue})}

    def restore_state(self, data_state: dict) -> None:
        blob = data_state.get("partial_rollouts")
        state = decode_blob(blob) if blob else {"carry": [], "queue": []}
        self.carry, self.queue = list(state["carry"]), list(state["queue"])


__all__ = ["PartialConfig", "PartialRollouts"]
