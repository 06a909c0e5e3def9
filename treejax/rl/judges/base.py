"""What the judge stages share: their declarations, their checks and the runtime wrapper that rewrites rewards.

A judge stage (a frozen dataclass subclassing :class:`JudgeStage` and :class:`~treejax.rl.sources.base.Stage`)
declares ``role = "wrapper"``, ``requires = (VERIFIER,)`` (it reads the verifier's correctness of every leaf) and
implements ``judged(correct_PxW) -> bool [P, W]`` (the leaves the judge reads) and ``shape(rewards, correct,
judge, style) -> (rewards, metrics)`` (pure NumPy, tested on hand-made numbers). :class:`JudgedRollouts` does the
rest at run time:

    texts   = the leaves' decoded responses (the policy's tokenizer; treejax.rl.scoring.leaf_texts)
    judge   = scorer score in [0, 1] of (question, text, answer) where judged, NaN elsewhere
              (ScorerConfig.mode: verdict-token log-probs or a decoded verdict; scope "steps": the least of the
              PRM's per-line step scores, treejax.scorers.prm)
    rewards = stage.shape(rewards, verifier correct, judge, RunConfig.reward_style)

The scorer loads when a first leaf is to be judged (``ScorerConfig.model``; ``"policy"``: ``RunConfig.model``
again, the policy's initial weights). Metrics: ``judge/scored`` (leaves judged), ``judge/mean`` (their mean
score), ``judge/agreement`` (judged leaves where ``score >= 0.5`` equals the verifier's verdict),
``time/judge_s``, and the stage's own.

Order of effects: the planner's dynamic sampling filters groups by the verifier's rewards before the judge runs
(an all-correct group is dropped even when the judge would tell its leaves apart); estimator inputs computed
from the planner's rewards (ReMax's greedy reward, SPO-chain's cut values) would not see the judge, so the
stage refuses them.
"""

from __future__ import annotations

import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.sources.requirements import VERIFIER
from treejax.scorers.config import ScorerConfig

#: estimator inputs computed from the planner's (un-judged) rewards
REWARD_INPUTS = frozenset({"greedy_reward_P", "cut_value_PxWxB"})
SCOPES = ("verdict", "steps")


class JudgeStage:
    """Mixin of the judge stages (module docstring); not a stage itself (it does not subclass ``Stage``)."""

    role: ClassVar[str] = "wrapper"
    requires: ClassVar[tuple] = (VERIFIER,)

    def check(self, facts) -> None:
        bad = sorted(set(facts.estimator_inputs) & REWARD_INPUTS)
        if bad:
            raise ConfigError(f"RunConfig.rollouts: {type(self).__name__} rewrites the rewards after the planner, "
                              f"but estimator {facts.estimator!r} reads {bad}, computed from the rewards before it; "
                              "fix: an estimator without them (e.g. RunConfig.estimator = 'grpo')")
        if getattr(self, "scope", "verdict") not in SCOPES:
            raise ConfigError(f"{type(self).__name__}.scope must be one of {SCOPES}, got {self.scope!r}; fix: "
                              f"{type(self).__name__}.scope = 'verdict'")

    def check_scorer(self) -> None:
        """The stage's ``scorer`` is a :class:`ScorerConfig` (called from each stage's ``__post_init__``)."""
        name = type(self).__name__
        if not isinstance(self.scorer, ScorerConfig):
            raise ConfigError(f"{name}.scorer must be a ScorerConfig, got {self.scorer!r}; fix: "
                              f"{name}.scorer = @ScorerConfig()")

    def build(self, inner, ctx):
        return JudgedRollouts(inner, self, ctx.tokenizer, ctx.cfg.reward_style, ctx.cfg.model, ctx.mesh)

    def judged(self, correct_PxW: np.ndarray) -> np.ndarray:
        return np.ones(correct_PxW.shape, bool)

    def shape(self, rewards_PxW, correct_PxW, judge_PxW, style: str):
        raise NotImplementedError


def example_fields(examples, prompts, lengths, tokenizer) -> tuple[list[str], list[str]]:
    """``(questions, answers)`` of the rows: the task's ``metadata["question"]`` and ground truth, or (a source
    without an example per row) the decoded prompt and ``""``."""
    if (examples is not None and len(examples) == len(np.asarray(lengths))
            and all(hasattr(e, "metadata") for e in examples)):
        return ([str(e.metadata.get("question", "")) for e in examples],
                [str(getattr(e, "ground_truth", "")) for e in examples])
    p, n = np.asarray(prompts), np.asarray(lengths)
    return [tokenizer.decode(p[i, : n[i]].tolist(), skip_special_tokens=True) for i in range(len(n))], [""] * len(n)


def score_leaves(scorer, scope: str, questions, texts, answers) -> np.ndarray:
    """float32 ``[N]`` judge scores of leaves (``scope``: ``"verdict"`` the judge's, ``"steps"`` the least of the
    PRM's per-line scores; a response without a line: NaN)."""
    from treejax.scorers.judge import judge_scores
    from treejax.scorers.prm import line_steps, step_scores

    if scope == "verdict":
        return judge_scores(scorer, questions, texts, answers)
    steps = [line_steps(t) for t in texts]
    s = step_scores(scorer, questions, steps)
    with np.errstate(all="ignore"):
        return np.array([np.nanmin(r) if np.isfinite(r).any() else np.nan for r in s], np.float32)


class BaseStateOnly:
    """A judging wrapper keeps no state of its own: its checkpoint state is the wrapped chain's (``self.base``)."""

    def checkpoint_state(self) -> dict:
        return dict(getattr(self.base, "checkpoint_state", dict)())

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)


class JudgedRollouts(BaseStateOnly):
    """The runtime wrapper (module docstring). ``base``: the chain before it."""

    def __init__(self, base, stage: JudgeStage, tokenizer, style: str, policy_model: str, mesh=None):
        self.base, self.stage, self.tokenizer, self.style = base, stage, tokenizer, style
        self.policy_model, self.mesh = policy_model, mesh
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = getattr(base, "estimator_inputs", ())
        self.scorer = None

    def judge(self, ro) -> np.ndarray:
        """``[P, W]`` judge scores of the leaves the stage reads (NaN elsewhere)."""
        from treejax.rl.scoring import leaf_texts
        from treejax.scorers.model import load_scorer

        if ro.forest.node_span is not None:
            raise ValueError(f"{type(self.stage).__name__} judges single-turn responses; this chain's rows are "
                             "multi-turn episodes (turn forests)")
        texts = leaf_texts(self.tokenizer, ro.forest)
        questions, answers = example_fields(ro.examples, ro.prompts_PxLp, ro.lengths_P, self.tokenizer)
        need = self.stage.judged(np.asarray(ro.correct_PxW))
        where = np.argwhere(need)
        out = np.full(need.shape, np.nan, np.float32)
        if len(where):
            if self.scorer is None:  # loaded when there is a first leaf to judge
                self.scorer = load_scorer(self.stage.scorer, self.policy_model, self.mesh)
            out[need] = score_leaves(self.scorer, getattr(self.stage, "scope", "verdict"),
                                     [questions[p] for p, _ in where], [texts[p][w] for p, w in where],
                                     [answers[p] for p, _ in where])
        return out

    def sample(self, params, key, step):
        ro = self.base.sample(params, key, step)
        t0 = time.perf_counter()
        correct = np.asarray(ro.correct_PxW)
        judge = self.judge(ro)
        rewards = np.asarray(jax.device_get(ro.rewards_PxW), np.float32)
        new, metrics = self.stage.shape(rewards, correct, judge, self.style)
        ro.rewards_PxW = jnp.asarray(new, jnp.float32)
        ro.extra_metrics = {**(ro.extra_metrics or {}), **judge_metrics(judge, correct),
                            **metrics, "time/judge_s": time.perf_counter() - t0}
        return ro


def judge_metrics(judge_PxW: np.ndarray, correct_PxW: np.ndarray) -> dict:
    """``judge/scored``, ``judge/mean`` and ``judge/agreement`` (score >= 0.5 vs the verifier) of judged leaves."""
    ok = np.isfinite(judge_PxW)
    out = {"judge/scored": int(ok.sum())}
    if ok.any():
        out["judge/mean"] = float(judge_PxW[ok].mean())
        out["judge/agreement"] = float(np.mean((judge_PxW[ok] >= 0.5) == correct_PxW[ok]))
    return out
