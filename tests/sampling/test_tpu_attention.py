"""The TPU decode-attention kernel (``treejax.sampling.tpu_attention``, ``attention="pallas_tpu"``) in Pallas' TPU
interpreter on CPU (``interpret=True``: ``pltpu.InterpretParams``), against the dense reference: values for several
row / KV-head / group / head / cache sizes on ragged rows (position 0, block edges, the last slot, dead rows at
positions >= L), the log-sum-exp against a float64 computation, block skipping (the index map and NaN in skipped
blocks), the shared-prefix cascade with the TPU passes, how the implementation is chosen, and the lowering for the
TPU platform (``jax.export``; Mosaic's own compile needs a TPU, so the kernel has not been compiled or run on one).

Tolerances as in ``test_attention.py``: float32 caches 1e-5 absolute (summation order and the online-softmax
rescaling only); bfloat16 caches against fp32 attention of the stored values (q rounded to bf16),
``2**-5 * max|v|`` (q and the probabilities are rounded to bf16, each worth about ``u max|v|``, ``u = 2**-8``).

The interpreter runs every grid step through callbacks, so shapes are small: KV blocks of 8 or 16 slots (the
interpreter's multiple is 8; on a TPU 128), caches of 32-64 slots.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.sampling.test_cascade_pallas import _problem, _reference
from treejax.errors import ConfigError
from treejax.models import presets
from treejax.sampling import attention as attn
from treejax.sampling import decode
from treejax.sampling import tpu_attention as tpu
from treejax.testing.references import assert_decode_lse_matches_reference


def _inputs(seed, B_pos, K, G, L, H, dtype):
    """q [B, 1, K G, H] fp32, k/v [B, K, L, H] in ``dtype``, positions ``B_pos``; returns the live mask too."""
    rng = np.random.RandomState(seed)
    pos = np.asarray(B_pos, np.int32)
    B = len(pos)
    q = jnp.asarray(rng.randn(B, 1, K * G, H), jnp.float32)
    k, v = (jnp.asarray(rng.randn(B, K, L, H), dtype) for _ in range(2))
    return q, k, v, jnp.asarray(pos), pos < L


def _check_against_dense(fn, q, k, v, pos, live):
    got = np.asarray(jax.jit(fn)(q, k, v, pos))
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.isfinite(got).all()  # dead rows: unspecified but finite
    if k.dtype == jnp.float32:
        ref, atol = attn.dense_decode_attention(q, k, v, pos), 1e-5
    else:
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        ref = attn.dense_decode_attention(f32(q.astype(k.dtype)), f32(k), f32(v), pos)
        atol = 2.0**-5 * float(jnp.max(jnp.abs(f32(v))))
    assert live.any()
    np.testing.assert_allclose(got[live], np.asarray(ref)[live], rtol=0, atol=atol)


# ----------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("K,G,H,L,block", [
    (1, 1, 64, 32, 8),    # one query head per KV head (MHA layout), 4 blocks of 8
    (2, 3, 16, 48, 16),   # GQA 3 per KV head, head size 16 (the kernel itself takes any head size)
    (2, 4, 128, 32, 16),  # GQA 4, head size 128
    (1, 7, 64, 64, 16),   # qwen2.5-0.5b's group of 7, 4 blocks of 16
])
def test_kernel_matches_dense(K, G, H, L, block):
    """Rows at position 0, the last slot of block 0, the first of block 1, mid-cache, the last slot, and two dead
    rows (L, L + 5)."""
    pos = [0, block - 1, block, L // 2 + 3, L - 1, L, L + 5]
    fn = functools.partial(tpu.tpu_decode_attention, block_size=block, interpret=True)
    _check_against_dense(fn, *_inputs(K * G + H, pos, K, G, L, H, jnp.float32))


def test_made_for_the_sampler_bfloat16_cache_float32_queries():
    """What ``make_decode_attention("pallas_tpu", ...)`` builds (the interpreter, 16-slot blocks): a bf16 cache with
    fp32 queries (q cast to bf16 inside); the output keeps q's dtype."""
    fn = attn.make_decode_attention("pallas_tpu", 16, head_dim=64, cache_dtype="bfloat16", backend="tpu",
                                    interpret=True)
    assert fn.func is tpu.tpu_decode_attention and fn.keywords == dict(block_size=16, interpret=True)
    _check_against_dense(fn, *_inputs(3, [0, 15, 16, 33, 47, 48], 2, 2, 48, 64, jnp.bfloat16))


def test_lse_matches_a_direct_computation():
    """``tpu_attention_lse``: ``lse = log sum_{j < n} e^{q.k_j / sqrt(H)}`` and ``o = softmax . v`` (float64
    reference) for lengths 1, 9 (mid-block), 16 (a block edge) and the whole cache; length 0: ``o = 0``,
    ``lse = -inf``; lengths past ``L`` are clipped to ``L``."""
    rng = np.random.default_rng(1)
    B, K, G, H, L = 6, 2, 3, 16, 32
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(B, K, G, H), (B, K, L, H), (B, K, L, H)])
    length = jnp.asarray([0, 1, 9, 16, 32, 40], jnp.int32)
    o, lse = jax.jit(functools.partial(tpu.tpu_attention_lse, block_k=8, interpret=True))(q, k, v, length)
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == (B, K, G, H) and lse.shape == (B, K, G) and o.dtype == lse.dtype == np.float32
    assert np.all(np.isneginf(lse[0])) and np.all(o[0] == 0)
    assert_decode_lse_matches_reference(o, lse, q, k, v, [(1, 1), (2, 9), (3, 16), (4, 32), (5, 32)], atol=1e-5)


# ----------------------------------------------------------------------------------------------- block skipping
def test_block_index_stops_at_each_rows_last_live_block():
    """The KV index map's block at step ``t``: ``0, 1, .., last, last, ..`` with ``last = ceil(n / block) - 1``
    (block 0 for an empty row): the distinct blocks, the ones the pipeline copies, are exactly the live ones."""
    block, steps = 8, 6
    for n in range(0, block * steps + 1):
        idx = [int(tpu.kv_block_index(t, jnp.int32(n), block)) for t in range(steps)]
        live = max(-(-n // block), 1)
        assert idx == list(range(live)) + [live - 1] * (steps - live), (n, idx)


def test_skipped_blocks_are_never_read():
    """NaN in every KV block wholly past a row's length: outputs stay finite and equal the dense attention on the
    same cache with those blocks zeroed (a block that were read, even masked, would give NaN: 0 * NaN)."""
    B_pos, block, L = [0, 7, 8, 20, 31], 8, 32
    q, k, v, pos, live = _inputs(4, B_pos, 2, 2, L, 64, jnp.float32)
    first_dead = np.asarray([(-(-(p + 1) // block)) * block for p in B_pos])  # first slot of the first skipped block
    past = jnp.asarray(np.arange(L)[None, None, :, None] >= first_dead[:, None, None, None])
    poison = lambda x: jnp.where(past, jnp.nan, x)  # noqa: E731
    zero = lambda x: jnp.where(past, 0.0, x)  # noqa: E731
    assert np.isnan(np.asarray(poison(k))).any()
    got = tpu.tpu_decode_attention(q, poison(k), poison(v), pos, block_size=block, interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn.dense_decode_attention(q, zero(k), zero(v), pos)),
                               rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- cascade
def test_tpu_cascade_matches_reference_and_xla():
    """Both cascade passes through the TPU kernel (prefix: a prompt's W G = 12 queries of a KV head in one
    program): GQA 3 per KV head, prompts of lengths 0, 5 and the full 32 slots, rows permuted and sliced to a
    sub-batch, dead rows, against the float64 reference and the XLA cascade."""
    inputs, fields, live, j = _problem(5, P=3, W=4, K=2, G=3, H=16, Lp=32, Ls=16, n_P=[0, 5, 32], rows=10)
    f = attn.make_cascade_attention("pallas_tpu", 8, interpret=True)
    dyn = {name: x for name, x in fields.items() if name != "rows_per_prompt"}
    got = np.asarray(jax.jit(lambda i, d: f(*i, rows_per_prompt=4, **d))(inputs, dyn))
    assert got.shape == (10, 1, 6, 16) and np.isfinite(got).all()
    assert live.sum() >= 7 and (~live).sum() >= 1
    np.testing.assert_allclose(got[live, 0], _reference(inputs, fields, j)[live], rtol=0, atol=1e-5)
    xla = attn.make_cascade_attention("xla", 8)
    want = np.asarray(jax.jit(lambda i, d: xla(*i, rows_per_prompt=4, **d))(inputs, dyn))
    np.testing.assert_allclose(got[live, 0], want[live, 0], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("H,dtype,block_size,want", [
    (64, "bfloat16", 256, "pallas_tpu"), (128, "bfloat16", 256, "pallas_tpu"), (256, "bfloat16", 128, "pallas_tpu"),
    (80, "bfloat16", 256, "ragged"), (96, "bfloat16", 256, "ragged"), (32, "bfloat16", 256, "ragged"),
    (64, "float32", 256, "ragged"), (64, "float16", 256, "ragged"), (64, "bfloat16", 64, "ragged"),
])
def test_auto_choice_on_tpu(H, dtype, block_size, want):
    assert attn.resolve_impl("auto", head_dim=H, cache_dtype=dtype, block_size=block_size, backend="tpu") == want


def test_forced_choice_and_its_errors():
    ok = dict(head_dim=64, cache_dtype="bfloat16", block_size=256, backend="tpu")
    assert attn.resolve_impl("pallas_tpu", **ok) == "pallas_tpu"
    assert attn.resolve_impl("pallas_tpu", **ok | dict(cache_dtype="float32")) == "pallas_tpu"  # HIGHEST dots
    # off a TPU only in the interpreter, whose KV blocks may be multiples of 8
    assert attn.resolve_impl("pallas_tpu", **ok | dict(backend="cpu", block_size=16), interpret=True) == "pallas_tpu"
    assert attn.resolve_impl("auto", **ok | dict(backend="cpu"), interpret=True) == "ragged"
    for kw, match in [(dict(head_dim=80), "head_dim 80 is not a multiple of 64"),
                      (dict(cache_dtype="float16"), "cache dtype float16"),
                      (dict(block_size=64), "block_size 64 is not a multiple of 128"),
                      (dict(backend="cpu"), "the TPU decode kernel is a Pallas TPU .* the backend is 'cpu'"),
                      (dict(backend="gpu"), "the TPU decode kernel .* the backend is 'gpu'")]:
        with pytest.raises(ValueError, match=f"attention='pallas_tpu' cannot be used: {match}") as info:
            attn.resolve_impl("pallas_tpu", **ok | kw)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="multiple of 8"):
        attn.resolve_impl("pallas_tpu", **ok | dict(backend="cpu", block_size=12), interpret=True)
    cfg = presets.tiny_config("smollm2-135m", head_dim=64)
    with pytest.raises(ValueError, match="attention='pallas_tpu' cannot be used"):  # a CPU, compiled
        decode.make_model_fns(cfg, attention="pallas_tpu", block_size=128)


def test_kernel_input_errors():
    q, k = jnp.zeros((2, 2, 3, 16)), jnp.zeros((2, 2, 32, 16))
    lse = functools.partial(tpu.tpu_attention_lse, interpret=True)
    n = jnp.ones((2,), jnp.int32)
    cases = [(lambda: lse(q, k, k, n, block_k=12), "block_k=12 must divide the cache length 32 and be a multiple of 8"),
             (lambda: lse(q, k, k, n, block_k=8, interpret="mosaic"), "interpret='mosaic'"),
             (lambda: lse(q.astype(jnp.bfloat16), k, k, n, block_k=8), "must share a dtype"),
             (lambda: lse(q, k.astype(jnp.float16), k.astype(jnp.float16), n, block_k=8), "must share a dtype"),
             (lambda: lse(q.astype(jnp.float16), k.astype(jnp.float16), k.astype(jnp.float16), n, block_k=8),
              "cache dtype float16"),
             (lambda: lse(q, k[:1], k[:1], n, block_k=8), "must share B, K and H"),
             (lambda: lse(q, k, k, n[:1], block_k=8), r"lengths \(1,\) must be \[B\]"),
             (lambda: tpu.tpu_decode_attention(jnp.zeros((2, 1, 3, 16)), k, k, n, block_size=8, interpret=True),
              "3 query heads are not a multiple of 2 KV heads")]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert tpu.tpu_block(2304, 256) == 256 and tpu.tpu_block(384, 256) == 128 and tpu.tpu_block(48, 16, True) == 16
    assert tpu.tpu_block(40, 16, True) == 8
    with pytest.raises(ValueError, match="cache length 200 has no KV block"):
        tpu.tpu_block(200, 256)


def test_cascade_and_config_choices():
    """The cascade takes the TPU passes where the per-row attention is the TPU kernel (single device);
    ``RunConfig.decode_attention`` lists every implementation, closest first."""
    assert attn.resolve_cascade_impl("auto", "pallas_tpu") == "pallas_tpu"
    assert attn.resolve_cascade_impl("xla", "pallas_tpu") == "xla"
    assert attn.resolve_cascade_impl("auto", "pallas") == "pallas"
    if jax.device_count() >= 2:
        mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        assert attn.resolve_cascade_impl("auto", "pallas_tpu", mesh2) == "xla"
    with pytest.raises(ValueError, match=r"cascade impl must be one of \('xla', 'pallas', 'pallas_mgpu', "
                                         r"'pallas_tpu'\)"):
        attn.make_cascade_attention("tpu")
    from treejax.rl.config import RunConfig

    assert RunConfig().decode_attention == "auto"
    assert RunConfig(decode_attention="pallas_tpu").decode_attention == "pallas_tpu"
    with pytest.raises(ConfigError, match="RunConfig.decode_attention='pallas_tp' is not one of 'pallas_tpu', ") as e:
        RunConfig(decode_attention="pallas_tp")
    assert "fix: RunConfig.decode_attention = 'pallas_tpu'" in str(e.value)


# ----------------------------------------------------------------------------------------------- TPU lowering
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_the_tpu_platform(dtype):
    """The per-row attention (qwen2.5-0.5b's heads: 14 query / 2 KV, H = 64; 512 slots in blocks of 256) and the
    cascade (TPU passes; a 64-query prefix group) lower to Mosaic custom calls for the TPU platform
    (``jax.export``, no TPU needed: Pallas' TPU lowering checks block shapes, scalar prefetch and in-kernel ops;
    Mosaic's own compile runs only on a TPU). The dots are at ``Precision.HIGHEST`` for a float32 cache, Mosaic's
    default for bf16."""
    from jax import export

    B, K, G, H, L = 4, 2, 7, 64, 512
    q = jnp.zeros((B, 1, K * G, H), jnp.float32)
    k = jnp.zeros((B, K, L, H), dtype)
    pos = jnp.zeros((B,), jnp.int32)
    fn = attn.make_decode_attention("pallas_tpu", 256, head_dim=H, cache_dtype=dtype, backend="tpu")
    text = export.export(jax.jit(fn), platforms=["tpu"])(q, k, k, pos).mlir_module()
    assert "tpu_custom_call" in text and "treejax_tpu_decode_attention" in text
    P, W = 2, 4
    cascade = attn.make_cascade_attention("pallas_tpu", 256)
    R = P * W
    ints = jnp.zeros((R,), jnp.int32)
    args = (jnp.zeros((R, 1, K * G, H)), jnp.zeros((R, K, 256, H), dtype), jnp.zeros((R, K, 256, H), dtype), ints,
            jnp.zeros((P, K, L, H), dtype), jnp.zeros((P, K, L, H), dtype))
    run = jax.jit(lambda *a: cascade(*a, prefix_len_P=jnp.zeros((P,), jnp.int32), row_prompt_R=ints,
                                     row_rank_R=ints, rows_per_prompt=W))
    text = export.export(run, platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") >= 2  # suffix and prefix passes
    from tests.sampling.test_attention import _eqns

    (call,) = _eqns(jax.make_jaxpr(fn)(q, k, k, pos).jaxpr, "pallas_call")
    dots = list(_eqns(call.params["jaxpr"], "dot_general"))
    assert len(dots) == 2
    want = (jax.lax.Precision.HIGHEST,) * 2 if dtype == jnp.float32 else None
    assert all(eqn.params["precision"] == want for eqn in dots)


# ----------------------------------------------------------------------------------------------- on a mesh
@pytest.mark.devices(8)
def test_on_a_mesh_runs_per_shard_and_matches():
    """On a 2 x 2 x 2 mesh the TPU kernel runs inside ``shard_map`` on each device's rows and KV heads (XLA cannot
    partition the Mosaic custom call either) and gives the unsharded result bit for bit."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from treejax.parallel.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    q, k, v, pos, live = _inputs(6, [0, 15, 16, 31, 32, 40, 7, 20], 2, 2, 32, 64, jnp.bfloat16)
    made = functools.partial(attn.make_decode_attention, "pallas_tpu", 16, head_dim=64, cache_dtype="bfloat16",
                             backend="tpu", interpret=True)
    sharded = made(mesh=mesh)
    assert "shard_decode_attention" in sharded.__qualname__
    cache_sh = NamedSharding(mesh, P(("data", "fsdp"), "tensor"))
    got = jax.jit(sharded)(q, jax.device_put(k, cache_sh), jax.device_put(v, cache_sh), pos)
    want = jax.jit(made())(q, k, v, pos)
    np.testing.assert_array_equal(np.asarray(got)[live], np.asarray(want)[live])
