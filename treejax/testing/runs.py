"""One step of a shipped config as the real job (``treejax.train.main``) on a tiny model: what the methods' slow
"the shipped config runs end to end" tests share (the multi-turn worlds' form is
:func:`treejax.testing.envs.run_shipped_multiturn`)."""

from __future__ import annotations

import math
import os

#: One step of 2 prompts x 4 leaf slots of a depth-2 tree of 4-token segments, a tiny held-out set, nothing
#: written but the logs and the checkpoint.
ONE_STEP = ("RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
            "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
            "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2", "RunConfig.eval_every = 0",
            "RunConfig.mini_batches = 1", "OptimizerConfig.total_steps = 1", "RunConfig.tree_picture_every = 0",
            "RunConfig.export_hf = False")


def run_shipped(config: str, model: str, log_dir, extra: tuple = ()) -> dict:
    """``configs/<config>`` through ``treejax.train.main`` for one step on ``model`` (:data:`ONE_STEP`, then
    ``extra``, which may override them). Checks one history row with a finite loss and returns that row."""
    from treejax import train

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    params = [f"RunConfig.model = '{model}'", f"RunConfig.log_dir = '{log_dir}'", *ONE_STEP, *extra]
    summary = train.main(["--gin_file", os.path.join(root, "configs", config), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    assert len(summary["history"]) == 1, summary["history"]
    row = summary["history"][0]
    assert math.isfinite(row["update/loss"]), row["update/loss"]
    return row


__all__ = ["ONE_STEP", "run_shipped"]
