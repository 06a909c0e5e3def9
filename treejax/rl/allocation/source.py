"""Prompt-level allocation as a rollout stage (:class:`AllocationConfig`, a planner; :mod:`treejax.rl.allocation`): a
pre-rollout of ``P`` prompts, the allocator's extra chunks rolled out on the task's rollout service, each prompt's
group of rows in ``Rollouts.groups_PxC``; the allocator's state is the source's (checkpoint key ``allocation``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation import base as alloc
from treejax.rl.allocation.base import ALLOCATORS, Allocator, prompt_stats
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import RAGGED, VERIFIER

#: fold_in stream of the extra rollout calls of prompt-level allocation.
ALLOCATION_STREAM = 0xA110C


@dataclasses.dataclass(frozen=True)
class AllocationConfig(Stage):
    """Prompt-level rollout allocation (module docstring). ``allocator``: an :class:`Allocator` (gin:
    ``@DARS()``, ``@XRPOAllocator()``, ``@RolloutGDRO()``, ``@Uniform()``); ``max_rollouts``: rollouts per
    prompt at most (a multiple of ``W``: its group then holds ``max_rollouts / W`` rows); ``extra_rows``: the
    extra prompt rows of ``W`` leaves one step may sample (its row budget: ``extra_rows * W`` extra rollouts);
    ``call_prompts``: prompt rows per extra sampler call (0: ``prompts_per_step``; a call's unused rows decode
    copies that train on nothing, so smaller calls waste less, at one compile per distinct size);
    ``drop_equal_groups``: a prompt whose merged group's rewards are all equal trains on nothing (DARS's filter
    after the second round; its tokens otherwise count in a token-mean loss's denominator)."""

    allocator: Allocator | None = None
    max_rollouts: int = 32
    extra_rows: int = 8
    call_prompts: int = 0
    drop_equal_groups: bool = False

    role: ClassVar[str] = "planner"  # the task source with the allocator's extra rows (treejax.rl.sources.base)
    requires: ClassVar[tuple] = (VERIFIER, RAGGED)
    supplies: ClassVar[frozenset[str]] = frozenset({"greedy_reward_P", "answer_step_PxW"})

    def check(self, facts) -> None:
        self.check_budget(facts.tree.num_leaves)

    def added_rows(self) -> int:
        return self.extra_rows

    def build(self, inner, ctx):
        return AllocatedRollouts(ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i in self.supplies)), self)

    def check_budget(self, num_leaves: int) -> None:
        if self.allocator is None:
            raise ConfigError("AllocationConfig.allocator is not set; fix: AllocationConfig.allocator = @DARS() "
                              f"(allocators: {ALLOCATORS.names()})")
        if self.max_rollouts < num_leaves or self.max_rollouts % num_leaves:
            raise ConfigError(f"AllocationConfig.max_rollouts = {self.max_rollouts} must be a multiple of "
                              f"TreeConfig.num_leaves = {num_leaves} (a prompt's rows hold W leaves each); fix: "
                              f"AllocationConfig.max_rollouts = {max(1, self.max_rollouts // num_leaves) * num_leaves}")
        if self.extra_rows < 0 or self.call_prompts < 0:
            raise ConfigError("AllocationConfig.extra_rows and call_prompts must be >= 0")

    def chunks_per_prompt(self, num_leaves: int) -> int:
        """``C``: rows per prompt group, the pre-rollout's included."""
        return self.max_rollouts // num_leaves



class AllocatedRollouts:
    """The task's rollout service ``base`` (:class:`treejax.rl.rollouts.TaskRollouts`) with ``config``'s
    allocator deciding how many extra rows of ``W`` leaves each prompt gets."""

    def __init__(self, base, config):
        self.base, self.config, self.pipeline = base, config, base.pipeline
        self.state = config.allocator.init_state()

    def checkpoint_state(self) -> dict:
        """The allocator's state (a deep copy)."""
        return {"allocation": copy.deepcopy(self.state)}

    def restore_state(self, data_state: dict) -> None:
        self.state = data_state.get("allocation", self.config.allocator.init_state())

    def sample(self, params, key, step):
        """Prompt-level allocation (:mod:`treejax.rl.allocation`): the pre-rollout of ``P`` prompts, the
        allocator's extra chunks (rows of ``W`` leaves) decoded in calls of ``call_prompts`` rows, and the step's
        ``P + extra_rows`` rows with each prompt's group (``Rollouts.groups_PxC``); rows the budget left unused
        are copies of row 0 that train on nothing."""
        from treejax.rl.rollouts import assemble_rows, row_block

        b, a = self.base, self.config
        P, W = b.cfg.prompts_per_step, b.cfg.rollout.num_leaves
        C, E = a.chunks_per_prompt(W), a.extra_rows
        first = b.roll_and_score(params, *b.draw(), jax.random.fold_in(key, 0), step)
        examples, prompts, lens, counters = first.examples, first.prompts, first.lengths, first.counters
        stats = prompt_stats(first, step)
        extra, self.state = a.allocator.extra_rollouts(stats, self.state, alloc.Budget(E * W, W, a.max_rollouts))
        chunks = alloc.plan_chunks(extra, stats.accuracy_P, W, C - 1, E)
        owner = np.repeat(np.arange(P), chunks)  # the prompt of each extra row
        parts, calls, size = [row_block(first, np.arange(P))], 0, a.call_prompts or P
        for start in range(0, len(owner), size):
            idx = owner[start:start + size]
            pad = np.concatenate([idx, np.full(size - len(idx), idx[-1])])  # a call's unused rows: copies
            out = b.roll_and_score(params, [examples[i] for i in pad], prompts[pad], lens[pad],
                                   jax.random.fold_in(jax.random.fold_in(key, ALLOCATION_STREAM), calls), step)
            counters = counters + out.counters
            calls += 1
            parts.append(row_block(out, np.arange(len(idx))))
        unused = E - len(owner)
        if unused:  # the budget's unused rows: row 0's copies, masked out of the loss
            parts.append(row_block(first, np.zeros(unused, np.int64), train=False))
        groups = np.full((P, C), -1, np.int64)
        groups[:, 0] = np.arange(P)
        taken = np.zeros(P, np.int64)
        for r, p in enumerate(owner):
            taken[p] += 1
            groups[p, taken[p]] = P + r
        all_rewards = np.concatenate([np.asarray(p.rewards) for p in parts])
        dropped = np.zeros(P, bool)
        if a.drop_equal_groups:  # DARS: a group whose rewards are all equal trains on nothing
            for p in range(P):
                merged = all_rewards[groups[p][groups[p] >= 0]].ravel()
                dropped[p] = np.all(merged == merged[0])
        counters = dataclasses.replace(counters, rollout_calls=1 + calls, filler_prompts=unused)
        ro = assemble_rows(parts, counters, groups_PxC=groups,
                           extra_metrics=alloc.allocation_metrics(chunks, W, dropped, unused))
        if dropped.any():
            rows = groups[dropped]
            rows = rows[rows >= 0]
            mask = ro.forest.loss_mask.at[jnp.asarray(rows)].set(0.0)
            ro.forest = ro.forest.replace(loss_mask=mask)
        return b.with_greedy(params, ro)

