"""The prompt-level allocator interface, its registry, and the planner that turns requests into rollout rows.

A step with allocation (:class:`~treejax.rl.allocation.source.AllocationConfig`) rolls out in two rounds:

1. the *pre-rollout*: ``P`` prompts x ``W`` leaves, the usual sampler call;
2. the allocator reads each prompt's statistics of round 1 (:class:`PromptStats`: rollouts, leaf-weighted
   accuracy, reward mean / std, a stable prompt key for its history) and its own state, and asks for
   ``extra_P[p] >= 0`` more rollouts of prompt ``p``; :func:`plan_chunks` turns the requests into *chunks*
   (one chunk = one more prompt row of ``W`` leaves, sampled by the same tree program) under two static caps:
   ``max_rollouts`` per prompt and ``extra_rows`` chunks per step (the row budget). Requests are rounded up
   to whole chunks; when they exceed the budget, chunks go one at a time to the prompt with the largest
   unmet request (ties: lower accuracy, then lower index), so a tight budget is shared rather than spent on
   the first prompts.

A prompt's group is then its round-1 row plus its chunks (:mod:`treejax.rl.allocation.groups`): the
estimator sees ``[P, C * W]`` leaves per prompt (``C = max_rollouts / W``) with the unused slots marked
(``leaf_path[..., 0] = -1``), so every group statistic is over the rollouts the prompt actually got.

An allocator is a frozen dataclass registered by name (gin knows it by its class name, ``AllocationConfig.
allocator = @DARS()``) with two methods: ``init_state() -> dict`` (JSON-serialisable: it is saved in the
checkpoint's data state) and ``extra_rollouts(stats, state) -> (extra_P, state)``, a host function (NumPy):
allocation happens between two sampler calls, on a few numbers per prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar

import numpy as np

from treejax.errors import ConfigError
from treejax.registry import Registry


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """Per-prompt statistics of one step's pre-rollout (host arrays over the ``P`` prompts).

    ``rollouts_P``: rollouts sampled (``W``); ``accuracy_P``: fraction of correct leaves, each leaf weighted by
    ``Forest.leaf_weight`` (so a tree's estimate is the policy's pass rate); ``reward_mean_P`` /
    ``reward_std_P``: the same weighting over the shaped rewards (population std); ``keys``: a stable key per
    prompt (:func:`prompt_key`) for allocators with a history; ``step``: the training step."""

    rollouts_P: np.ndarray
    accuracy_P: np.ndarray
    reward_mean_P: np.ndarray
    reward_std_P: np.ndarray
    keys: tuple[str, ...] = ()
    step: int = 0

    @classmethod
    def from_leaves(cls, correct_PxW, rewards_PxW, weight_PxW=None, keys=(), step: int = 0) -> "PromptStats":
        correct = np.asarray(correct_PxW, np.float64)
        rewards = np.asarray(rewards_PxW, np.float64)
        w = np.ones_like(rewards) if weight_PxW is None else np.asarray(weight_PxW, np.float64)
        total = np.maximum(w.sum(-1), 1e-12)
        mean = (w * rewards).sum(-1) / total
        var = (w * (rewards - mean[:, None]) ** 2).sum(-1) / total
        n = (w > 0).sum(-1)
        return cls(rollouts_P=n.astype(np.int64), accuracy_P=(w * correct).sum(-1) / total, reward_mean_P=mean,
                   reward_std_P=np.sqrt(np.maximum(var, 0.0)), keys=tuple(keys), step=int(step))

    @property
    def num_prompts(self) -> int:
        return len(self.accuracy_P)


def example_text(example: Any) -> str:
    """A task example's question text (``Example.metadata["question"]``; a record's ``"question"``; else its repr)."""
    meta = getattr(example, "metadata", None)
    if isinstance(meta, dict) and "question" in meta:
        return str(meta["question"])
    if isinstance(example, dict) and "question" in example:
        return str(example["question"])
    return repr(example)


def prompt_key(example: Any) -> str:
    """A stable key of a task example (a hash of its question text), for per-prompt history."""
    return hashlib.sha1(example_text(example).encode()).hexdigest()[:16]


def prompt_stats(out, step: int) -> PromptStats:
    """The allocators' and the prompt selectors' per-prompt statistics of one ``ScoredRows``
    (:meth:`treejax.rl.rollouts.TaskRollouts.roll_and_score`): leaf-weighted accuracy from the reward scores, one
    host read."""
    from treejax.parallel import multihost

    weights = np.asarray(multihost.host_tree(out.forest.leaf_weights()))
    return PromptStats.from_leaves(np.asarray(out.leaf_inputs["reward_scores"]) >= 1.0, out.rewards, weights,
                                   keys=[prompt_key(e) for e in out.examples], step=step)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one step may spend: ``extra`` rollouts at most (``extra_rows * W``), in ``chunk``s of ``W``, at most
    ``max_rollouts`` per prompt (the pre-rollout's included)."""

    extra: int
    chunk: int
    max_rollouts: int


class Allocator:
    """Base of the prompt-level allocators (module docstring). ``name`` is set by :func:`register`."""

    name: ClassVar[str] = ""

    def init_state(self) -> dict:
        return {}

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget) -> tuple[np.ndarray, dict]:
        """``(extra_P, new_state)``: how many more rollouts each prompt should get (ints >= 0; the planner rounds
        them to chunks and enforces the budget's caps). ``state``: the allocator's state after the last step
        (never mutated: the new one is returned)."""
        raise NotImplementedError


#: Every allocator class by name (gin knows each by its class name).
ALLOCATORS: Registry[type] = Registry("allocator", base=Allocator, name_attrs=("name",))


def register(name: str, *, overwrite: bool = False):
    """Class decorator: registers a frozen-dataclass :class:`Allocator` under ``name``."""
    return ALLOCATORS.register(name, overwrite=overwrite)


def allocator_classes() -> dict[str, type]:
    """``{registered name: class}`` (gin registers the classes by their class names)."""
    return ALLOCATORS.classes()


def get_allocator(name: str, **kwargs) -> Allocator:
    return ALLOCATORS.get(name)(**kwargs)


def plan_chunks(extra_P: np.ndarray, accuracy_P: np.ndarray, num_leaves: int, max_chunks: int,
                budget_rows: int) -> np.ndarray:
    """int[P]: extra rows (chunks of ``num_leaves`` rollouts) per prompt for the requested ``extra_P``.

    ``ceil(extra / W)`` chunks each, at most ``max_chunks`` per prompt and ``budget_rows`` in all; over the
    budget, chunks go one at a time to the prompt with the largest unmet request in rollouts (ties: lower
    accuracy, then lower index)."""
    extra = np.maximum(np.asarray(extra_P, np.int64), 0)
    want = np.minimum(-(-extra // num_leaves), max_chunks)
    if want.sum() <= budget_rows:
        return want
    got = np.zeros_like(want)
    unmet = extra.astype(np.float64)
    acc = np.asarray(accuracy_P, np.float64)
    for _ in range(budget_rows):
        open_ = got < want
        if not open_.any():
            break
        order = np.lexsort((np.arange(len(want)), acc, -unmet))  # last key first: largest unmet, low acc, index
        p = next(i for i in order if open_[i])
        got[p] += 1
        unmet[p] -= num_leaves
    return got


def allocation_metrics(chunks_P: np.ndarray, num_leaves: int, dropped_P: np.ndarray, unused_rows: int) -> dict:
    """The step's ``alloc/...`` metrics: rollouts per prompt (mean, max, and a histogram in multiples of ``W``:
    ``alloc/prompts_with_{k}W``), prompts that got extra rollouts, dropped prompts, extra rows used and unused."""
    n = (1 + np.asarray(chunks_P)) * num_leaves
    out = {"alloc/rollouts_per_prompt_mean": float(n.mean()), "alloc/rollouts_per_prompt_max": int(n.max()),
           "alloc/prompts_with_extra": int((np.asarray(chunks_P) > 0).sum()),
           "alloc/dropped_prompts": int(np.asarray(dropped_P).sum()), "alloc/extra_rows": int(np.sum(chunks_P)),
           "alloc/unused_rows": int(unused_rows)}
    for k, c in zip(*np.unique(1 + np.asarray(chunks_P), return_counts=True)):
        out[f"alloc/prompts_with_{int(k)}W"] = int(c)
    return out


__all__ = ["ALLOCATORS", "allocation_metrics", "example_text", "Allocator", "Budget", "PromptStats", "allocator_classes", "get_allocator", "plan_chunks",
           "prompt_key", "register"]
