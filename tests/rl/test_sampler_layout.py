"""``RunConfig.sampler_mesh``: the rollout sampler on its own layout of the learner's devices (8 fake CPU devices:
the learner's FSDP mesh 1 x 8 x 1, the sampler's 2 x 1 x 4). The loop with it runs by default in
tests/models/test_lora.py::test_lora_run_of_the_loop_saves_only_adapters (a LoRA run: the view's shardings too);
the rollout on such a layout equals the one-device rollout in
tests/sampling/test_sampler_sharding.py::test_sampler_layout_relaid_out_from_the_learners_fsdp_state. Here: the
same loop learns the same with and without it (slow), and the config check and memory plan read it."""

import dataclasses

import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.parallel.mesh import MeshConfig

pytestmark = pytest.mark.devices(8)

SAMPLER = MeshConfig(data=2, fsdp=1, tensor=4)


def _run_config(tiny_checkpoint, tmp_path, sampler_mesh, name):
    from treejax.rl import loop
    from treejax.rl.evaluation import EvalConfig

    base = loop.RunConfig()
    return dataclasses.replace(
        base, model=tiny_checkpoint, log_dir=str(tmp_path / name), num_steps=1, prompts_per_step=2,
        rollout=dataclasses.replace(base.rollout, num_leaves=2, max_depth=1, segment_length=2),
        eval=EvalConfig(num_problems=1, max_new_tokens=1), tree_picture_every=0, export_hf=False,
        loss=dataclasses.replace(base.loss, entropy_coef=0.01), sampler_mesh=sampler_mesh)


@pytest.mark.slow  # two runs of the loop; the layout's rollout equality runs by default in
# tests/sampling/test_sampler_sharding.py::test_sampler_layout_relaid_out_from_the_learners_fsdp_state
def test_own_layout_learns_what_the_learners_layout_learns(tiny_checkpoint, tmp_path):
    from treejax.rl import loop

    own = loop.run(_run_config(tiny_checkpoint, tmp_path, SAMPLER, "own"))["history"][-1]
    same = loop.run(_run_config(tiny_checkpoint, tmp_path, None, "same"))["history"][-1]
    assert own["rollout/decoded_tokens"] == same["rollout/decoded_tokens"]
    for k in ("reward/mean", "update/loss", "update/grad_norm"):
        np.testing.assert_allclose(own[k], same[k], rtol=1e-4, atol=1e-7, err_msg=k)


def test_sampler_mesh_is_checked_against_the_devices_and_planned():
    from treejax.gin_surface import check_devices
    from treejax.memory_plan import meshes
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match="RunConfig.sampler_mesh: MeshConfig.*needs 6 devices"):
        check_devices(RunConfig(sampler_mesh=MeshConfig(data=2, fsdp=1, tensor=3)))
    learner, sampler, split = meshes(RunConfig(sampler_mesh=SAMPLER), 8)
    assert (learner, sampler, split) == ((1, 8, 1), (2, 1, 4), False)
