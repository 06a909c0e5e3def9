"""DART's difficulty-adaptive rollout count and length cap (Li et al. 2025, "Efficient Multi-turn RL for GUI Agents
via Decoupled Training and Adaptive Data Curation", arXiv 2509.23866; code ``Computer-use-agents/dart-gui``).

What the paper says (its abstract; the method section was not reachable): the data curation "dynamically adjusts
rollout numbers and trajectory lengths based on task difficulty". The released code has no readable form of the
rule (its rollouter's per-task rollout count and step cap are fixed shell settings, ``rollout_n=8``,
``max_steps=15``), so the rule here is **a reconstruction**: harder tasks (lower running success rate) get more
rollouts and a longer length budget, linearly in ``1 - s``.

Per prompt (stable key :func:`~treejax.rl.allocation.base.prompt_key`), with ``a`` the leaf-weighted accuracy of
this step's pre-rollout and ``s`` the running success rate (an exponential moving average over the steps the
prompt was drawn; the first sight sets it to ``a``)::

    s <- (1 - beta) s + beta a                                   (beta = DARTAllocator.ema)
    N(s) = N_min + ceil((N_max - N_min) (1 - s))                 rollouts this step   (N_min = W, the pre-rollout;
                                                                                        N_max = max_rollouts)
    extra = N(s) - N_pre                                          asked of the chunk planner (whole rows of W)
    L(s) = L_min + round((L_max - L_min) (1 - s))                the prompt's response-token cap this step

``L_max`` is ``DARTAllocator.max_length`` (0: the sampler's response capacity ``T``) and ``L_min`` its
``min_length``. The sampler decodes fixed shapes (every row the same ``T``), so the cap is applied after decoding
as a **per-prompt token budget** (:func:`length_cap_mask`, used by :class:`treejax.rl.dart.DARTConfig`): tokens at
response index ``>= L`` leave the loss, and a leaf longer than ``L`` counts as truncated (its reward becomes at most
``DARTConfig.truncated_reward``), which is what a shorter decode budget would have produced for the loss; it does
not save the decode compute of the tokens past the cap.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation.base import Allocator, Budget, PromptStats, register


def running_success(prev: dict, keys, accuracy_P, ema: float) -> tuple[np.ndarray, dict]:
    """``(s_P, new_rates)``: each prompt's running success rate after this step's accuracy ``a``:
    ``s = (1 - ema) s_prev + ema a``, or ``a`` for a key not seen before; ``prev``/``new_rates``: ``{key: s}``
    (never mutated). A key drawn twice in one step is updated twice, in order."""
    rates = dict(prev)
    out = np.zeros(len(keys), np.float64)
    for i, (k, a) in enumerate(zip(keys, np.asarray(accuracy_P, np.float64))):
        rates[k] = float(a) if k not in rates else (1.0 - ema) * rates[k] + ema * float(a)
        out[i] = rates[k]
    return out, rates


def dart_rollouts(success_P, n_min: int, n_max: int) -> np.ndarray:
    """int64[P]: ``N(s) = n_min + ceil((n_max - n_min) (1 - s))`` rollouts per prompt (module docstring)."""
    s = np.clip(np.asarray(success_P, np.float64), 0.0, 1.0)
    return (n_min + np.ceil((n_max - n_min) * (1.0 - s) - 1e-9)).astype(np.int64)


def dart_length_cap(success_P, l_min: int, l_max: int) -> np.ndarray:
    """int64[P]: ``L(s) = l_min + round((l_max - l_min) (1 - s))`` response tokens per prompt (module docstring)."""
    s = np.clip(np.asarray(success_P, np.float64), 0.0, 1.0)
    return (l_min + np.rint((l_max - l_min) * (1.0 - s))).astype(np.int64)


def length_cap_mask(loss_mask_PxWxT, leaf_length_PxW, rewards_PxW, cap_P, truncated_reward: float):
    """The per-prompt token budget on host arrays: ``(loss_mask, rewards, truncated_PxW)`` with the loss mask 0 at
    response index ``t >= cap_P[p]`` and, for every leaf longer than its cap, ``reward = min(reward,
    truncated_reward)``."""
    mask = np.asarray(loss_mask_PxWxT)
    cap = np.asarray(cap_P, np.int64)[:, None]
    t = np.arange(mask.shape[-1])[None, None, :]
    new_mask = np.where(t < cap[..., None], mask, 0.0).astype(mask.dtype)
    truncated = np.asarray(leaf_length_PxW) > cap
    rewards = np.array(rewards_PxW, np.float32)
    return new_mask, np.where(truncated, np.minimum(rewards, truncated_reward), rewards), truncated


@register("dart")
@dataclasses.dataclass(frozen=True)
class DARTAllocator(Allocator):
    """DART's rollout count and length cap from each prompt's running success rate (module docstring; a
    reconstruction). ``ema``: the running rate's step weight ``beta`` in (0, 1]; ``min_length`` / ``max_length``:
    ``L_min`` / ``L_max`` of the length cap (``max_length = 0``: the sampler's response capacity). Inside a plain
    ``AllocationConfig`` only the rollout count applies; the length cap is applied by ``DARTConfig``."""

    ema: float = 0.5
    min_length: int = 32
    max_length: int = 0

    def __post_init__(self):
        if not 0.0 < self.ema <= 1.0:
            raise ConfigError(f"DARTAllocator.ema must be in (0, 1], got {self.ema}; fix: DARTAllocator.ema = 0.5")
        if self.min_length < 1 or (self.max_length and self.max_length < self.min_length):
            raise ConfigError(f"DARTAllocator: 1 <= min_length <= max_length (or max_length = 0) required, got "
                              f"min_length = {self.min_length}, max_length = {self.max_length}")

    def init_state(self) -> dict:
        return {"rate": {}}

    def success(self, stats: PromptStats, state: dict) -> tuple[np.ndarray, dict]:
        """``(s_P, new_state)``: the running success rates after this step's pre-rollout."""
        s, rates = running_success(state.get("rate", {}), stats.keys, stats.accuracy_P, self.ema)
        return s, {**state, "rate": rates}

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget):
        s, state = self.success(stats, state)
        n = np.asarray(stats.rollouts_P, np.int64)
        want = dart_rollouts(s, int(n.min()) if len(n) else budget.chunk, budget.max_rollouts)
        return np.maximum(want - n, 0), {**state, "last": [float(x) for x in s]}

    def length_caps(self, success_P, capacity: int) -> np.ndarray:
        """int64[P]: ``L(s)`` with ``L_max = max_length or capacity``, never above ``capacity`` (the sampler's
        ``T``)."""
        l_max = min(self.max_length or capacity, capacity)
        return np.minimum(dart_length_cap(success_P, min(self.min_length, l_max), l_max), capacity)


__all__ = ["DARTAllocator", "dart_length_cap", "dart_rollouts", "length_cap_mask", "running_success"]
