"""DART's adaptive data curation as one planner stage (Li et al. 2025, "Efficient Multi-turn RL for GUI Agents via
Decoupled Training and Adaptive Data Curation", arXiv 2509.23866; code ``Computer-use-agents/dart-gui``).

The paper's abstract lists four pieces (its method section could not be read; see each piece for what is taken
from where). In treejax they are existing parts plus three small new ones:

1. *rollout numbers and trajectory lengths by task difficulty*: :class:`DARTConfig` is prompt-level allocation
   (:class:`~treejax.rl.allocation.source.AllocationConfig`) with :class:`~treejax.rl.allocation.dart.DARTAllocator`
   (rollouts from each prompt's running success rate) and its per-prompt length cap, applied here as a token budget
   on the decoded rows (:func:`~treejax.rl.allocation.dart.length_cap_mask`);
2. *training on high-entropy steps*: the shaper :class:`~treejax.rl.shaping.dart.DARTEntropyMask`
   (``RunConfig.shapers``);
3. *truncated importance sampling* between rollout and update: the loss's existing TIS
   (``LossConfig.tis_cap``, ``min(exp(old_logp - sampler_logp), C)``, :mod:`treejax.rl.losses`);
4. *pre-collected successes for hard tasks*: here. After the step's rows are decoded and capped, every prompt whose
   whole group (pre-rollout and extra rows) has **no** success this step, and whose running success rate is at most
   ``max_inject_rate``, gets one success written over its first row's last leaf: the newest earlier success of the
   same prompt in this run (a bank of successful responses, saved in the checkpoint), else the prompt's solution
   from ``solutions`` (a jsonl of ``{"question": ..., "solution": ...}`` lines, matched by question text). The
   injected leaf's reward is ``injected_reward``, its log-probs are the current sampler's under teacher forcing
   (:func:`treejax.sampling.decode.score_tokens`), so TIS weighs it about 1 and the PPO clip bounds its update (its
   true behaviour policy, an earlier policy or the solution's author, is not known). **Reconstructed**: when to
   inject (the abstract: "to supplement sparse success in online sampling"; the code's trajectory pool is a SQL
   service we did not read) and which leaf it replaces.

The estimator then sees the prompt's group with the injected success among its failures (GRPO's group baseline:
the success gets a positive advantage, the failures a negative one). The verifier scores (``reward/accuracy``) keep
the policy's own leaf: an injected success is not counted as the policy's. ``drop_equal_groups`` is applied after the
cap and the injection (a group with an injected success is not all-equal). Injection writes one leaf's tokens, so it
needs independent chains (``TreeConfig.branch_factor = 1``) and the expanded update (``RunConfig.packed_update =
False``); :meth:`DARTConfig.check` says so.

Metrics: ``dart/truncated_leaves``, ``dart/length_cap_mean``, ``dart/success_rate_mean``, ``dart/zero_success_prompts``,
``dart/injected`` (of which ``dart/injected_from_bank``), ``dart/bank_size``, ``dart/dropped_prompts``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation.base import prompt_key
from treejax.rl.allocation.dart import DARTAllocator, length_cap_mask
from treejax.rl.allocation.source import AllocatedRollouts, AllocationConfig


def load_solutions(path: str) -> dict[str, str]:
    """``{prompt key: solution text}`` of a jsonl file of ``{"question": ..., "solution": ...}`` lines (the key is
    :func:`~treejax.rl.allocation.base.prompt_key` of the question, as the task's examples are keyed)."""
    if not os.path.exists(path):
        raise ConfigError(f"DARTConfig.solutions = {path!r}: no such file; fix: a jsonl of "
                          '{"question": ..., "solution": ...} lines, or DARTConfig.solutions = None')
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "question" not in rec or "solution" not in rec:
                raise ConfigError(f"{path}:{n}: a DART solution line needs 'question' and 'solution' keys")
            out[prompt_key({"question": rec["question"]})] = str(rec["solution"])
    return out


def injection_targets(success_PxN, group_valid_PxN, rate_P, max_rate: float, available_P) -> np.ndarray:
    """bool[P]: the prompts that get a pre-collected success: no success among the group's valid leaves this step,
    running success rate ``<= max_rate``, and a success available."""
    succ = np.asarray(success_PxN, bool) & np.asarray(group_valid_PxN, bool)
    return (~succ.any(-1)) & (np.asarray(rate_P) <= max_rate) & np.asarray(available_P, bool)


@dataclasses.dataclass(frozen=True)
class DARTConfig(AllocationConfig):
    """DART's data curation (module docstring): prompt-level allocation with :class:`DARTAllocator` (its rollout
    counts and length caps), the cap's ``truncated_reward`` (a leaf longer than its cap gets at most this reward),
    and the injection of pre-collected successes (``inject``; ``max_inject_rate``; ``injected_reward``;
    ``solutions``: a jsonl path or ``None``; ``bank_size``: prompts whose newest success is kept)."""

    truncated_reward: float = -1.0
    inject: bool = True
    max_inject_rate: float = 0.25
    injected_reward: float = 1.0
    solutions: str | None = None
    bank_size: int = 4096

    supplies: ClassVar[frozenset[str]] = frozenset({"greedy_reward_P"})

    def __post_init__(self):
        if self.allocator is not None and not isinstance(self.allocator, DARTAllocator):
            raise ConfigError(f"DARTConfig.allocator must be a DARTAllocator, got {type(self.allocator).__name__}; "
                              "fix: DARTConfig.allocator = @DARTAllocator()")
        if not 0.0 <= self.max_inject_rate <= 1.0:
            raise ConfigError(f"DARTConfig.max_inject_rate must be in [0, 1], got {self.max_inject_rate}")
        if self.bank_size < 0:
            raise ConfigError(f"DARTConfig.bank_size must be >= 0, got {self.bank_size}")

    def check(self, facts) -> None:
        super().check(facts)
        if self.inject and facts.tree.branch_factor != 1:
            raise ConfigError("DARTConfig.inject writes one leaf's tokens, which needs independent chains; fix: "
                              "TreeConfig.branch_factor = 1 (or DARTConfig.inject = False)")
        if self.inject and facts.packed_update:
            raise ConfigError("DARTConfig.inject is checked with the expanded update only; fix: "
                              "RunConfig.packed_update = False (or DARTConfig.inject = False)")

    def build(self, inner, ctx):
        return DARTRollouts(ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i in self.supplies)), self)


class DARTRollouts(AllocatedRollouts):
    """:class:`AllocatedRollouts` with DART's length cap and success injection after the allocation (module
    docstring). State: the allocator's (running success rates) and the bank of successes."""

    def __init__(self, base, config: DARTConfig):
        super().__init__(base, dataclasses.replace(config, drop_equal_groups=False))  # dropped after injection
        self.dart = config
        self.bank: dict[str, list[int]] = {}
        self.solutions = load_solutions(config.solutions) if config.solutions else {}

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "dart_bank": {k: list(v) for k, v in self.bank.items()}}

    def restore_state(self, data_state: dict) -> None:
        super().restore_state(data_state)
        self.bank = {k: list(v) for k, v in data_state.get("dart_bank", {}).items()}

    def _solution_tokens(self, key: str) -> tuple[list[int], bool] | None:
        if key in self.bank:
            return self.bank[key], True
        if key in self.solutions:
            tok = self.base.tokenizer
            ids = list(tok.encode(self.solutions[key], add_special_tokens=False))
            eos = tuple(getattr(tok, "eos_ids", ()) or ())
            return (ids + [int(eos[0])] if eos else ids), False
        return None

    def sample(self, params, key, step):
        ro = super().sample(params, key, step)
        return self.curate(params, ro)

    def curate(self, params, ro):
        """The length cap, the bank, the injection and the equal-group drop on the allocated rollouts ``ro``."""
        cfg, P = self.dart, self.base.cfg.prompts_per_step
        forest, groups = ro.forest, np.asarray(ro.groups_PxC)
        W, T = forest.tokens.shape[1:]
        rate = np.asarray(self.state.get("last", np.zeros(P)), np.float64)
        caps = self.config.allocator.length_caps(rate, T)
        row_cap = np.full(forest.tokens.shape[0], T, np.int64)
        for p in range(P):
            row_cap[groups[p][groups[p] >= 0]] = caps[p]
        lengths = np.array(forest.leaf_length)
        mask, rewards, truncated = length_cap_mask(np.asarray(forest.loss_mask), lengths,
                                                   np.asarray(ro.rewards_PxW), row_cap, cfg.truncated_reward)
        scores = ro.reward_scores_PxW if ro.reward_scores_PxW is not None else ro.scores_PxW
        success = (np.asarray(scores) >= 1.0) & ~truncated
        tokens, logprobs = np.array(forest.tokens), np.array(forest.logprobs)
        keys = [prompt_key(e) for e in ro.examples[:P]]
        rows = np.where(groups >= 0, groups, 0)
        valid = np.repeat(groups >= 0, W, axis=1)
        grp_success = success[rows].reshape(P, -1) & valid
        for p in range(P):  # the bank: each prompt's newest success (first successful leaf of its group)
            hit = np.flatnonzero(grp_success[p])
            if hit.size and cfg.bank_size:
                r, w = rows[p, hit[0] // W], hit[0] % W
                self.bank.pop(keys[p], None)
                self.bank[keys[p]] = tokens[r, w, :lengths[r, w]].tolist()
                while len(self.bank) > cfg.bank_size:
                    self.bank.pop(next(iter(self.bank)))
        found = [self._solution_tokens(k) if cfg.inject else None for k in keys]
        fits = [f is not None and 0 < len(f[0]) <= min(caps[p], T) for p, f in enumerate(found)]
        targets = injection_targets(grp_success, valid, rate, cfg.max_inject_rate, fits) if cfg.inject else \
            np.zeros(P, bool)
        metrics = {"dart/truncated_leaves": int((truncated[rows].reshape(P, -1) & valid).sum()),
                   "dart/length_cap_mean": float(np.mean(caps)), "dart/success_rate_mean": float(np.mean(rate)),
                   "dart/zero_success_prompts": int((~grp_success.any(-1)).sum()),
                   "dart/injected": int(targets.sum()),
                   "dart/injected_from_bank": int(sum(found[p][1] for p in np.flatnonzero(targets))),
                   "dart/bank_size": len(self.bank)}
        seg = np.array(forest.segment_index)
        if targets.any():
            from treejax.sampling import probe as probe_lib
            from treejax.sampling.decode import score_tokens

            idx = np.flatnonzero(targets)
            new = np.zeros((len(idx), T), np.int32)
            n = np.array([len(found[p][0]) for p in idx], np.int32)
            for i, p in enumerate(idx):
                new[i, :n[i]] = found[p][0]
            weights, _ = probe_lib.detach(params)
            lp = np.asarray(score_tokens(weights, self.base.sampler_fns, np.asarray(ro.prompts_PxLp)[idx],
                                         np.asarray(ro.lengths_P)[idx], new, n))
            t = np.arange(T)
            depth = forest.leaf_path.shape[-1] - 1
            for i, p in enumerate(idx):  # prompt p's first row, last leaf
                on = t < n[i]
                tokens[p, W - 1], logprobs[p, W - 1] = np.where(on, new[i], 0), np.where(on, lp[i], 0.0)
                mask[p, W - 1] = on.astype(mask.dtype)
                seg[p, W - 1] = np.where(on, np.minimum(t // forest.segment_length, depth - 1), 0).astype(seg.dtype)
                lengths[p, W - 1], rewards[p, W - 1] = n[i], cfg.injected_reward
        dropped = np.zeros(P, bool)
        if cfg.drop_equal_groups:
            for p in range(P):
                merged = rewards[groups[p][groups[p] >= 0]].ravel()
                dropped[p] = np.all(merged == merged[0])
                if dropped[p]:
                    mask[groups[p][groups[p] >= 0]] = 0.0
        metrics["dart/dropped_prompts"] = int(dropped.sum())
        ro.forest = forest.replace(tokens=jnp.asarray(tokens), logprobs=jnp.asarray(logprobs),
                                   loss_mask=jnp.asarray(mask), leaf_length=jnp.asarray(lengths),
                                   segment_index=jnp.asarray(seg))
        ro.rewards_PxW = jnp.asarray(rewards)
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics}
        return ro


__all__ = ["DARTConfig", "DARTRollouts", "injection_targets", "load_solutions"]
