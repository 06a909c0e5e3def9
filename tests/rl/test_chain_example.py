"""The worked example of docs/ARCHITECTURE.md, "Adding a rollout stage": a planner written in this test file only.

``OneProblemConfig`` trains every step on copies of one problem (a debugging planner: can the policy overfit it?).
It is a frozen dataclass that subclasses ``Stage``, declares what it needs of the run, and builds its runtime
source from the task's rollout service. Nothing else in the package changes: ``RunConfig``, the set-up, the loop
and the learner take it as they take the shipped stages (gin registers it from the stage registry too).
"""

import dataclasses
from typing import ClassVar

import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import VERIFIER


@dataclasses.dataclass(frozen=True)
class OneProblemConfig(Stage):
    """Every step: ``prompts_per_step`` rows of the first problem the pipeline gives."""

    role: ClassVar[str] = "planner"
    requires: ClassVar[tuple] = (VERIFIER,)  # its metric is the verifier's accuracy on the one problem
    provides: ClassVar[frozenset[str]] = frozenset({"replayable_rows"})  # replay may wrap it

    def build(self, inner, ctx):
        return OneProblemRollouts(ctx.task_rollouts(), ctx.cfg.prompts_per_step)


class OneProblemRollouts:
    """The runtime source: draws one batch once, then rolls out its first prompt ``P`` times per step."""

    def __init__(self, base, prompts_per_step: int):
        self.base, self.P, self.pipeline, self.problem = base, prompts_per_step, base.pipeline, None

    def sample(self, params, key, step):
        from treejax.rl.rollouts import assemble_rows, row_block

        if self.problem is None:
            examples, prompts, lens = self.base.draw()
            self.problem = ([examples[0]] * self.P, np.repeat(prompts[:1], self.P, 0), np.repeat(lens[:1], self.P))
        out = self.base.roll_and_score(params, *self.problem, key, step)
        ro = assemble_rows([row_block(out, np.arange(self.P))], out.counters)
        ro.extra_metrics = {"one_problem/accuracy": float(np.mean(np.asarray(out.scores) >= 1.0))}
        return ro


def test_the_chain_checks_a_new_planner_from_its_declarations():
    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.sources import catalog

    cfg = RunConfig(rollouts=[OneProblemConfig()])
    assert cfg.chain() == (OneProblemConfig(),) and cfg.step_rows() == cfg.prompts_per_step
    with pytest.raises(ConfigError, match="OneProblemConfig needs verifier rewards"):
        RunConfig(rollouts=[OneProblemConfig()], reward_source="majority")
    with pytest.raises(ConfigError, match="OneProblemConfig decides a step's rows itself"):
        RunConfig(rollouts=[OneProblemConfig()], dynamic_sampling=True)
    with pytest.raises(ConfigError, match=r"estimator 'remax' reads \['greedy_reward_P'\]"):
        RunConfig(rollouts=[OneProblemConfig()], estimator="remax")
    cfg = RunConfig(rollouts=[OneProblemConfig(), catalog.ReplayConfig(rows=2)], loss=LossConfig(tis_cap=2.0))
    assert cfg.step_rows() == cfg.prompts_per_step + 2
    with pytest.raises(ConfigError, match="OneProblemConfig and DOTSConfig each decide a step's rows"):
        RunConfig(rollouts=[OneProblemConfig(), catalog.DOTSConfig()])


def test_gin_knows_a_new_stage_from_the_stage_registry():
    import os

    from treejax.gin_surface import parse

    gin_file = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")
    cfg = parse([gin_file], ["RunConfig.rollouts = [@OneProblemConfig(), @ReplayConfig()]", "ReplayConfig.rows = 2",
                             "LossConfig.tis_cap = 2.0"], check_mesh=False)
    assert [type(s).__name__ for s in cfg.rollouts] == ["OneProblemConfig", "ReplayConfig"]


@pytest.mark.slow  # two steps of the whole loop on the tiny model (~40 s)
def test_a_new_planner_runs_through_the_whole_loop(tiny_checkpoint, tmp_path):
    from treejax.rl.config import RunConfig
    from treejax.rl.evaluation import EvalConfig
    from treejax.rl.loop import run
    from treejax.sampling.tree import TreeConfig

    cfg = RunConfig(model=tiny_checkpoint, log_dir=str(tmp_path / "run"), num_steps=2, prompts_per_step=2,
                    rollout=TreeConfig(num_leaves=4, max_depth=2, segment_length=4),
                    eval=EvalConfig(num_problems=2, max_new_tokens=2), export_hf=False, tree_picture_every=0,
                    rollouts=[OneProblemConfig()])
    summary = run(cfg)
    rows = summary["history"]
    assert [r["step"] for r in rows] == [1, 2] and all("one_problem/accuracy" in r for r in rows)
    assert all(np.isfinite(r["update/loss"]) for r in rows)
