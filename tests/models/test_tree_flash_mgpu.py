"""The Mosaic GPU tree attention kernels (:mod:`treejax.models.tree_flash_mgpu`) against the dense path.

On CPU they run in Mosaic GPU's interpret mode (``InterpretGPUParams``: wgmma, TMA copies, barriers and the
software pipeline simulated), fp32, ``atol=1e-5`` as the Triton kernel's tests (measured max ~3e-6 on the
gradients). Interpret mode cannot show that the kernels compile on the real lowering: the ``gpu``-marked test
does (bf16, compiled, against the dense path and the Triton kernel; ``TREEJAX_TEST_DEVICE=gpu``).
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import tree_attention, tree_flash, tree_flash_mgpu
from treejax.models import transformer as T
from treejax.rl import packing
from treejax.testing.references import assert_tree_attention_matches_dense


@functools.cache
def _rows(P, W, D, S, Lp, config):
    """``(lo, hi)`` of ``P`` synthetic trees (``experiments/bench_packed.py``'s; half the leaves stop inside their
    last segment) packed by ``config``."""
    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/experiments")
    from bench_packed import synthetic_tree

    prompts, lens, forest = synthetic_tree(P, W, D, S, Lp, 200, 0.5, seed=1)
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, S, config)
    return jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)


#: ``aligned``: one tree of 64-token segments (40-token prompt), nodes aligned to 64: one 384-token row whose
#: 64 x 64 tables list full, partial and empty tiles. ``packed``: four small trees (24-token segments, 5-token
#: prompts), unaligned, two rows of 256.
_ROWS = {"aligned": (1, 2, 2, 64, 40, packing.PackingConfig(granule=64, align=64, max_trees_per_row=1)),
         "packed": (4, 2, 2, 24, 5, packing.PackingConfig(row_length=256))}

_BLOCKS = {
    "default": tree_flash_mgpu.TreeFlashMgpuBlocks(),
    # 128-key tiles in all three kernels, every tile masked, no skipping, one buffer more
    "rect_masked": tree_flash_mgpu.TreeFlashMgpuBlocks(block_k=128, dq_blocks=(64, 128), dkv_blocks=(64, 128),
                                                       max_concurrent_steps=3, full_tiles=False, skip_empty=False),
}


def _tile_kinds(lo, hi, bq, bk):
    """``(full, partial, empty)`` listed tiles of the ``bq x bk`` tables (``empty``: listed, no visible pair)."""
    mask = np.asarray(tree_attention.tree_mask(lo, hi))
    B, L = lo.shape
    kv = np.asarray(tree_flash.block_tables(lo, hi, bq, bk, True).kv_list)
    some = mask.reshape(B, L // bq, bq, L // bk, bk).any(axis=(2, 4))
    full = partial = empty = 0
    for b in range(B):
        for i in range(L // bq):
            count, n_full = kv[b, i, :2]
            full += n_full
            hit = some[b, i, kv[b, i, 2 + n_full: 2 + count]]
            partial, empty = partial + hit.sum(), empty + (~hit).sum()
    return full, partial, empty


def _assert_matches_dense(lo, hi, blocks, key, q_heads=4, kv_heads=2, head_dim=64):
    B, L = lo.shape
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, L, q_heads, head_dim))
    k, v = (jax.random.normal(kk, (B, L, kv_heads, head_dim)) for kk in ks[1:3])
    cot = jax.random.normal(ks[3], q.shape)
    mgpu = lambda q, k, v: tree_flash_mgpu.tree_flash_attention(q, k, v, lo, hi, blocks, True)  # noqa: E731
    assert_tree_attention_matches_dense(mgpu, lo, hi, q, k, v, cot, atol=1e-5)


def test_test_rows_have_full_partial_and_empty_tiles():
    """The aligned row's 64 x 64 tables hold every kind of tile the kernels branch on: full (unmasked), partial
    (masked) and listed-but-empty (skipped)."""
    full, partial, empty = _tile_kinds(*_rows(*_ROWS["aligned"]), 64, 64)
    assert full > 0 and partial > 0 and empty > 0, (full, partial, empty)


@pytest.mark.parametrize("rows,blocks", [("aligned", "default"), ("packed", "rect_masked")])
def test_mgpu_kernels_match_dense_tree_attention(rows, blocks):
    """Forward and the three gradients of the Mosaic GPU kernels (interpret mode, fp32) equal the dense path:
    grouped-query heads (4 over 2), full tiles unmasked, partial tiles masked, empty tiles skipped (``aligned``,
    default tiles), and two rows of two unaligned trees each with 128-key tiles, every tile masked, 3 buffers
    (``packed``)."""
    lo, hi = _rows(*_ROWS[rows])
    if rows == "packed":  # two rows (batch index), 2 query heads over 1: the interpreter's time
        _assert_matches_dense(lo, hi, _BLOCKS[blocks], jax.random.key(1), q_heads=2, kv_heads=1)
    else:
        _assert_matches_dense(lo, hi, _BLOCKS[blocks], jax.random.key(1))


def test_mgpu_through_make_tree_attention():
    """``attention_impl="pallas_mgpu"`` is a valid ``PackingConfig`` choice, picks the Mosaic GPU kernel (interpret mode off a GPU) and equals the dense path; its tiles
    type is checked."""
    assert "pallas_mgpu" in tree_attention.TREE_ATTENTION_IMPLS
    assert packing.PackingConfig(attention_impl="pallas_mgpu").attention_impl == "pallas_mgpu"  # validated
    lo, hi = _rows(*_ROWS["packed"])
    lo, hi = lo[:1], hi[:1]
    on_gpu = jax.default_backend() == "gpu"  # compiled there: bf16 inputs (fp32 is interpret mode's only)
    dtype, atol = (jnp.bfloat16, 3e-2) if on_gpu else (jnp.float32, 1e-5)
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (1, lo.shape[1], 2, 64), dtype)
    k, v = (jax.random.normal(kk, (1, lo.shape[1], 1, 64), dtype) for kk in ks[1:])
    got = tree_attention.make_tree_attention(lo, hi, "pallas_mgpu")(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = tree_attention.make_tree_attention(lo, hi, "xla")(*f32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=atol)
    with pytest.raises(ValueError, match="TreeFlashMgpuBlocks"):
        tree_attention.make_tree_attention(lo, hi, "pallas_mgpu", tree_flash.TreeFlashBlocks())


def test_auto_picks_the_kernel_measured_faster_for_the_shape():
    """``auto`` on a GPU (``tree_attention.resolve_impl``): Mosaic GPU on Hopper for 16-bit inputs at 128-wide heads
    or rows of >= 65,536 tokens (where it ran faster than the Triton kernel on an H200), Triton otherwise; XLA off a
    GPU; the shape unknown -> Triton; forced names are kept."""
    r = functools.partial(tree_attention.resolve_impl, "auto", "gpu", capability=9.0)
    bf16 = jnp.bfloat16
    assert r(head_dim=128, row_length=16384, dtype=bf16) == "pallas_mgpu"  # qwen2.5-1.5b / 7b heads
    assert r(head_dim=64, row_length=16384, dtype=bf16) == "pallas"  # qwen2.5-0.5b heads on a depth-4 tree
    assert r(head_dim=64, row_length=98304, dtype=bf16) == "pallas_mgpu"  # TreePO's 14 x 512 row
    assert r(head_dim=64, row_length=65536, dtype=jnp.float16) == "pallas_mgpu"
    assert r(head_dim=64, row_length=65536 - 128, dtype=bf16) == "pallas"
    assert r(head_dim=128, row_length=16384, dtype=jnp.float32) == "pallas"  # wgmma takes 16-bit operands
    assert r(head_dim=96, row_length=98304, dtype=bf16) == "pallas"  # not a multiple of 64
    assert r(head_dim=256, row_length=98304, dtype=bf16) == "pallas"  # never measured
    assert r(head_dim=128, row_length=16384 + 32, dtype=bf16) == "pallas"  # rows must be multiples of 64
    assert r(head_dim=128, row_length=16384, dtype=bf16, capability=8.0) == "pallas"  # an A100: no wgmma / TMA
    assert r() == "pallas" and r(head_dim=128) == "pallas"  # the shape not given
    assert tree_attention.resolve_impl("auto", "cpu", head_dim=128, row_length=98304, dtype=bf16) == "xla"
    assert tree_attention.resolve_impl("auto", "tpu", head_dim=128, row_length=98304, dtype=bf16) == "xla"
    assert tree_attention.resolve_impl("pallas", "gpu", head_dim=128, row_length=98304, dtype=bf16) == "pallas"
    with pytest.raises(ValueError, match="tree attention_impl must be one of"):
        tree_attention.resolve_impl("mgpu", "gpu")


def test_auto_resolves_each_call_from_its_query(monkeypatch):
    """``make_tree_attention(..., "auto")`` on a (simulated) Hopper GPU picks the kernel from each call's query:
    128-wide bf16 heads -> the Mosaic GPU kernel, 64-wide -> the Triton one (both in interpret mode here); given
    tiles pick the kernel they are for; each result equals the dense path."""
    real = tree_attention.resolve_impl
    seen = []

    def on_hopper(impl, backend=None, **shape):
        seen.append(real(impl, "gpu", capability=9.0, **shape))
        return seen[-1]

    monkeypatch.setattr(tree_attention, "resolve_impl", on_hopper)
    lo, hi = _rows(*_ROWS["packed"])
    lo, hi = lo[:1], hi[:1]
    for head_dim, want_impl in ((128, "pallas_mgpu"), (64, "pallas")):
        ks = jax.random.split(jax.random.key(head_dim), 3)
        q = jax.random.normal(ks[0], (1, lo.shape[1], 2, head_dim), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (1, lo.shape[1], 1, head_dim), jnp.bfloat16) for kk in ks[1:])
        seen.clear()
        got = tree_attention.make_tree_attention(lo, hi, "auto")(q, k, v)
        assert seen[-1] == want_impl, seen
        want = tree_attention.make_tree_attention(lo, hi, "xla")(*(x.astype(jnp.float32) for x in (q, k, v)))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)
    built = []
    kernel_attention = tree_attention._kernel_attention
    monkeypatch.setattr(tree_attention, "_kernel_attention", lambda impl, *a: built.append(impl) or kernel_attention(
        impl, *a))
    for blocks, want_impl in ((tree_flash_mgpu.TreeFlashMgpuBlocks(), "pallas_mgpu"),
                              (tree_flash.TreeFlashBlocks(), "pallas")):
        tree_attention.make_tree_attention(lo, hi, "auto", blocks)
        assert built[-1] == want_impl  # built at once, for the tiles' kernel, whatever the query


def test_tiles_and_shapes_the_kernels_refuse():
    assert tree_flash_mgpu._fit(128, 192, "block_k") == 64 and tree_flash_mgpu._fit(128, 256, "block_k") == 128
    assert tree_flash_mgpu._fit(192, 384, "block_k") == 192 and tree_flash_mgpu._fit(256, 384, "block_k") == 192
    with pytest.raises(ValueError, match="multiple of 64"):
        tree_flash_mgpu._fit(64, 96, "block_k")
    with pytest.raises(ValueError, match="multiples of 64"):
        tree_flash_mgpu.TreeFlashMgpuBlocks(block_k=32)
    lo = jnp.zeros((1, 128), jnp.int32)
    q = jnp.zeros((1, 128, 2, 48))
    with pytest.raises(ValueError, match="head_dim 48"):
        tree_flash_mgpu.tree_flash_attention(q, q, q, lo, lo, tree_flash_mgpu.TreeFlashMgpuBlocks(), True)
    q = jnp.zeros((1, 128, 2, 64))
    with pytest.raises(ValueError, match="bfloat16 or float16"):  # compiled: wgmma on 16-bit operands only
        tree_flash_mgpu.tree_flash_attention(q, q, q, lo, lo, tree_flash_mgpu.TreeFlashMgpuBlocks(), False)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,q_heads", [(64, 14), (128, 12)])
def test_mgpu_kernels_on_gpu_match_dense_and_triton(head_dim, q_heads):
    """Compiled (bf16) on a Hopper GPU, at qwen2.5-0.5b's heads (14 over 2, 64 wide) and qwen2.5-1.5b's (12 over 2,
    128 wide), on two depth-4 trees (one per row): forward and gradients against the dense path in fp32 on the
    same bf16 inputs (the Triton kernel's bf16 tolerances), and against the Triton kernel."""
    from tests.models.test_tree_attention import bf16_tree_inputs

    lo, hi, q, k, v, cot = bf16_tree_inputs(q_heads, head_dim)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    dense = lambda q, k, v: T.attention(*f32(q, k, v), tree_attention.tree_mask(lo, hi))  # noqa: E731
    triton_blocks = tree_flash.default_blocks(head_dim)
    triton = lambda q, k, v: tree_flash.tree_flash_attention(q, k, v, lo, hi, triton_blocks)  # noqa: E731
    out_d, vjp_d = jax.vjp(dense, q, k, v)
    out_t, vjp_t = jax.vjp(triton, q, k, v)
    grads_t = vjp_t(cot)
    for blocks in (tree_flash_mgpu.TreeFlashMgpuBlocks(), tree_flash_mgpu.TreeFlashMgpuBlocks(
            block_k=128, dq_blocks=(64, 128), dkv_blocks=(64, 128))):  # 3 buffers do not fit at head 128
        mgpu = lambda q, k, v: tree_flash_mgpu.tree_flash_attention(q, k, v, lo, hi, blocks)  # noqa: E731
        out_m, vjp_m = jax.vjp(mgpu, q, k, v)
        out_m = np.asarray(out_m, np.float32)
        np.testing.assert_allclose(out_m, np.asarray(out_d), atol=3e-2, err_msg=str(blocks))
        np.testing.assert_allclose(out_m, np.asarray(out_t, np.float32), atol=3e-2, err_msg=str(blocks))
        for name, a, b, t in zip("qkv", vjp_m(cot), vjp_d(cot.astype(jnp.float32)), grads_t):
            a, b, t = (np.asarray(x, np.float32) for x in (a, b, t))
            assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), f"d{name} vs dense, {blocks}"
            assert np.linalg.norm(a - t) <= 2e-2 * np.linalg.norm(t), f"d{name} vs Triton, {blocks}"


def test_mgpu_tile_settings_parse_and_print():
    """``TreeFlashMgpuBlocks.parse`` (the benchmark's ``--mgpu`` syntax) and ``str`` round-trip."""
    parse = tree_flash_mgpu.TreeFlashMgpuBlocks.parse
    assert parse("default") == tree_flash_mgpu.TreeFlashMgpuBlocks() and str(parse("default")) == "mgpu default"
    text = "k=128,dq=64x128,dkv=64x128,stages=3,full=0,skip=0"
    assert parse(text) == tree_flash_mgpu.TreeFlashMgpuBlocks(128, (64, 128), (64, 128), 3, False, False)
    assert str(parse(text)) == "mgpu " + text
    for bad, msg in (("k=96", "multiples of 64"), ("q=128", "bad option"), ("dq=64", "bad option"),
                     ("dq=128x64", "must be 64")):
        with pytest.raises(ValueError, match=msg):
            parse(bad)


@pytest.mark.parametrize("head_dim,q_heads", [(64, 14), (128, 12)])
def test_mgpu_kernels_lower_for_cuda(head_dim, q_heads):
    """Without a GPU: forward and backward of the compiled (not interpreted) kernels go through Pallas' Mosaic GPU
    lowering for the ``cuda`` platform (``jit(...).trace(...).lower(lowering_platforms=("cuda",))``: every
    primitive must have a Mosaic GPU lowering rule, layouts must agree, SMEM must fit the H100/H200's 227 KiB),
    in bf16 at qwen2.5-0.5b's and qwen2.5-1.5b's heads: three ``mosaic_gpu`` custom calls (forward, ``dq``, ``dk,
    dv``). What this cannot check: the MLIR-to-PTX compile, ptxas, and the run (the ``gpu`` test). Tiles that do
    not fit SMEM are refused here with Mosaic GPU's message."""
    B, L, K = 2, 512, 2
    q = jax.ShapeDtypeStruct((B, L, q_heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, L, K, head_dim), jnp.bfloat16)
    lo = jax.ShapeDtypeStruct((B, L), jnp.int32)

    def lowered(blocks):
        def grads(q, k, v, lo, hi):
            attend = lambda q, k, v: tree_flash_mgpu.tree_flash_attention(q, k, v, lo, hi, blocks)  # noqa: E731
            out, vjp = jax.vjp(attend, q, k, v)
            return vjp(out)
        return jax.jit(grads).trace(q, kv, kv, lo, lo).lower(lowering_platforms=("cuda",)).as_text()

    for text in ("default", "k=128,dq=64x128,dkv=64x128", "full=0,skip=0"):
        hlo = lowered(tree_flash_mgpu.TreeFlashMgpuBlocks.parse(text))
        assert hlo.count("custom_call @mosaic_gpu") == 3, text
    if head_dim == 128:  # 3 buffers of 128 x 128 k and v tiles: over the SMEM
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            lowered(tree_flash_mgpu.TreeFlashMgpuBlocks.parse("k=128,dq=64x128,dkv=64x128,stages=3"))


@pytest.mark.slow
def test_mgpu_kernels_have_no_smem_races():
    """Interpret mode's happens-before race detector (``InterpretGPUParams(detect_races=True)``) finds no race
    between the TMA copies, the wgmma's and the SMEM reads and writes of the three kernels (the pipelines'
    buffer reuse, the output tiles staged in the input tiles' SMEM), values still equal to the dense path."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    params = tree_flash_mgpu.interpret_params()
    params = type(params)(detect_races=True)
    lo, hi = _rows(*_ROWS["aligned"])
    B, L = lo.shape
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (B, L, 2, 64))
    k, v = (jax.random.normal(kk, (B, L, 1, 64)) for kk in ks[1:3])
    blocks = _BLOCKS["default"]
    mgpu = lambda q, k, v: tree_flash_mgpu.tree_flash_attention(q, k, v, lo, hi, blocks, params)  # noqa: E731
    dense = lambda q, k, v: T.attention(q, k, v, tree_attention.tree_mask(lo, hi))  # noqa: E731
    out, vjp = jax.vjp(mgpu, q, k, v)
    grads = jax.block_until_ready(vjp(q))
    assert not interpret_pallas_call.get_races().races_found
    out_d, vjp_d = jax.vjp(dense, q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_d), atol=1e-5)
    for name, a, b in zip("qkv", grads, vjp_d(q)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"d{name}")


def test_default_tiles_by_shape_and_what_the_library_passes(monkeypatch):
    """``default_blocks``: 128-query ``dk, dv`` tiles on rows of >= 65,536 tokens at 64-wide heads (measured
    faster on TreePO's 14 x 512 row), the defaults elsewhere; ``make_tree_attention('pallas_mgpu')`` without
    tiles passes the call's default (the kernel is replaced by a recorder: no 65,536-token row in interpret mode)."""
    M = tree_flash_mgpu
    assert M.default_blocks(64, 98_304) == M.TreeFlashMgpuBlocks(dkv_blocks=(64, 128))
    assert M.default_blocks(64, M.LONG_ROW) == M.TreeFlashMgpuBlocks(dkv_blocks=(64, 128))
    for head_dim, L in ((64, M.LONG_ROW - 64), (128, 98_304), (128, 16_384)):
        assert M.default_blocks(head_dim, L) == M.TreeFlashMgpuBlocks()
    seen = []
    monkeypatch.setattr(M, "tree_flash_attention", lambda q, k, v, lo, hi, blocks, interpret: seen.append(blocks) or q)
    for L in (M.LONG_ROW, 1024):
        lo = jnp.zeros((1, L), jnp.int32)
        attend = tree_attention.make_tree_attention(lo, lo, "pallas_mgpu")
        x = jax.ShapeDtypeStruct((1, L, 2, 64), jnp.bfloat16)
        jax.eval_shape(attend, x, x, x)
    assert seen == [M.default_blocks(64, M.LONG_ROW), M.TreeFlashMgpuBlocks()]


def test_auto_logs_its_choice_once_per_shape(caplog):
    """``attention_impl='auto'`` logs the kernel and tiles it chose, once per process and shape."""
    tree_attention._log_choice.cache_clear()
    with caplog.at_level("INFO", logger="treejax.models.tree_attention"):
        for _ in range(2):
            tree_attention._log_choice("pallas_mgpu", 98_304, 64, "bfloat16")
    assert [r.getMessage() for r in caplog.records] == [
        "tree attention auto -> pallas_mgpu on 98304-token rows (head_dim 64, bfloat16): "
        + tree_flash_mgpu.default_blocks(64, 98_304).describe(98_304, 64)]
    assert "k64/q128" in caplog.records[0].getMessage()
