"""What the step-judging stages share (SLATE, MAPO): every step of every leaf scored by the scorer read as a process
reward model, handed to the estimator as an input; the rewards pass unchanged.

A step is one node of the leaf's path: a fixed segment of the tree rollout (SLATE) or a turn of a multi-turn
episode, the policy's tokens and the observation appended after them (MAPO). At run time (:class:`StepJudgedRollouts`)::

    steps    = each distinct leaf's nodes decoded one by one (the policy's tokenizer)     leaf_step_texts
    scores   = treejax.scorers.prm.step_scores(scorer, questions, steps)   [leaves, D]: step k's verdict
               probability p(yes) / (p(yes) + p(no)) read after step_1 .. step_k (one teacher-forced pass)
    Rollouts.estimator_inputs[stage.input_name] = scores as [P, W, D] (NaN past a leaf's steps)

A leaf slot that copies another (a slot tree's duplicate) takes its first copy's scores. The scorer loads on the
first step (``ScorerConfig.model``; ``"policy"``: ``RunConfig.model`` again). Metrics: ``judge/scored`` (steps
scored), ``judge/mean`` (their mean score), ``time/judge_s``.
"""

from __future__ import annotations

import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.judges.base import BaseStateOnly, JudgeStage, example_fields
from treejax.rl.sources.requirements import VERIFIER


class StepJudgeStage:
    """Mixin of the step-judging stages (module docstring); not a stage itself. A stage sets ``input_name`` (the
    estimator input it supplies, also its ``supplies``), ``estimator`` (the one estimator that reads it) and
    ``turns`` (its steps are turns of a turn forest, else the tree's fixed segments)."""

    role: ClassVar[str] = "wrapper"
    requires: ClassVar[tuple] = (VERIFIER,)
    input_name: ClassVar[str] = ""
    estimator: ClassVar[str] = ""
    turns: ClassVar[bool] = False

    def check(self, facts) -> None:
        name = type(self).__name__
        if self.input_name not in facts.estimator_inputs:
            raise ConfigError(f"RunConfig.rollouts: {name} supplies the judge's step scores ({self.input_name}) to "
                              f"estimator {self.estimator!r}, but the run's estimator is {facts.estimator!r}, which "
                              f"does not read them; fix: RunConfig.estimator = {self.estimator!r}")

    check_scorer = JudgeStage.check_scorer  # the stage's scorer is a ScorerConfig (one line with the fix)

    def build(self, inner, ctx):
        return StepJudgedRollouts(inner, self, ctx.tokenizer, ctx.cfg.model, ctx.mesh)


def leaf_step_texts(tokenizer, forest) -> list[list[list[str]]]:
    """``[P][W]`` lists of each leaf's step texts: its response tokens grouped by ``segment_index`` (one text per
    node on its path, observations included in a turn's node), decoded one by one."""
    tokens, seg, path = (np.asarray(x) for x in jax.device_get((forest.tokens, forest.segment_index,
                                                                 forest.leaf_path)))
    P, W, _ = tokens.shape
    out = []
    for p in range(P):
        row = []
        for w in range(W):
            depth = int(np.sum(path[p, w, 1:] >= 0)) if path[p, w, 0] >= 0 else 0
            row.append([tokenizer.decode(tokens[p, w][seg[p, w] == d].tolist(), skip_special_tokens=True)
                        for d in range(depth)])
        out.append(row)
    return out


def judge_steps(scorer, questions: list[str], steps_PxW: list[list[list[str]]], distinct_PxW: np.ndarray,
                end_PxW: np.ndarray, max_depth: int) -> np.ndarray:
    """float32 ``[P, W, D]``: the PRM's score of every step of every distinct leaf (NaN past its steps); a copy
    (``distinct`` False) takes the scores of the distinct slot that ends at the same node."""
    from treejax.scorers.prm import step_scores

    P, W = distinct_PxW.shape
    out = np.full((P, W, max_depth), np.nan, np.float32)
    where = [(p, w) for p in range(P) for w in range(W) if distinct_PxW[p, w] and steps_PxW[p][w]]
    if where:
        s = step_scores(scorer, [questions[p] for p, _ in where], [steps_PxW[p][w] for p, w in where])
        for (p, w), row in zip(where, s):
            n = min(len(steps_PxW[p][w]), max_depth)
            out[p, w, :n] = row[:n]
    for p in range(P):
        for w in range(W):
            if not distinct_PxW[p, w] and end_PxW[p, w] >= 0:
                first = np.flatnonzero(distinct_PxW[p] & (end_PxW[p] == end_PxW[p, w]))
                if len(first):
                    out[p, w] = out[p, first[0]]
    return out


class StepJudgedRollouts(BaseStateOnly):
    """The runtime wrapper (module docstring). ``base``: the chain before it."""

    def __init__(self, base, stage: StepJudgeStage, tokenizer, policy_model: str, mesh=None):
        self.base, self.stage, self.tokenizer, self.policy_model = base, stage, tokenizer, policy_model
        self.mesh = mesh
        self.pipeline = getattr(base, "pipeline", None)
        self.estimator_inputs = tuple(getattr(base, "estimator_inputs", ())) + (stage.input_name,)
        self.scorer = None

    def judge(self, ro) -> np.ndarray:
        """``[P, W, D]`` step scores of the rollouts' leaves (module docstring)."""
        from treejax.forest import end_nodes
        from treejax.scorers.model import load_scorer

        name, forest = type(self.stage).__name__, ro.forest
        if self.stage.turns and forest.node_span is None:
            raise ValueError(f"{name} judges the turns of multi-turn episodes; this chain's rows are single-turn "
                             "trees (fix: RunConfig.rollouts = [@MultiTurnConfig(), @" + name + "()])")
        if not self.stage.turns and forest.node_span is not None:
            raise ValueError(f"{name} judges the fixed segments of a tree rollout; this chain's rows are multi-turn "
                             "episodes (turn forests)")
        steps = leaf_step_texts(self.tokenizer, forest)
        questions, _ = example_fields(ro.examples, ro.prompts_PxLp, ro.lengths_P, self.tokenizer)
        distinct, end = (np.asarray(x) for x in jax.device_get((forest.distinct_leaves(),
                                                                 end_nodes(forest.leaf_path))))
        if self.scorer is None:
            self.scorer = load_scorer(self.stage.scorer, self.policy_model, self.mesh)
        return judge_steps(self.scorer, questions, steps, distinct, end, forest.max_depth)

    def sample(self, params, key, step):
        ro = self.base.sample(params, key, step)
        t0 = time.perf_counter()
        scores = self.judge(ro)
        ro.estimator_inputs = {**ro.estimator_inputs, self.stage.input_name: jnp.asarray(scores, jnp.float32)}
        ok = np.isfinite(scores)
        metrics = {"judge/scored": int(ok.sum())}
        if ok.any():
            metrics["judge/mean"] = float(scores[ok].mean())
        ro.extra_metrics = {**(ro.extra_metrics or {}), **metrics, "time/judge_s": time.perf_counter() - t0}
        return ro
