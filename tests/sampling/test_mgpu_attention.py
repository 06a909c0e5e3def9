"""The Mosaic GPU decode-attention kernel (``treejax.sampling.mgpu_attention``, ``attention="pallas_mgpu"``) in Mosaic
GPU's interpret mode on CPU (``InterpretGPUParams``: TMA copies, wgmma, barriers and the KV pipeline simulated)
against the dense reference: per-row decode on ragged rows (position 0, block edges, a row ending mid-block, the
last slot, dead rows at positions >= L), GQA, head sizes 64 and 128, KV blocks of 64 and 128; the log-sum-exp
against a float64 computation; block skipping (NaN in every block past a row's length); the shared-prefix cascade
with the Mosaic GPU passes (a prefix pass of one and of two 64-row wgmma groups); how the implementation is chosen
and its ``ConfigError``s; and the lowering for the ``cuda`` platform (no GPU needed). The ``gpu``-marked tests run
the compiled bf16 kernel against the Triton kernel (``"pallas"``) and the dense path (``TREEJAX_TEST_DEVICE=gpu``).

Tolerances as in ``test_attention.py``: float32 caches 1e-5 absolute (summation order and the online-softmax
rescaling only; interpret mode runs the fp32 dots exactly); bfloat16 caches against fp32 attention of the stored
values (q rounded to bf16), ``2**-5 * max|v|``.

The interpreter runs every program and pipeline step in Python callbacks, so shapes are small: caches of 128-192
slots (2-3 KV blocks of 64), a few rows and KV heads.
"""

from __future__ import annotations

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
from treejax.sampling import mgpu_attention as mgpu
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
    assert np.isfinite(got).all()  # dead rows: 0
    if k.dtype == jnp.float32:
        ref, atol = attn.dense_decode_attention(q, k, v, pos), 1e-5
    else:
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        ref = attn.dense_decode_attention(f32(q.astype(k.dtype)), f32(k), f32(v), pos)
        atol = 2.0**-5 * float(jnp.max(jnp.abs(f32(v))))
    assert live.any() and not live.all()
    np.testing.assert_allclose(got[live], np.asarray(ref)[live], rtol=0, atol=atol)
    return got


# ----------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("K,G,H,L,block_size", [
    (2, 3, 64, 192, 64),   # GQA 3 per KV head, head 64, 3 blocks of 64
    (1, 6, 128, 128, 64),  # qwen2.5-1.5b's group of 6, head 128, 2 blocks of 64
    (1, 7, 64, 256, 256),  # qwen2.5-0.5b's group of 7, 2 blocks of 128 (block_size 256 -> the 128 block)
])
def test_kernel_matches_dense(K, G, H, L, block_size):
    """Rows at position 0, the last slot of block 0, the first of block 1, mid-block (a length ending inside a
    block), the last slot, and two dead rows (L, L + 5): each row's own live blocks only."""
    bk = mgpu.mgpu_block(L, block_size, H, jnp.float32)
    assert bk == min(block_size, 128)
    pos = [0, bk - 1, bk, bk + 37, L - 1, L, L + 5]
    fn = functools.partial(mgpu.mgpu_decode_attention, block_size=block_size, interpret=True)
    got = _check_against_dense(fn, *_inputs(K * G + H, pos, K, G, L, H, jnp.float32))
    np.testing.assert_array_equal(got[-2:], 0.0)  # dead rows load nothing: o = 0


def test_made_for_the_sampler_bfloat16_cache_float32_queries():
    """What ``make_decode_attention("pallas_mgpu", ...)`` builds (interpret mode, 64-slot blocks): a bf16 cache with
    fp32 queries (q cast to bf16 inside); the output keeps q's dtype."""
    fn = attn.make_decode_attention("pallas_mgpu", 64, head_dim=64, cache_dtype="bfloat16", backend="gpu",
                                    interpret=True)
    assert fn.func is mgpu.mgpu_decode_attention and fn.keywords == dict(block_size=64, interpret=True)
    _check_against_dense(fn, *_inputs(3, [0, 63, 64, 101, 127, 128], 2, 2, 128, 64, jnp.bfloat16))


def test_lse_matches_a_direct_computation():
    """``mgpu_attention_lse``: ``lse = log sum_{j < n} e^{q.k_j / sqrt(H)}`` (natural base, from the kernel's base-2
    statistics) and ``o = softmax . v`` (float64 reference) for lengths 1, 37 (mid-block), 64 (a block edge) and
    the whole cache; length 0: ``o = 0``, ``lse = -inf``; lengths past ``L`` are clipped to ``L``."""
    rng = np.random.default_rng(1)
    B, K, G, H, L = 6, 1, 3, 64, 128
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(B, K, G, H), (B, K, L, H), (B, K, L, H)])
    length = jnp.asarray([0, 1, 37, 64, 128, 140], jnp.int32)
    o, lse = jax.jit(functools.partial(mgpu.mgpu_attention_lse, block_k=64, interpret=True))(q, k, v, length)
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.shape == (B, K, G, H) and lse.shape == (B, K, G) and o.dtype == lse.dtype == np.float32
    assert np.all(np.isneginf(lse[0])) and np.all(o[0] == 0)
    assert_decode_lse_matches_reference(o, lse, q, k, v, [(1, 1), (2, 37), (3, 64), (4, 128), (5, 128)], atol=1e-5)


def test_skipped_blocks_are_never_read():
    """NaN in every KV block wholly past a row's length (all of a dead row's cache): outputs stay finite and equal
    the dense attention on the same cache with those blocks zeroed (a block that were loaded and computed, even
    masked, would give NaN: 0 * NaN); the dead row's output is 0."""
    B_pos, block, L = [0, 63, 64, 100, 191, 192], 64, 192
    q, k, v, pos, live = _inputs(4, B_pos, 1, 2, L, 64, jnp.float32)
    first_dead = np.asarray([min(-(-(p + 1) // block) * block, L) if p < L else 0 for p in B_pos])
    past = jnp.asarray(np.arange(L)[None, None, :, None] >= first_dead[:, None, None, None])
    poison = lambda x: jnp.where(past, jnp.nan, x)  # noqa: E731
    zero = lambda x: jnp.where(past, 0.0, x)  # noqa: E731
    assert np.isnan(np.asarray(poison(k))[-1]).all()
    got = np.asarray(mgpu.mgpu_decode_attention(q, poison(k), poison(v), pos, block_size=block, interpret=True))
    assert np.isfinite(got).all() and np.all(got[~live] == 0)
    want = np.asarray(attn.dense_decode_attention(q, zero(k), zero(v), pos))
    np.testing.assert_allclose(got[live], want[live], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- cascade
@pytest.mark.parametrize("W,G,H", [(4, 3, 64), (8, 9, 128)])
def test_mgpu_cascade_matches_reference_and_xla(W, G, H):
    """Both cascade passes through the Mosaic GPU kernel, against the float64 reference and the XLA cascade: a
    prompt's W G queries of a KV head in one program (12: one 64-row query tile; 72: a 128-row tile, two wgmma
    groups), prompts of lengths 0, 37 (mid-block) and the full 128 slots, rows permuted and sliced to a sub-batch,
    dead rows (suffix pass: length 0, nothing loaded)."""
    P, K, rows = 3, 1, 2 * W + 2
    assert mgpu.mgpu_block_q(W * G) == (64 if W * G <= 64 else 128)
    inputs, fields, live, j = _problem(5, P=P, W=W, K=K, G=G, H=H, Lp=128, Ls=64, n_P=[0, 37, 128], rows=rows)
    f = attn.make_cascade_attention("pallas_mgpu", 64, interpret=True)
    dyn = {name: x for name, x in fields.items() if name != "rows_per_prompt"}
    got = np.asarray(jax.jit(lambda i, d: f(*i, rows_per_prompt=W, **d))(inputs, dyn))
    assert got.shape == (rows, 1, K * G, H) and np.isfinite(got).all()
    assert live.sum() >= 5 and (~live).sum() >= 1
    np.testing.assert_allclose(got[live, 0], _reference(inputs, fields, j)[live], rtol=0, atol=1e-5)
    xla = attn.make_cascade_attention("xla", 64)
    want = np.asarray(jax.jit(lambda i, d: xla(*i, rows_per_prompt=W, **d))(inputs, dyn))
    np.testing.assert_allclose(got[live, 0], want[live, 0], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- selection
def test_auto_keeps_triton_while_it_exists_and_forced_choice_errors(monkeypatch):
    """``"auto"`` keeps the Triton kernel where this JAX has it (it decoded faster on an H200: 0.76-0.90x for the
    Mosaic GPU kernel in the bare kernel table), takes the Mosaic GPU kernel once Triton's is gone from JAX, and
    ``ragged`` where neither can run; forced, the Mosaic GPU kernel is taken where its constraints hold and is a
    one-line ``ConfigError`` naming the fix elsewhere."""
    ok = dict(head_dim=64, cache_dtype="bfloat16", block_size=256, backend="gpu")
    assert attn.triton_decode_available()  # jax 0.10 / 0.11 still ship it
    assert attn.resolve_impl("auto", **ok) == "pallas"
    with monkeypatch.context() as m:
        m.setattr(attn, "triton_decode_available", lambda: False)
        assert attn.resolve_impl("auto", **ok) == "pallas_mgpu"
        assert attn.resolve_impl("auto", **ok | dict(head_dim=128)) == "pallas_mgpu"
        assert attn.resolve_impl("auto", **ok | dict(head_dim=256)) == "ragged"  # neither kernel takes it
        assert attn.resolve_impl("auto", **ok | dict(block_size=32)) == "ragged"
        assert attn.resolve_impl("auto", **ok | dict(cache_dtype="float32")) == "ragged"
        with pytest.raises(ConfigError, match="no longer has the Triton decode kernel .*='pallas_mgpu' is its"):
            attn.resolve_impl("pallas", **ok)
    assert attn.resolve_impl("auto", **ok | dict(backend="cpu"), interpret=True) == "ragged"
    for kw in (dict(), dict(head_dim=128), dict(cache_dtype="float16"), dict(block_size=64)):
        assert attn.resolve_impl("pallas_mgpu", **ok | kw) == "pallas_mgpu"
    # off a GPU only in interpret mode, where float32 caches run too
    assert attn.resolve_impl("pallas_mgpu", **ok | dict(backend="cpu", cache_dtype="float32"),
                             interpret=True) == "pallas_mgpu"
    for kw, match in [(dict(head_dim=80), r"head_dim 80 is not one of \(64, 128\)"),
                      (dict(head_dim=256), r"head_dim 256 is not one of \(64, 128\)"),
                      (dict(head_dim=32), "head_dim 32"),
                      (dict(cache_dtype="float32"), "cache dtype float32 .* float32 runs in interpret mode only"),
                      (dict(block_size=96), "block_size 96 is not a multiple of 64"),
                      (dict(block_size=16), "block_size 16 is not a multiple of 64"),
                      (dict(backend="cpu"), "the Mosaic GPU decode kernel .* the backend is 'cpu'"),
                      (dict(backend="tpu"), "the Mosaic GPU decode kernel .* the backend is 'tpu'")]:
        with pytest.raises(ConfigError, match=f"attention='pallas_mgpu' cannot be used: {match}") as info:
            attn.resolve_impl("pallas_mgpu", **ok | kw)
        assert "\n" not in str(info.value) and "fix: attention='auto' or 'ragged'" in str(info.value)
    cfg = presets.tiny_config("smollm2-135m", head_dim=64)
    with pytest.raises(ConfigError, match="attention='pallas_mgpu' cannot be used"):  # a CPU, compiled
        decode.make_model_fns(cfg, attention="pallas_mgpu", block_size=128)


def test_cascade_and_config_choices():
    """The cascade takes the Mosaic GPU passes where the per-row attention is that kernel (single device);
    ``RunConfig.decode_attention`` takes ``"pallas_mgpu"``; the memory plan's shared-prefix rule treats it as a
    kernel with cascade passes."""
    assert "pallas_mgpu" in attn.ATTENTION_IMPLS and "pallas_mgpu" in attn.CASCADE_PASSES
    assert attn.resolve_cascade_impl("auto", "pallas_mgpu") == "pallas_mgpu"
    assert attn.resolve_cascade_impl("xla", "pallas_mgpu") == "xla"
    if jax.device_count() >= 2:
        mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        assert attn.resolve_cascade_impl("auto", "pallas_mgpu", mesh2) == "xla"
    f = attn.make_cascade_attention("pallas_mgpu", 256)
    assert f.keywords["impl"] == "pallas_mgpu"
    from treejax.rl.config import RunConfig

    assert RunConfig(decode_attention="pallas_mgpu").decode_attention == "pallas_mgpu"
    with pytest.raises(ConfigError, match="RunConfig.decode_attention='pallas_mgp' is not one of 'pallas_mgpu', "):
        RunConfig(decode_attention="pallas_mgp")


def test_blocks_and_kernel_input_errors():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert mgpu.mgpu_block(2304, 256, 128, bf16) == 128 and mgpu.mgpu_block(192, 256, 64, bf16) == 64
    assert mgpu.mgpu_block(256, 64, 64, bf16) == 64
    assert mgpu.mgpu_block(2304, 256, 128, bf16, block_q=128) == 64  # the 128 x 128 score tile: too many registers
    assert [mgpu.mgpu_block_q(n) for n in (1, 7, 64, 65, 112, 128, 500)] == [64, 64, 64, 128, 128, 128, 128]
    assert mgpu.smem_bytes(64, 128, 128, 2) <= mgpu.SMEM_BYTES and mgpu.smem_bytes(128, 64, 128, 2) <= mgpu.SMEM_BYTES
    with pytest.raises(ValueError, match="cache length 200 has no KV block"):
        mgpu.mgpu_block(200, 256, 64, bf16)
    q, k = jnp.zeros((2, 1, 3, 64)), jnp.zeros((2, 1, 128, 64))
    n = jnp.ones((2,), jnp.int32)
    lse = functools.partial(mgpu.mgpu_attention_lse, interpret=True)
    cases = [(lambda: lse(q, k, k, n, block_k=96), "block_k=96 must be one of"),
             (lambda: lse(q, k[:, :, :64], k[:, :, :64], n, block_k=128), "block_k=128 .* divide the cache length 64"),
             (lambda: lse(q, k, k, n, block_k=64, block_q=96), "block_q=96 must be 64 or 128"),
             (lambda: lse(q.astype(bf16), k, k, n, block_k=64), "must share a dtype"),
             (lambda: lse(q[..., :32], k[..., :32], k[..., :32], n, block_k=64), r"head_dim 32 is not one of"),
             (lambda: lse(q, k[:1], k[:1], n, block_k=64), "must share B, K and H"),
             (lambda: lse(q, k, k, n[:1], block_k=64), r"lengths \(1,\) must be \[B\]"),
             (lambda: mgpu.mgpu_attention_lse(q, k, k, n, block_k=64), "cache dtype float32 .* interpret mode only"),
             (lambda: mgpu.mgpu_decode_attention(jnp.zeros((2, 1, 3, 64)), jnp.zeros((2, 2, 128, 64), f32),
                                                 jnp.zeros((2, 2, 128, 64), f32), n, interpret=True),
              "3 query heads are not a multiple of 2 KV heads")]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


# ----------------------------------------------------------------------------------------------- cuda lowering
@pytest.mark.parametrize("G,H", [(7, 64), (6, 128)])
def test_lowers_for_cuda(G, H):
    """Without a GPU: the compiled (not interpreted) kernel goes through Pallas' Mosaic GPU lowering for the
    ``cuda`` platform (``jit(...).trace(...).lower(lowering_platforms=("cuda",))``: every primitive must have a
    Mosaic GPU lowering rule, layouts must agree, SMEM must fit), in bf16 at qwen2.5-0.5b's heads (14 query / 2 KV,
    64 wide) and qwen2.5-1.5b's (12 / 2, 128 wide): the per-row attention as the sampler builds it (``block_size``
    256 -> KV blocks of 128) is one ``mosaic_gpu`` custom call; the cascade with W = 16 rows per prompt (prefix pass:
    W G = 112 or 96 queries, a 128-row tile with 64-slot blocks) two. What this cannot check: the MLIR-to-PTX
    compile, ptxas and the run (the ``gpu`` tests)."""
    B, K, L = 4, 2, 512
    q = jax.ShapeDtypeStruct((B, 1, K * G, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, K, L, H), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = attn.make_decode_attention("pallas_mgpu", 256, head_dim=H, cache_dtype="bfloat16", backend="gpu")
    hlo = jax.jit(fn).trace(q, kv, kv, pos).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @mosaic_gpu") == 1
    P, W = 2, 16
    R = P * W
    ints = jax.ShapeDtypeStruct((R,), jnp.int32)
    suf = jax.ShapeDtypeStruct((R, K, 256, H), jnp.bfloat16)
    pre = jax.ShapeDtypeStruct((P, K, L, H), jnp.bfloat16)
    cascade = attn.make_cascade_attention("pallas_mgpu", 256)
    run = jax.jit(lambda q, ks, vs, pos, kp, vp, n, prompt, rank: cascade(
        q, ks, vs, pos, kp, vp, prefix_len_P=n, row_prompt_R=prompt, row_rank_R=rank, rows_per_prompt=W))
    args = (jax.ShapeDtypeStruct((R, 1, K * G, H), jnp.float32), suf, suf, ints, pre, pre,
            jax.ShapeDtypeStruct((P,), jnp.int32), ints, ints)
    hlo = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("custom_call @mosaic_gpu") == 2  # suffix and prefix passes


# ----------------------------------------------------------------------------------------------- interpret checks
def test_no_smem_races():
    """Interpret mode's happens-before race detector (``InterpretGPUParams(detect_races=True)``) finds no race
    between the query and KV TMA copies, the pipeline's buffer reuse (3 blocks through 2 buffers), the wgmma's and
    the output tiles' SMEM writes and TMA stores; values still equal the dense path (~3 s: not ``slow``)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    from treejax.models import tree_flash_mgpu

    params = type(tree_flash_mgpu.interpret_params())(detect_races=True)
    q, k, v, pos, live = _inputs(8, [0, 100, 191, 192], 1, 2, 192, 64, jnp.float32)
    fn = functools.partial(mgpu.mgpu_decode_attention, block_size=64, interpret=params)
    got = np.asarray(jax.block_until_ready(fn(q, k, v, pos)))
    assert not interpret_pallas_call.get_races().races_found
    np.testing.assert_allclose(got[live], np.asarray(attn.dense_decode_attention(q, k, v, pos))[live], rtol=0,
                               atol=1e-5)


# ----------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("G,H", [(7, 64), (6, 128)])
def test_compiled_bfloat16_matches_triton_and_dense(G, H):
    """Compiled on a Hopper GPU, bf16 cache, qwen2.5-0.5b's / 1.5b's heads (G over 2 KV heads), a 2304-slot cache
    (18 blocks of 128) with rows at the first slot, block edges, mid-block, the last slot and dead rows: against
    the dense path in fp32 on the stored values and against the Triton kernel (``"pallas"``), at
    ``2**-5 * max|v|`` (the Triton kernel's bf16 tolerance, ``test_attention.py``)."""
    L = 2304
    pos = [0, 127, 128, 1000, 1537, L - 1, L, L + 9] * 4
    q, k, v, pos, live = _inputs(11, pos, 2, G, L, H, jnp.bfloat16)
    made = functools.partial(attn.make_decode_attention, block_size=256, head_dim=H, cache_dtype="bfloat16")
    got = _check_against_dense(made("pallas_mgpu"), q, k, v, pos, live)
    triton = np.asarray(jax.jit(made("pallas"))(q, k, v, pos))
    atol = 2.0**-5 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    np.testing.assert_allclose(got[live], triton[live], rtol=0, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("G,H", [(7, 64), (6, 128)])
def test_compiled_cascade_bfloat16_matches_triton_and_reference(G, H):
    """The cascade with both passes compiled (bf16, W = 16: a prompt's W G = 112 / 96 queries in one 128-row
    program), prompts up to the full prefix capacity, against the float64 reference, the Triton cascade and the
    XLA one, at the Triton cascade's bf16 tolerance (``test_cascade_pallas.py``)."""
    inputs, fields, live, j = _problem(2, P=6, W=16, K=2, G=G, H=H, Lp=512, Ls=192, n_P=[0, 1, 100, 255, 400, 512],
                                       dtype=jnp.bfloat16, rows=80)
    dyn = {name: x for name, x in fields.items() if name != "rows_per_prompt"}

    def run(impl):
        f = attn.make_cascade_attention(impl, 64)
        return np.asarray(jax.jit(lambda i, d: f(*i, rows_per_prompt=16, **d))(inputs, dyn))

    got, triton, xla = run("pallas_mgpu"), run("pallas"), run("xla")
    assert np.all(np.isfinite(got))
    atol = 2.0**-5 * max(float(jnp.max(jnp.abs(inputs[i].astype(jnp.float32)))) for i in (2, 5))  # max |v|
    np.testing.assert_allclose(got[live, 0], _reference(inputs, fields, j)[live], rtol=0, atol=atol)
    np.testing.assert_allclose(got[live, 0], triton[live, 0], rtol=0, atol=2 * atol)
    np.testing.assert_allclose(got[live, 0], xla[live, 0], rtol=0, atol=2 * atol)


@pytest.mark.gpu
def test_model_step_with_mgpu_attention_on_gpu():
    """make_model_fns(attention="pallas_mgpu") on a GPU: the per-row decode attention and the cascade are the Mosaic
    GPU kernel; a decode step's logits (bf16 cache, qwen2.5-0.5b's tiny config at head 64) equal the Triton path's
    to bf16 rounding (2% of the largest logit, as test_cascade_pallas.py's model-step test)."""
    cfg = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250, head_dim=64)
    from treejax.models import transformer as T

    params = T.init_params(cfg, jax.random.key(0))
    fns = decode.make_model_fns(cfg, attention="pallas_mgpu", block_size=64, cache_dtype="bfloat16")
    ref = decode.make_model_fns(cfg, attention="pallas", block_size=64, cache_dtype="bfloat16")
    assert (fns.attention, fns.cascade_attention) == ("pallas_mgpu", "pallas_mgpu")
    rows, L = 8, 192
    caches = []
    for f in (fns, ref):
        c = f.init_cache(rows, L)
        caches.append(jax.tree.map(lambda x: 0.5 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), c))
    tok = jnp.arange(rows, dtype=jnp.int32) + 60
    pos = jnp.asarray([0, 5, 63, 64, 100, 150, 191, 192], jnp.int32)
    outs = [np.asarray(jax.jit(f.step)(params, tok, pos, c)[0]) for f, c in zip((fns, ref), caches)]
    finite = np.isfinite(outs[1])
    scale = float(np.abs(outs[1][finite]).max())
    live = np.asarray(pos) < L
    np.testing.assert_allclose(outs[0][live][finite[live]], outs[1][live][finite[live]], rtol=0, atol=2e-2 * scale)
