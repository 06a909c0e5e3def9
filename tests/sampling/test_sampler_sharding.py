"""The samplers on a device mesh (8 fake CPU devices): the tree rollout and the linear sampler give the same
result as on one device, and the KV cache really is sharded (rows over data x fsdp, KV heads over tensor).

Tolerance: sampled tokens must be identical; log-probs agree to ``atol=1e-4`` (fp32). The sharded program sums
the tensor-parallel contractions (attention output over heads, MLP down-projection, fsdp-split hidden) as
per-shard partial sums plus an all-reduce, i.e. in a different order than one device: fp32 rounding differences
of a few ulps, amplified through 2 layers of the x8-scaled tiny weights to ~1e-5 on the log-probs (measured max
1.1e-5); 1e-4 is the bound ``test_tree.py`` uses between two fp32 samplers of the same model. Tokens are drawn by
inverse CDF from one uniform per token, so an ulp-level difference flips a token only if the uniform falls
within ~1e-6 of a CDF boundary (not the case for these fixed seeds).
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from treejax.models import presets
from treejax.models import transformer as T
from treejax.parallel.mesh import MeshConfig, logical_to_sharding, make_mesh
from treejax.sampling import decode, tree
from treejax.sampling import strategies as S

pytestmark = pytest.mark.devices(8)  # the 1-vs-8-device comparisons need 8 (fake CPU) devices

# 8 query heads over 4 KV heads, so the cache's KV-head axis splits over tensor=4 (the default tiny config's
# 2 KV heads do not: see test_cache_sharding_specs)
CFG = presets.tiny_config("qwen2.5-0.5b", num_heads=8, num_kv_heads=4, true_vocab_size=250)
TC = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=tuple(range(3, 40)),
                     strategy=S.Temperature(1.0), row_buckets=2)
PROMPTS = np.random.RandomState(1).randint(60, 250, (2, 6))
LENGTHS = np.array([6, 3])
TREE_KEY = jax.random.key(5)  # a key whose rollout forks and falls back (asserted below) with the current draw
MESHES = [(2, 1, 4), (2, 2, 2)]  # (data, fsdp, tensor)


@pytest.fixture(scope="module")
def params_host():
    params = T.init_params(CFG, jax.random.key(0))
    return jax.device_get(jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params))


def _mesh(shape):
    return make_mesh(MeshConfig(*shape), devices=jax.devices()[: int(np.prod(shape))])


def _place(params_host, mesh):
    return jax.device_put(params_host, logical_to_sharding(T.param_logical_axes(CFG), mesh, shapes=params_host))


def _recording(fns, seen):
    """``fns`` whose decode step records the sharding XLA chose for the cache it receives (inside the loops)."""

    def step(params, tokens, positions, cache):
        for buf in (cache["k"][0], cache["v"][-1]):
            jax.debug.inspect_array_sharding(buf, callback=lambda sh, shape=buf.shape: seen.append(
                (shape, sh.shard_shape(shape))))
        return fns.step(params, tokens, positions, cache)

    return dataclasses.replace(fns, step=step)


def _check_cache_sharded(seen, shape):
    """Every cache buffer entering a decode step is split over tensor on KV heads; the full R-row buffers over
    data x fsdp on rows (row buckets smaller than that are replicated over the axes that do not divide them)."""
    data, fsdp, tensor = shape
    assert seen, "no decode step was traced"
    full_rows = max(s[0] for s, _ in seen)
    for full, local in seen:
        R, K, L, H = full
        assert local[1] == K // tensor and local[2:] == (L, H), (full, local)
        if R == full_rows:
            assert local[0] == R // (data * fsdp), (full, local)
    assert any(s[0] == full_rows for s, _ in seen)


@pytest.fixture(scope="module")
def tree_reference(params_host):
    fns = decode.make_model_fns(CFG, block_size=16, cache_dtype="float32")
    return jax.device_get(tree.make_tree_rollout(fns, TC)(params_host, PROMPTS, LENGTHS, TREE_KEY))


@pytest.mark.parametrize("shape", [pytest.param(MESHES[0], marks=pytest.mark.slow), MESHES[1]],
                         ids=lambda s: "x".join(map(str, s)))  # 2x2x2 shards rows, fsdp and heads at once
def test_tree_rollout_sharded_matches_one_device(shape, params_host, tree_reference):
    mesh = _mesh(shape)
    seen = []
    fns = _recording(decode.make_model_fns(CFG, block_size=16, cache_dtype="float32", mesh=mesh), seen)
    forest, info = tree.make_tree_rollout(fns, TC)(_place(params_host, mesh), PROMPTS, LENGTHS, TREE_KEY)
    _check_cache_sharded(seen, shape)
    ref_forest, ref_info = tree_reference
    assert int(ref_info.forks) > 0 and int(ref_info.fallbacks) > 0  # forks and fallbacks are exercised
    for k in ("decoded_tokens", "forks", "fallbacks", "segments"):
        assert int(getattr(info, k)) == int(getattr(ref_info, k)), k
    np.testing.assert_array_equal(np.asarray(forest.tokens), ref_forest.tokens)
    np.testing.assert_array_equal(np.asarray(forest.leaf_path), ref_forest.leaf_path)
    np.testing.assert_array_equal(np.asarray(forest.leaf_status), ref_forest.leaf_status)
    np.testing.assert_allclose(np.asarray(forest.logprobs), ref_forest.logprobs, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(info.sampling_logprobs_PxWxT), ref_info.sampling_logprobs_PxWxT, rtol=0,
                               atol=1e-4)


def test_generate_sharded_matches_one_device(params_host):
    shape = (2, 1, 4)
    mesh = _mesh(shape)
    prompts, lengths = np.repeat(PROMPTS, 2, 0), np.repeat(LENGTHS, 2)
    kw = dict(max_new_tokens=10, strategy=S.Temperature(1.0), stop_ids=(2,))
    ref = decode.generate(params_host, decode.make_model_fns(CFG, block_size=16, cache_dtype="float32"), prompts,
                          lengths, jax.random.key(4), **kw)
    seen = []
    fns = _recording(decode.make_model_fns(CFG, block_size=16, cache_dtype="float32"), seen)
    out = decode.generate(_place(params_host, mesh), fns, prompts, lengths, jax.random.key(4), mesh=mesh, **kw)
    _check_cache_sharded(seen, shape)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), rtol=0, atol=1e-4)


def test_cache_sharding_specs():
    mesh = _mesh((2, 1, 4))
    fns = decode.make_model_fns(CFG, block_size=16, mesh=mesh)
    cache = jax.jit(lambda: fns.shard_cache(fns.init_cache(8, 32)))()
    for buf in cache["k"] + cache["v"]:
        assert buf.sharding.spec == P("data", "tensor")
        assert buf.addressable_shards[0].data.shape == (4, 1, 32, CFG.head_dim)
    # 2 KV heads on tensor=4 and 3 rows on data=2: replicated on those axes rather than failing
    small = presets.tiny_config("qwen2.5-0.5b")
    fns2 = decode.make_model_fns(small, block_size=16, mesh=mesh)
    for rows, local_rows in ((8, 4), (3, 3)):
        buf = jax.jit(lambda: fns2.shard_cache(fns2.init_cache(rows, 32)))()["k"][0]
        assert buf.addressable_shards[0].data.shape == (local_rows, 2, 32, small.head_dim)
    # without a mesh nothing is constrained; the mesh argument of the samplers builds the sharded fns
    plain = decode.make_model_fns(CFG, block_size=16)
    assert plain.mesh is None and plain.shard_cache(cache) is cache
    assert tree.make_tree_rollout(CFG, TC, mesh=mesh).model_fns.mesh == mesh
    assert decode.as_model_fns(plain, mesh) is decode.as_model_fns(plain, mesh)  # cached: no retrace per call
    with pytest.raises(ValueError, match="already carry a mesh"):
        decode.as_model_fns(fns, _mesh((1, 8, 1)))


def test_sampler_layout_relaid_out_from_the_learners_fsdp_state(params_host, tree_reference):
    """``RunConfig.sampler_mesh``: the learner's weights sharded over ``fsdp`` on all 8 devices are re-laid out
    (one ``device_put``) onto the sampler's own layout of the same devices (2 x 2 x 2, not split over ``fsdp``:
    ``SAMPLER_RULES``); its rollout is the one-device rollout (tokens identical)."""
    from treejax.parallel.axis_rules import DEFAULT_RULES, SAMPLER_RULES

    axes = T.param_logical_axes(CFG)
    learner = _mesh((1, 8, 1))
    state_params = jax.device_put(params_host, logical_to_sharding(axes, learner, DEFAULT_RULES, params_host))
    assert state_params["layers"]["w_up"].sharding.spec == P(None, "fsdp", None)
    sampler = _mesh((2, 2, 2))
    weights = jax.device_put(state_params, logical_to_sharding(axes, sampler, SAMPLER_RULES, params_host))
    assert weights["layers"]["w_up"].sharding.spec == P(None, None, "tensor")
    assert weights["layers"]["w_up"].sharding.mesh.devices.shape == (2, 2, 2)
    fns = decode.make_model_fns(CFG, block_size=16, cache_dtype="float32", mesh=sampler)
    with jax.set_mesh(sampler):
        forest, info = tree.make_tree_rollout(fns, TC)(weights, PROMPTS, LENGTHS, TREE_KEY)
    ref_forest, ref_info = tree_reference
    np.testing.assert_array_equal(np.asarray(forest.tokens), ref_forest.tokens)
    np.testing.assert_array_equal(np.asarray(forest.leaf_path), ref_forest.leaf_path)
    np.testing.assert_allclose(np.asarray(forest.logprobs), ref_forest.logprobs, rtol=0, atol=1e-4)
