"""Sharding tests: rules -> specs, sharded init, and the same update step on 1 device and on 8 fake CPU devices
(data x fsdp x tensor meshes) giving the same new params."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from treejax.models import presets, transformer
from treejax.parallel.axis_rules import DEFAULT_RULES, rules_dict
from treejax.parallel.mesh import (MeshConfig, batch_sharding, jit_update, logical_to_sharding, logical_to_spec,
                                   make_mesh, place_train_state)
from treejax.rl import losses
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.batch import expanded_batch
from treejax.rl.layouts import Expanded
from treejax.rl.update import make_update_fn

CFG = presets.tiny_config("qwen2.5-0.5b")


@pytest.mark.devices(8)
def test_mesh_shape_axis_types_and_errors():
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(MeshConfig(data=2, fsdp=4, tensor=2))
    with pytest.raises(ValueError, match="at most one axis"):
        make_mesh(MeshConfig(data=-1, fsdp=-1))


@pytest.mark.devices(8)
def test_logical_to_spec_rules():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("layers", "embed", "heads", "head_dim"), mesh) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("batch", "length"), mesh) == P(("data", "fsdp"), None)
    # fsdp is already used by batch: embed is then replicated rather than sharding one mesh axis twice
    assert logical_to_spec(("batch", "length", "embed"), mesh) == P(("data", "fsdp"), None, None)
    # a dimension the mesh axis does not divide is replicated
    assert logical_to_spec(("kv_heads",), mesh, shape=(3,)) == P(None)
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",), mesh)
    with pytest.raises(ValueError, match="twice"):
        rules_dict(DEFAULT_RULES + (("batch", None),))
    axes = transformer.param_logical_axes(CFG)
    sh = logical_to_sharding(axes, mesh)
    assert sh["layers"]["w_up"].spec == P(None, "fsdp", "tensor")


def _setup(mesh, tx, params_host):
    """Sharded TrainState holding ``params_host`` (same values on every mesh)."""
    def create(params):
        return TrainState.create(params, tx)

    return place_train_state(params_host, transformer.param_logical_axes(CFG), create, tx, mesh)


def _batch(B=8, L=16, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(L)[None, :]
    lengths = rng.integers(8, L + 1, B)
    seg = (t < lengths[:, None]).astype(np.int32)
    return dict(
        tokens=jnp.asarray(np.where(seg > 0, rng.integers(3, CFG.vocab_size, (B, L)), 0).astype(np.int32)),
        positions=jnp.asarray(np.broadcast_to(t, (B, L)).astype(np.int32)),
        segment_ids=jnp.asarray(seg),
        loss_mask=jnp.asarray(((t >= 4) & (seg > 0)).astype(np.float32)),
        old_logp=jnp.asarray(np.log(1 / CFG.vocab_size) + rng.normal(0, 0.3, (B, L)).astype(np.float32)),
        advantages=jnp.asarray(np.broadcast_to(rng.normal(size=(B, 1)), (B, L)).astype(np.float32)),
    )


@pytest.mark.slow  # 8-device updates stay in the default run: test_packing.py::test_packed_update_on_8_devices_*
@pytest.mark.devices(8)
def test_same_update_on_1_and_8_devices():
    # eps=1 keeps Adam's first step smooth in the gradient (see tests/rl/test_update.py)
    tx = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0, weight_decay=0.1))
    loss_cfg = losses.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    params_host = jax.device_get(transformer.init_params(CFG, jax.random.PRNGKey(0)))
    batch_host = jax.device_get(expanded_batch(_batch()))
    update = make_update_fn(Expanded(CFG, attention_impl="xla"), loss_cfg, tx, num_micro_batches=2)
    results = {}
    for shape in [(1, 1, 1), (2, 2, 2), (8, 1, 1), (1, 2, 4)]:
        devices = jax.devices()[: int(np.prod(shape))]
        mesh = make_mesh(MeshConfig(*shape), devices=devices)
        state, shardings = _setup(mesh, tx, params_host)
        if shape == (1, 2, 4):  # params really are split over the mesh
            assert state.params["layers"]["w_up"].sharding.spec == P(None, "fsdp", "tensor")
            assert len(state.params["layers"]["w_up"].addressable_shards) == 8
            mu = state.opt_state[1][0].mu["layers"]["w_up"]  # Adam moments follow their params
            assert mu.sharding.spec == P(None, "fsdp", "tensor")
        bsh = batch_sharding(mesh, batch_host)
        batch = jax.device_put(batch_host, bsh)
        step = jit_update(update, shardings, bsh, mesh)
        for _ in range(2):
            state, metrics = step(state, batch)
        results[shape] = (jax.device_get(state.params), float(metrics["loss"]), float(metrics["grad_norm"]))
    ref_params, ref_loss, ref_gn = results[(1, 1, 1)]
    for shape, (p, l, gn) in results.items():
        np.testing.assert_allclose(l, ref_loss, rtol=1e-5, err_msg=str(shape))
        np.testing.assert_allclose(gn, ref_gn, rtol=1e-5, err_msg=str(shape))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(shape)),
                     p, ref_params)


def test_distributed_start_is_a_no_op_without_cluster_env(monkeypatch):
    from treejax.parallel.mesh import maybe_initialize_distributed

    for var in ("JAX_COORDINATOR_ADDRESS", "TREEJAX_DISTRIBUTED"):
        monkeypatch.delenv(var, raising=False)
    assert maybe_initialize_distributed() is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        maybe_initialize_distributed()


@pytest.mark.devices(8)
def test_cudnn_attention_operands_share_one_sharding_under_the_mesh():
    """cuDNN's attention partitioner needs q, k and v sharded alike (on 2 GPUs with fsdp weights GSPMD gave them
    different shardings): under the loop's context mesh they are constrained to rows by ``batch`` and heads by
    ``heads`` where the mesh axis divides both head counts; without one they pass through unchanged."""
    from jax.sharding import PartitionSpec as P

    from jax.sharding import NamedSharding

    from treejax.models.transformer import same_attention_sharding
    from treejax.parallel.mesh import MeshConfig, make_mesh

    q = jnp.ones((8, 4, 4, 2))
    kv = jnp.ones((8, 4, 2, 2))
    assert same_attention_sharding(q, kv, kv)[0] is q
    for shape, heads in (((2, 2, 2), "tensor"), ((1, 2, 4), None)):  # 4 query / 2 KV heads: tensor=4 replicates
        mesh = make_mesh(MeshConfig(*shape))
        with jax.set_mesh(mesh):
            out = jax.jit(same_attention_sharding)(q, kv, kv)
        want = NamedSharding(mesh, P(("data", "fsdp") if shape[0] > 1 else "fsdp", None, heads, None))
        for x in out:
            assert x.sharding.is_equivalent_to(want, 4), x.sharding
