"""LoRA / QLoRA (treejax.models.lora): exactness of the parameter transform through the model's entry points, the
update that trains only the adapters, the checkpoint that holds only them, the KL reference without a copy, the
memory plan's byte counts, and a LoRA run of the real loop with a resume."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import lora, presets, transformer
from treejax.parallel.mesh import MeshConfig
from treejax.rl.batch import expanded_batch
from treejax.rl.layouts import Expanded
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn

CFG = presets.tiny_config("qwen2.5-0.5b")  # qkv biases: the adapters sit beside them
TOKENS = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
POSITIONS = jnp.broadcast_to(jnp.arange(12), (2, 12))


def _forward(params):
    return transformer.forward(params, CFG, TOKENS, POSITIONS)


def _trained_adapters(params, seed=10):
    """``params`` whose adapters' ``B`` are non-zero (a fresh adapter is the base model exactly)."""
    adapters = {t: dict(ab, b=0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), ab["b"].shape))
                for i, (t, ab) in enumerate(params["layers"]["lora"].items())}
    return lora.with_trainable(params, {"layers": {"lora": adapters}})


@pytest.fixture(scope="module")
def base():
    return transformer.init_params(CFG, jax.random.key(0))


def test_fresh_adapters_are_the_base_model_exactly(base):
    with_adapters = lora.add_adapters(base, lora.LoRAConfig(rank=4, base_dtype="float32"))
    np.testing.assert_array_equal(np.asarray(_forward(with_adapters)), np.asarray(_forward(base)))
    shapes = {t: (ab["a"].shape, ab["b"].shape) for t, ab in with_adapters["layers"]["lora"].items()}
    L, E, Q, K, H, F = (CFG.num_layers, CFG.hidden_size, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim,
                        CFG.intermediate_size)
    assert shapes == {"wq": ((L, E, 4), (L, 4, Q, H)), "wk": ((L, E, 4), (L, 4, K, H)), "wv": ((L, E, 4), (L, 4, K, H)),
                      "wo": ((L, Q, H, 4), (L, 4, E)), "w_gate": ((L, E, 4), (L, 4, F)),
                      "w_up": ((L, E, 4), (L, 4, F)), "w_down": ((L, F, 4), (L, 4, E))}
    np.testing.assert_array_equal(np.asarray(with_adapters["layers"]["lora_scale"]), np.full(L, 16 / 4))


def test_merged_and_unmerged_forward_agree(base):
    params = _trained_adapters(lora.add_adapters(base, lora.LoRAConfig(rank=4, base_dtype="float32")))
    unmerged, merged = _forward(params), _forward(lora.merge(params))
    assert float(jnp.abs(unmerged - _forward(base)).max()) > 0.1  # the adapters do change the model
    np.testing.assert_allclose(np.asarray(unmerged), np.asarray(merged), rtol=1e-5, atol=1e-5)
    # merge is W + s A B, leaf by leaf
    a, b = params["layers"]["lora"]["wo"]["a"], params["layers"]["lora"]["wo"]["b"]
    want = base["layers"]["wo"] + 4.0 * jnp.einsum("lqhr,lre->lqhe", a, b)
    np.testing.assert_allclose(np.asarray(lora.merge(params)["layers"]["wo"]), np.asarray(want), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("base_dtype, rel_err", [("int8", 0.01), ("nf4", 0.2), ("int4", 0.2)])
def test_quantized_base_is_the_dequantized_weights(base, base_dtype, rel_err):
    cfg = lora.LoRAConfig(rank=4, base_dtype=base_dtype, block_size=16)
    params = _trained_adapters(lora.prepare(base, cfg))
    wq = params["layers"]["wq"]
    assert isinstance(wq, lora.QArray) and wq.qvalue.shape == base["layers"]["wq"].shape
    # the model on the quantized base == the model on its dequantized, merged weights (fp32)
    np.testing.assert_allclose(np.asarray(_forward(params)), np.asarray(_forward(lora.merge(params, jnp.float32))),
                               rtol=1e-5, atol=1e-5)
    # and the quantization error of each weight is what the format allows (relative to its largest entry)
    deq = lora.weight(wq, jnp.float32)
    err = float(jnp.abs(deq - base["layers"]["wq"]).max() / jnp.abs(base["layers"]["wq"]).max())
    assert err < rel_err
    trainable, frozen = lora.param_bytes(params)
    full = sum(x.size * 4 for x in jax.tree.leaves(base))
    assert frozen < full / (4 if base_dtype == "int8" else 5) * 2  # bf16 rest + int8 / 4-bit projections


def test_decode_with_unmerged_adapters_matches_merged(base):
    """The sampler's two views (LoRAConfig.sampler_weights): prefill + decode steps of the same rows give the same
    logits with the unmerged (unfused) and the merged (fused) weights."""
    from treejax.sampling.decode import make_model_fns

    params = _trained_adapters(lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="int8")))
    fns = make_model_fns(CFG, attention="dense", cache_dtype="float32", fuse=True)

    def run(p):
        prepared = fns.prepare(p)
        cache = fns.init_cache(2, 16)
        seg = jnp.ones((2, 6), jnp.int32)
        cache = fns.prefill(prepared, TOKENS[:, :6], POSITIONS[:, :6], seg, cache, jnp.arange(2))
        out = []
        for t in range(6, 9):
            logits, cache = fns.step(prepared, TOKENS[:, t], jnp.full((2,), t), cache)
            out.append(logits)
        return jnp.stack(out)

    prepared = fns.prepare(params)["layers"][0]
    assert "wq" in prepared and "wqkv" not in prepared  # adapters keep their projections unfused
    assert "wqkv" in fns.prepare(lora.merge(params, jnp.float32))["layers"][0]
    np.testing.assert_allclose(np.asarray(run(params)), np.asarray(run(lora.merge(params, jnp.float32))),
                               rtol=1e-4, atol=1e-4)


def _batch(seed=3, B=4, L=12):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (B, L)).astype(np.int32)
    t = np.arange(L)[None, :]
    return expanded_batch(dict(
        tokens=jnp.asarray(tokens), positions=jnp.asarray(np.broadcast_to(t, (B, L)).astype(np.int32)),
        segment_ids=jnp.ones((B, L), jnp.int32), loss_mask=jnp.asarray(np.broadcast_to(t >= 4, (B, L)), jnp.float32),
        old_logp=jnp.full((B, L), -np.log(CFG.vocab_size), jnp.float32),
        advantages=jnp.asarray(np.repeat(rng.normal(size=(B, 1)), L, 1), jnp.float32)))


def test_update_trains_only_the_adapters(base):
    params = lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="int8"))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0))
    state = TrainState.create(params, tx)
    # the optimizer's moments mirror the adapters only
    mu = state.opt_state[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(lora.split(params)[0])
    update = jax.jit(make_update_fn(Expanded(CFG, attention_impl="xla"), LossConfig(), tx))
    new, metrics = update(state, _batch())
    assert float(metrics["grad_norm"]) > 0 and float(metrics["skipped"]) == 0
    _, frozen_old = lora.split(params)
    trained, frozen_new = lora.split(new.params)
    for old, now in zip(jax.tree.leaves(frozen_old), jax.tree.leaves(frozen_new)):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(now))  # the base never moves
    b_changed = [float(jnp.abs(ab["b"]).max()) for ab in trained["layers"]["lora"].values()]
    assert min(b_changed) > 0  # B leaves zero; A gets no gradient while B = 0 (dL/dA = s x^T g B^T)


def test_adapter_gradient_is_the_chain_rule_of_the_weight_gradient(base):
    """dL/dB = s A^T dL/dW and dL/dA = s dL/dW B^T, with dL/dW the full model's gradient at W + s A B."""
    from treejax.rl.update import make_grad_fn

    params = _trained_adapters(lora.add_adapters(base, lora.LoRAConfig(rank=4, base_dtype="float32")))
    grads_fn = jax.jit(make_grad_fn(Expanded(CFG, attention_impl="xla"), LossConfig()))
    trainable, frozen = lora.split(params)
    _, _, g_lora = grads_fn(trainable, _batch(), frozen)
    _, _, g_full = grads_fn(lora.merge(params), _batch())
    a, b = params["layers"]["lora"]["w_up"]["a"], params["layers"]["lora"]["w_up"]["b"]
    gw = g_full["layers"]["w_up"]
    np.testing.assert_allclose(np.asarray(g_lora["layers"]["lora"]["w_up"]["b"]),
                               np.asarray(4.0 * jnp.einsum("ler,lef->lrf", a, gw)), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g_lora["layers"]["lora"]["w_up"]["a"]),
                               np.asarray(4.0 * jnp.einsum("lef,lrf->ler", gw, b)), rtol=1e-4, atol=1e-7)


def test_reference_is_the_base_without_a_copy(base):
    from treejax.rl.step import initial_reference

    params = _trained_adapters(lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="bfloat16")))
    ref = initial_reference(params, LossConfig(kl_coef=0.1))
    assert ref is lora.BASE_REFERENCE
    resolved = lora.resolve_reference(ref, params)
    assert resolved["layers"]["wq"] is params["layers"]["wq"]  # the same array, not a copy
    assert "lora" not in resolved["layers"]
    np.testing.assert_array_equal(np.asarray(_forward(resolved)), np.asarray(_forward(lora.freeze_base(
        base, lora.LoRAConfig(rank=4, base_dtype="bfloat16")))))


def test_checkpoint_holds_only_the_adapters(base, tmp_path):
    from treejax.checkpoint import Checkpointer

    params = _trained_adapters(lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="nf4", block_size=16)))
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    state = TrainState.create(params, tx)
    saved = lora.checkpoint_state(state)
    assert jax.tree.structure(saved.params) == jax.tree.structure(lora.split(params)[0])
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved, {"rl_step": 1})
        ck.wait()
        fresh = TrainState.create(lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="nf4", block_size=16)), tx)
        restored, data = ck.restore(lora.checkpoint_state(fresh))
    state2 = lora.restored_state(fresh, restored)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "ck") for f in fs)
    assert on_disk < sum(x.size * 4 for x in jax.tree.leaves(base)) / 2  # the base is not in it


def test_memory_plan_counts_the_lora_tree_exactly(base):
    from treejax.memory_plan import lora_base_bytes, lora_elements

    for base_dtype in ("bfloat16", "int8", "nf4"):
        cfg = lora.LoRAConfig(rank=4, base_dtype=base_dtype, block_size=16, targets=("wq", "wo", "w_down"))
        trainable, frozen = lora.param_bytes(lora.prepare(base, cfg))
        assert 4 * lora_elements(CFG, cfg, (1, 1, 1)) == trainable
        # the plan omits the per-layer scale vector (4 bytes a layer) of the frozen part
        assert lora_base_bytes(CFG, cfg, (1, 1, 1)) == frozen - 4 * CFG.num_layers, base_dtype


@pytest.mark.parametrize("kw, message", [
    (dict(rank=-1), "rank must be >= 0"), (dict(rank=4, targets=("wz",)), "LoRAConfig.targets"),
    (dict(rank=4, base_dtype="int3"), "LoRAConfig.base_dtype"), (dict(rank=4, alpha=0.0), "alpha must be > 0"),
    (dict(rank=4, targets=("wq", "wq")), "names a projection twice"),
    (dict(rank=4, sampler_weights="fused"), "LoRAConfig.sampler_weights"),
])
def test_bad_lora_configs_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        lora.LoRAConfig(**kw)


def test_block_size_must_divide_the_input_axis(base):
    with pytest.raises(ValueError, match="block_size=48 does not divide"):
        lora.prepare(base, lora.LoRAConfig(rank=4, base_dtype="nf4", block_size=48))


def _lora_run(tiny_checkpoint, tmp_path):
    from treejax.rl import loop
    from treejax.rl.evaluation import EvalConfig

    base_cfg = loop.RunConfig()
    return dataclasses.replace(
        base_cfg, model=tiny_checkpoint, log_dir=str(tmp_path / "run"), num_steps=1, prompts_per_step=1,
        rollout=dataclasses.replace(base_cfg.rollout, num_leaves=2, max_depth=1, segment_length=2),
        eval=EvalConfig(num_problems=1, max_new_tokens=1), tree_picture_every=0, export_hf=False,
        loss=dataclasses.replace(base_cfg.loss, kl_coef=0.05, entropy_coef=0.01),  # a random model gets no reward
        optimizer=dataclasses.replace(base_cfg.optimizer, total_steps=2),
        lora=lora.LoRAConfig(rank=2, base_dtype="int8", sampler_weights="unmerged"),
        sampler_mesh=MeshConfig(data=2, fsdp=1, tensor=4))  # the sampler's own layout of the 8 fake devices


def _saved_adapters(cfg, run_dir):
    from treejax.checkpoint import restore_params

    params = transformer.init_params(presets.tiny_config("smollm2-135m", vocab_size=49152), jax.random.key(0))
    adapters = lora.split(lora.prepare(params, cfg.lora))[0]
    return adapters, restore_params(run_dir / "checkpoints", adapters)


@pytest.mark.devices(8)
def test_lora_run_of_the_loop_saves_only_adapters(tiny_checkpoint, tmp_path, caplog):
    """The real loop with LoRA (int8 base, KL to the base, unmerged sampler) on 8 fake devices, the learner FSDP
    over all 8 and the sampler on its own 2 x 1 x 4 layout of them (``RunConfig.sampler_mesh``: the adapters and
    the quantized base re-laid out after the update, the rollouts moved back): one step (the entropy bonus gives
    the adapters a gradient), and a checkpoint that holds the adapters (restorable as exactly that tree), not the
    base."""
    from treejax.rl import loop

    cfg = _lora_run(tiny_checkpoint, tmp_path)
    with caplog.at_level("INFO", logger="treejax"):
        summary = loop.run(cfg)
    assert "the sampler decodes on its own layout of the 8 device(s): data x fsdp x tensor = 2 x 1 x 4" in caplog.text
    row = summary["history"][-1]
    assert summary["steps"] == 1 and np.isfinite(row["update/loss"]) and row["rollout/decoded_tokens"] > 0
    assert 0 < row["time/relayout_s"] <= row["time/rollout_s"]
    adapters, (restored, step) = _saved_adapters(cfg, tmp_path / "run")
    assert step == 1 and jax.tree.structure(restored) == jax.tree.structure(adapters)
    assert any(float(np.abs(ab["b"]).max()) > 0 for ab in restored["layers"]["lora"].values())  # it trained


@pytest.mark.slow  # the adapter-only restore runs by default in test_checkpoint_holds_only_the_adapters, the
# loop's resume in tests/test_train_cli.py::test_tiny_run_writes_all_artifacts_and_resumes
@pytest.mark.devices(8)
def test_lora_run_of_the_loop_resumes(tiny_checkpoint, tmp_path):
    from treejax.rl import loop
    from treejax.testing.checkpoints import latest_data_state

    cfg = _lora_run(tiny_checkpoint, tmp_path)
    loop.run(cfg)
    summary = loop.run(dataclasses.replace(cfg, num_steps=2, log_dir_mode="resume"))
    assert summary["steps"] == 2 and int(latest_data_state(tmp_path / "run")["rl_step"]) == 2
    assert _saved_adapters(cfg, tmp_path / "run")[1][1] == 2


@pytest.mark.devices(8)
def test_lora_update_on_1_and_8_devices(base):
    """The adapters and a quantized (int8) base sharded by their logical axes on a data x fsdp x tensor mesh: the
    same update as on one device, the frozen base sharded like its weight and never moved, the adapters' Adam
    moments sharded like the adapters."""
    from jax.sharding import PartitionSpec as P

    from treejax.parallel.mesh import MeshConfig, batch_sharding, jit_update, make_mesh, place_train_state

    lcfg = lora.LoRAConfig(rank=4, base_dtype="int8")
    params_host = jax.device_get(_trained_adapters(lora.prepare(base, lcfg)))
    axes = lora.logical_axes(transformer.param_logical_axes(CFG), params_host)
    tx = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0))
    update = make_update_fn(Expanded(CFG, attention_impl="xla"), LossConfig(kl_coef=0.0), tx, num_micro_batches=2)
    batch_host = jax.device_get(_batch(B=8))
    results = {}
    for shape in [(1, 1, 1), (2, 2, 2)]:
        mesh = make_mesh(MeshConfig(*shape), devices=jax.devices()[: int(np.prod(shape))])
        state, shardings = place_train_state(params_host, axes, lambda p: TrainState.create(p, tx), tx, mesh)
        if shape == (2, 2, 2):
            assert state.params["layers"]["w_up"].qvalue.sharding.spec == P(None, "fsdp", "tensor")
            assert state.params["layers"]["lora"]["w_up"]["a"].sharding.spec == P(None, "fsdp", None)
            assert state.params["layers"]["lora"]["w_up"]["b"].sharding.spec == P(None, None, "tensor")
            mu = state.opt_state[1][0].mu["layers"]["lora"]["w_up"]["b"]
            assert mu.sharding.spec == P(None, None, "tensor")
        bsh = batch_sharding(mesh, batch_host)
        state, metrics = jit_update(update, shardings, bsh, mesh)(state, jax.device_put(batch_host, bsh))
        results[shape] = (jax.device_get(state.params), float(metrics["loss"]))
    (p1, l1), (p8, l8) = results[(1, 1, 1)], results[(2, 2, 2)]
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p8, p1)
    for a, b in zip(jax.tree.leaves(lora.split(p8)[1]), jax.tree.leaves(lora.split(params_host)[1])):
        np.testing.assert_array_equal(a, b)
