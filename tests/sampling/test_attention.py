"""Decode attention: the implementation chosen for each head size / cache dtype / backend, and every implementation
against the dense reference on ragged rows (live rows of several lengths, dead rows at positions >= L).

Off the GPU the Pallas kernel runs in Pallas' interpreter (``backend="gpu"`` simulates the GPU choice); on a GPU
(``TREEJAX_TEST_DEVICE=gpu``, tests/conftest.py) the same tests run the compiled Triton kernel.

Tolerances (outputs are convex combinations of N(0, 1) values, so O(1)):
  * float32 caches: ``atol = 1e-5``. The implementations differ only in summation order and the online-softmax
    rescaling, a few fp32 ulps (<= 7.6e-7 measured on CPU); TF32 (10-bit mantissa) or bf16 arithmetic anywhere
    gives errors of 1e-4..1e-2, so this also proves the fp32 path is full fp32 (the GPU suite runs XLA under
    ``default_matmul_precision("highest")``; the kernel pins it itself).
  * bfloat16 caches (float32 queries): against fp32 attention of the same stored values (q rounded to bf16),
    ``atol = 2**-5 * max|v|`` = 8 bf16 unit roundoffs (``u = 2**-8``) of the largest value: the kernels round q
    (ragged: ``q / sqrt(H)``), the probabilities and, in the Pallas kernel, the per-split partial outputs and
    their combination to bf16, each worth about ``u max|v|`` (measured on CPU: <= 0.33 u max|v|).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets
from treejax.sampling import attention as attn
from treejax.sampling import decode

INTERPRET = jax.default_backend() != "gpu"  # the compiled Triton kernel where there is one
HEAD_DIMS = (24, 64, 80, 96, 128)
BLOCK = 16


def _inputs(seed, K, L, H, dtype, groups=3):
    """q [B, 1, 3K, H] fp32, k/v [B, K, L, H] in ``dtype``, positions [B]: first slot, block edges, mid, last
    slot, and two dead rows (L, L + 7)."""
    rng = np.random.RandomState(seed)
    pos = np.array([0, BLOCK - 1, BLOCK, L // 2 + 3, L - 1, L, L + 7])
    B = len(pos)
    q = jnp.asarray(rng.randn(B, 1, groups * K, H), jnp.float32)
    k = jnp.asarray(rng.randn(B, K, L, H), dtype)
    v = jnp.asarray(rng.randn(B, K, L, H), dtype)
    return q, k, v, jnp.asarray(pos, jnp.int32), pos < L


def _check_against_dense(fn, q, k, v, pos, live):
    got = np.asarray(jax.jit(fn)(q, k, v, pos))
    assert got.dtype == np.float32 and np.isfinite(got).all()  # dead rows: unspecified but finite
    if k.dtype == jnp.float32:
        ref, atol = attn.dense_decode_attention(q, k, v, pos), 1e-5
    else:  # exact attention of the stored values
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        ref = attn.dense_decode_attention(f32(q.astype(k.dtype)), f32(k), f32(v), pos)
        atol = 2.0**-5 * float(jnp.max(jnp.abs(f32(v))))
    np.testing.assert_allclose(got[live], np.asarray(ref)[live], rtol=0, atol=atol)


def _decode_attention(name, H, dtype):
    return attn.make_decode_attention(name, BLOCK, head_dim=H, cache_dtype=dtype, backend="gpu",
                                      interpret=INTERPRET)


# ----------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("H,dtype,want", [
    (64, "bfloat16", "pallas"), (128, "bfloat16", "pallas"), (16, "float16", "pallas"), (256, "bfloat16", "pallas"),
    (24, "bfloat16", "ragged"), (80, "bfloat16", "ragged"), (96, "bfloat16", "ragged"), (8, "bfloat16", "ragged"),
    (512, "bfloat16", "ragged"), (64, "float32", "ragged"), (128, "float32", "ragged"), (80, "float32", "ragged"),
])
def test_auto_choice_on_gpu(H, dtype, want):
    assert attn.resolve_impl("auto", head_dim=H, cache_dtype=dtype, block_size=256, backend="gpu") == want


def test_auto_choice_off_gpu_and_forced_choices():
    # on a TPU "auto" takes the TPU kernel (tests/sampling/test_tpu_attention.py); on a CPU the XLA loop
    assert attn.resolve_impl("auto", head_dim=64, cache_dtype="bfloat16", block_size=256, backend="cpu") == "ragged"
    assert attn.resolve_impl("auto", head_dim=64, cache_dtype="bfloat16", block_size=256, backend="tpu") == "pallas_tpu"
    assert attn.resolve_impl("auto", head_dim=64, cache_dtype="bfloat16", block_size=8, backend="gpu") == "ragged"
    for name in ("ragged", "dense"):  # any head size, dtype, backend
        assert attn.resolve_impl(name, head_dim=80, cache_dtype="float32", block_size=8, backend="cpu") == name
    # forced Pallas: allowed wherever the kernel runs (float32: IEEE dots, test_kernel_gets_one_dtype_...)
    assert attn.resolve_impl("pallas", head_dim=64, cache_dtype="float32", block_size=256, backend="gpu") == "pallas"
    for kw, match in [(dict(head_dim=80), "head_dim 80"), (dict(head_dim=8), "head_dim 8"),
                      (dict(backend="cpu"), "Triton"), (dict(cache_dtype="float64"), "cache dtype float64"),
                      (dict(block_size=40), "multiple of 16")]:
        args = dict(head_dim=64, cache_dtype="bfloat16", block_size=256, backend="gpu") | kw
        with pytest.raises(ValueError, match=f"attention='pallas' cannot be used: .*{match}"):
            attn.resolve_impl("pallas", **args)
    with pytest.raises(ValueError, match="attention must be one of"):
        attn.resolve_impl("flash", head_dim=64, cache_dtype="bfloat16", block_size=256)


def test_pallas_block_caps_the_tile_bytes():
    def block(H, dtype, block_size=256):
        return attn.make_decode_attention("pallas", block_size, head_dim=H, cache_dtype=dtype,
                                          backend="gpu").keywords["block_size"]

    assert block(64, "bfloat16") == block(128, "bfloat16") == 128  # the measured settings
    assert block(128, "float32") == block(256, "bfloat16") == 64
    assert block(256, "float32") == 32 and block(64, "bfloat16", 64) == 64


def test_sampler_resolves_once_with_the_model_head_size():
    cfg = presets.tiny_config("smollm2-135m", head_dim=24)
    assert decode.make_model_fns(cfg, block_size=16, cache_dtype="float32").name == "transformer[ragged]"
    with pytest.raises(ValueError, match="attention='pallas' cannot be used"):  # head size 24 (or not a GPU)
        decode.make_model_fns(cfg, attention="pallas", block_size=16)


# ----------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("H", HEAD_DIMS)
def test_auto_float32_matches_dense(H):
    """float32 caches: ``"auto"`` is ragged for every head size; 1 and 2 KV heads, 3 and 8 blocks of slots."""
    fn = _decode_attention("auto", H, "float32")
    assert fn.func is attn.ragged_decode_attention
    for seed, (K, L) in enumerate([(1, 48), (2, 128)]):
        _check_against_dense(fn, *_inputs(seed, K, L, H, jnp.float32))


@pytest.mark.parametrize("H", [h for h in HEAD_DIMS if h in attn.PALLAS_HEAD_DIMS])
def test_forced_pallas_float32_matches_dense(H):
    fn = _decode_attention("pallas", H, "float32")
    for seed, (K, L) in enumerate([(1, 48), (2, 128)]):
        _check_against_dense(fn, *_inputs(seed, K, L, H, jnp.float32))


@pytest.mark.parametrize("H", HEAD_DIMS)
def test_auto_bfloat16_cache_float32_queries(H):
    """bf16 caches with fp32 queries (q is cast inside): Pallas for power-of-two heads, ragged otherwise."""
    fn = _decode_attention("auto", H, "bfloat16")
    want = attn.pallas_decode_attention if H in attn.PALLAS_HEAD_DIMS else attn.ragged_decode_attention
    assert fn.func is want
    _check_against_dense(fn, *_inputs(7, 2, 128, H, jnp.bfloat16))


def _eqns(jaxpr, primitive):
    """The ``primitive`` equations of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub, primitive)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_gets_one_dtype_and_full_precision(dtype):
    """What the Triton lowering sees: q, k, v all in the cache dtype (a mixed dot does not lower), and dots at
    precision HIGHEST (lowered to IEEE fp32 for a float32 cache, not TF32; native for bf16)."""
    q, k, v, pos, _ = _inputs(0, 2, 64, 64, dtype)
    fn = functools.partial(attn.pallas_decode_attention, block_size=BLOCK, interpret=True)
    (call,) = _eqns(jax.make_jaxpr(fn)(q, k, v, pos).jaxpr, "pallas_call")
    assert [x.aval.dtype for x in call.invars[:3]] == [jnp.dtype(dtype)] * 3
    dots = list(_eqns(call.params["jaxpr"], "dot_general"))
    assert len(dots) == 2  # q k^T and p v
    for eqn in dots:
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def test_ragged_attention_matches_dense():
    q, k, v, pos, live = _inputs(0, 2, 64, 8, jnp.float32, groups=2)
    _check_against_dense(functools.partial(attn.ragged_decode_attention, block_size=BLOCK), q, k, v, pos, live)
    with pytest.raises(ValueError, match="multiple"):
        attn.ragged_decode_attention(q, k[:, :, :60], v[:, :, :60], pos, block_size=BLOCK)


def test_pallas_split_choices_match_dense():
    """The kernel wrapper (layout swap, per-row lengths) for several split counts."""
    q, k, v, pos, live = _inputs(1, 2, 96, 16, jnp.float32, groups=2)
    for splits in (None, 1, 3):  # 6 blocks of 16 slots: default (6 splits for 7 rows), one split, three splits
        assert attn._pallas_tiling(96, BLOCK, splits or 16) == (splits or 6, BLOCK)
        fn = functools.partial(attn.pallas_decode_attention, block_size=BLOCK, k_splits=splits, interpret=INTERPRET)
        _check_against_dense(fn, q, k, v, pos, live)
    assert attn._pallas_tiling(2304, 128, 16) == (9, 128)  # 18 blocks: 9 splits, not the power-of-two 2
    assert attn._pallas_tiling(2304, 128, 1) == (1, 128)


# ----------------------------------------------------------------------------------------------- on a mesh
@pytest.mark.devices(8)
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1), (1, 1, 8)])
def test_pallas_on_a_mesh_runs_per_shard_and_matches(mesh_shape):
    """On a mesh the Pallas kernel runs inside shard_map on each device's rows and KV heads (XLA cannot partition
    the custom call and would gather the whole cache onto every device) and gives the unsharded result. A
    (1, 1, 8) mesh cannot split 2 KV heads: they stay replicated, rows too (``tensor`` is not a row axis)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treejax.parallel.mesh import MeshConfig, make_mesh

    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    rng = np.random.RandomState(3)
    B, K, L, H = 8, 2, 64, 16
    q = jnp.asarray(rng.randn(B, 1, 2 * K, H), jnp.float32)
    k, v = (jnp.asarray(rng.randn(B, K, L, H), jnp.bfloat16) for _ in range(2))
    pos = jnp.asarray([0, 15, 16, 35, 63, 64, 70, 40], jnp.int32)
    live = np.asarray(pos) < L
    seen = []

    def kernel(q, k, v, p):
        seen.append((q.shape, k.shape, p.shape))
        return attn.pallas_decode_attention(q, k, v, p, block_size=BLOCK, interpret=INTERPRET)

    fn = attn.shard_decode_attention(kernel, mesh)
    rows = data * fsdp
    heads = tensor if K % tensor == 0 else 1
    cache_sh = NamedSharding(mesh, P(("data", "fsdp"), "tensor" if heads > 1 else None))
    got = jax.jit(fn)(q, jax.device_put(k, cache_sh), jax.device_put(v, cache_sh), pos)
    assert seen == [((B // rows, 1, 2 * K // heads, H), (B // rows, K // heads, L, H), (B // rows,))]
    ref = attn.pallas_decode_attention(q, k, v, pos, block_size=BLOCK, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got)[live], np.asarray(ref)[live])
    # what the sampler builds for a mesh
    made = attn.make_decode_attention("pallas", BLOCK, head_dim=H, cache_dtype="bfloat16", backend="gpu",
                                      interpret=INTERPRET, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(jax.jit(made)(q, k, v, pos))[live], np.asarray(ref)[live])
