"""UI-S1's semi-online rollout (Lu et al. 2025, "UI-S1: Advancing GUI Automation via Semi-online Reinforcement
Learning", arXiv 2509.11543): online-style multi-turn episodes over *offline expert trajectories*, with a Patch
Module that recovers a divergence instead of ending the episode.

An expert trajectory is the example's reference tool calls ``g_1 .. g_n`` (``metadata["reference_calls"]``, what the
retrieval world ships for MatchTIR) followed by the answer step (step ``n + 1``: the ground truth). The policy acts
turn by turn on its *own* earlier turns (they stay in the conversation and the KV), and :class:`SemiOnlineEnv`
wraps the world's environment so that, at step ``t``:

* **match** (the policy's call has the expert's tool name and arguments whose token F1 with the expert's is at least
  ``SemiOnlineConfig.match_f1``; at the answer step: the verifier scores the answer 1): the world runs the
  *expert's* call ``g_t``, so the episode continues from the expert trajectory's next state;
* **mismatch** with patches left (``patches < patch_limit``; ``patch_limit = -1``: no limit): the Patch Module
  runs ``g_t`` in place of the policy's action and the observation says so (``[patched: <search>g_t</search>]``
  before the world's output): the next state is the expert's, the policy's wrong turn stays in the history
  (the paper's "Thought-Free Patch": the expert's action, no expert thought);
* **mismatch** without patches left (the official code's ``patch_threshold``), a tool call at the answer step,
  or the answer step itself: the episode ends.

Step reward (the official reward function's shape, ``verl/utils/reward_score/gui_traj.py``, read not copied)::

    r_t = format_weight * 1[the turn has reasoning text besides its action]
          + (1 - format_weight) * (1 if match else type_credit if same action type else 0)

(action type: the tool's name, or "answer" for a turn without a call). Each turn's ``info["semi_online"]`` holds
``step``, ``match``, ``type_match``, ``patched``, ``step_reward``; every turn's ``info["episode_score"]`` is the
share of the ``n + 1`` expert steps matched so far (so a fully matched trajectory, the task solved along the
expert's path, scores 1). :func:`semi_online_arrays` turns the infos into the estimator inputs
``step_reward_PxWxD`` / ``step_match_PxWxD`` of :mod:`treejax.rl.advantages.ui_s1`.

What is reconstructed (not read in the paper, whose method section was not available; the released code was read):
the text form of the patch note; thought-free patching only (the paper's other strategies, an expert thought
written by another model or the policy's own thought conditioned on the expert action, need expert thoughts the
world does not ship, and an append-only KV cannot *replace* the policy's turn, so it is kept and the patch is
appended after it); the match rule (token F1 of the arguments, the official code compares screen coordinates and
text); no 0.1 "parsed" credit for a wrong action type (every turn here parses, as a call or an answer).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from treejax.envs.base import StepResult
from treejax.errors import ConfigError

#: ``SemiOnlineConfig.patch`` values: the Patch Module's strategies (module docstring).
PATCHES = ("thought_free",)


@dataclasses.dataclass(frozen=True)
class SemiOnlineConfig:
    """The semi-online rollout (module docstring): ``patch_limit`` patches per episode (``-1``: no limit; ``0``:
    the first mismatch ends the episode; the official example script uses 2), ``patch`` the Patch Module's
    strategy, ``match_f1`` the arguments' token F1 at which a call matches the expert's, ``format_weight`` /
    ``type_credit`` the step reward's weights (the official reward's 0.1 and 0.5)."""

    patch_limit: int = 2
    patch: str = "thought_free"
    match_f1: float = 0.5
    format_weight: float = 0.1
    type_credit: float = 0.5

    def __post_init__(self):
        if not isinstance(self.patch_limit, int) or self.patch_limit < -1:
            raise ConfigError(f"SemiOnlineConfig.patch_limit must be an integer >= -1 (-1: no limit), got "
                              f"{self.patch_limit!r}; fix: SemiOnlineConfig.patch_limit = 2")
        if self.patch not in PATCHES:
            raise ConfigError(f"SemiOnlineConfig.patch must be one of {PATCHES}, got {self.patch!r}; fix: "
                              "SemiOnlineConfig.patch = 'thought_free'")
        for name in ("match_f1", "format_weight", "type_credit"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ConfigError(f"SemiOnlineConfig.{name} must be in [0, 1], got {v!r}; fix: a value in [0, 1]")


def args_f1(pred: dict, ref: dict) -> float:
    """Mean token F1 (:func:`treejax.rl.tool_match.token_f1`) over the union of both calls' argument names."""
    from treejax.rl.tool_match import token_f1

    pa, ra = pred.get("args", {}), ref.get("args", {})
    keys = sorted(set(pa) | set(ra))
    return float(np.mean([token_f1(pa.get(k, ""), ra.get(k, "")) for k in keys])) if keys else 1.0


def has_thought(action: str, call: dict | None) -> bool:
    """Whether the turn has reasoning text besides its action: a word before the call's last opening tag, or
    (an answer turn) a word on a line without ``answer:``."""
    if call is not None:
        cut = action.rfind(f"<{call['name']}>")
        return bool(re.search(r"\w", action[:cut] if cut >= 0 else ""))
    return any(re.search(r"\w", ln) for ln in action.splitlines() if "answer:" not in ln.lower())


@dataclasses.dataclass
class SemiOnlineEnv:
    """The semi-online wrapper of an environment (module docstring). ``inner``: the world's environment, whose
    class has ``parse_action(text) -> call | None`` and ``render_call(call) -> text`` (``expert_steps = True``) and
    whose ``task.score`` is the verifier; ``config``: a :class:`SemiOnlineConfig`. Plain state: ``clone()`` clones
    the inner environment and copies the counters."""

    inner: Any
    config: SemiOnlineConfig = SemiOnlineConfig()
    expert: tuple = ()
    example: Any = None
    step_index: int = 0
    patches: int = 0
    matched: int = 0
    done: bool = False
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if not getattr(type(self.inner), "expert_steps", False):
            raise ConfigError(f"SemiOnlineEnv: {type(self.inner).__name__} cannot replay expert steps (no "
                              "parse_action / render_call); fix: MultiTurnConfig.environment = 'retrieval'")
        self.stop_strings = tuple(self.inner.stop_strings)

    def reset(self, example) -> str:
        from treejax.rl.tool_match import reference_calls

        try:
            self.expert = tuple(reference_calls(example))
        except ValueError:
            raise ConfigError("SemiOnlineEnv needs an expert trajectory (example.metadata['reference_calls']) and "
                              "this example has none; fix: a task that ships them (RunConfig.task = "
                              "'retrieval_multihop')") from None
        self.example, self.step_index, self.patches, self.matched, self.done = example, 0, 0, 0, False
        return self.inner.reset(example)

    def judge(self, action: str) -> tuple[dict | None, bool, bool]:
        """``(the turn's call, match, type_match)`` against the expert's step ``step_index``."""
        call = type(self.inner).parse_action(action)
        if self.step_index >= len(self.expert):  # the answer step
            match = call is None and float(self.inner.task.score(action, self.example)) >= 1.0
            return call, match, call is None
        ref = self.expert[self.step_index]
        same = call is not None and call["name"] == ref["name"]
        return call, same and args_f1(call, ref) >= self.config.match_f1, same

    def step(self, action: str) -> StepResult:
        if self.example is None or self.done:
            raise RuntimeError("SemiOnlineEnv.step " + ("before reset" if self.example is None else "after the end"))
        cfg, t = self.config, self.step_index
        call, match, same = self.judge(action)
        reward = cfg.format_weight * has_thought(action, call) + (1.0 - cfg.format_weight) * (
            1.0 if match else cfg.type_credit if same else 0.0)
        self.matched += int(match)
        patched = not match and t < len(self.expert) and (cfg.patch_limit < 0 or self.patches < cfg.patch_limit)
        self.patches += int(patched)
        obs, info = "", {}
        if t >= len(self.expert):  # the expert's trajectory ends here: the answer is verified (or was not given)
            info = self.inner.step(action).info if call is None else {"answered": False}
            self.done = True
        elif match or patched:  # the expert's next state
            res = self.inner.step(type(self.inner).render_call(self.expert[t]))
            note = f"\n[patched: {type(self.inner).render_call(self.expert[t])}]" if patched else ""
            obs, info, self.done = note + res.observation, dict(res.info), bool(res.done)
        else:  # out of patches
            info, self.done = {"answered": False, "patch_limit": True}, True
        self.step_index += 1
        info["semi_online"] = {"step": t, "match": bool(match), "type_match": bool(same), "patched": bool(patched),
                               "step_reward": float(reward)}
        info["episode_score"] = self.matched / (len(self.expert) + 1)
        return StepResult(obs, float(reward), self.done, info)

    def clone(self) -> "SemiOnlineEnv":
        return dataclasses.replace(self, inner=self.inner.clone())


def semi_online_arrays(trees, depth: int) -> dict[str, np.ndarray]:
    """``{"step_reward_PxWxD", "step_match_PxWxD"}`` float32[P, W, D]: per leaf slot, its turn-``d + 1`` step reward
    and match (1 / 0) from ``info["semi_online"]``, NaN where the turn does not exist or carries none."""
    W = len(trees[0].slot_episode) if trees else 0
    reward = np.full((len(trees), W, depth), np.nan, np.float32)
    match = np.full((len(trees), W, depth), np.nan, np.float32)
    for p, tr in enumerate(trees):
        for w, ep in enumerate(tr.slot_episode):
            for d, info in enumerate(ep.infos[:depth]):
                if "semi_online" in info:
                    reward[p, w, d] = info["semi_online"]["step_reward"]
                    match[p, w, d] = float(info["semi_online"]["match"])
    return {"step_reward_PxWxD": reward, "step_match_PxWxD": match}


__all__ = ["PATCHES", "SemiOnlineConfig", "SemiOnlineEnv", "args_f1", "has_thought", "semi_online_arrays"]
