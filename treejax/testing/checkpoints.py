"""What a resume restores, read back for tests: the JSON data state of a run's newest checkpoint."""

from __future__ import annotations

import glob
import json
import os


def latest_data_state(log_dir) -> dict:
    """The JSON data state (pipeline, rl_step, the sources' states) of the newest checkpoint under ``log_dir``."""
    steps = sorted(glob.glob(os.path.join(str(log_dir), "checkpoints", "*", "data", "metadata")),
                   key=lambda f: int(f.split(os.sep)[-3]))
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {log_dir}/checkpoints")
    with open(steps[-1]) as f:
        return json.load(f)
