"""The TPU tree-attention kernel (``treejax.models.tree_splash``) in Pallas' TPU interpreter on CPU, against the dense
XLA path (``tree_attention.tree_mask`` + ``dense_attention.attention``): outputs and gradients (``dq, dk, dv``)
on a causal chain, a depth-3 branching tree and several trees packed in one row with padding, grouped-query
heads (4 query heads over 2 KV heads), head size 64 and an odd one (12); block skipping; input errors; the
wiring (``attention_impl="pallas_tpu"``; ``"auto"`` keeps XLA on a TPU until the kernel has run on one) end to
end through the packed update.

Tolerance (fp32): relative ``1e-5`` of the reference's largest magnitude, elementwise, on O(1) random inputs.
Both sides compute the same softmax in fp32; the kernel in tiles with an online max and the ``p v`` / ``ds k``
products accumulated tile by tile, the dense path in one pass, so they differ by float summation order only.

Interpreter mode is slow (every grid step runs through callbacks): the default tests use rows of 128 tokens and
32-token tiles (4 x 4 tiles a row); the larger cases are marked ``slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, tree_attention, tree_splash
from treejax.models import transformer as T
from treejax.rl import packing
from treejax.rl.pack_tree import PAD_NODE

BLOCKS = tree_splash.TreeSplashBlocks(32, 32)
RTOL = 1e-5


def _intervals(trees, L):
    """``(lo, hi)`` ``[L]`` of trees laid out in preorder one after another, padding to ``L``: a tree is
    ``(tokens, [children])``; a token's ``lo`` is its node's preorder number (numbered across the row, so trees
    are disjoint intervals, as ``packing`` does), ``hi`` the last number in the node's subtree; padding tokens
    ``lo = hi = PAD_NODE``."""
    lo, hi = [], []
    counter = [0]

    def visit(node):
        n, children = node
        me = counter[0]
        counter[0] += 1
        start = len(lo)
        lo.extend([me] * n)
        hi.extend([None] * n)
        for c in children:
            visit(c)
        for t in range(start, start + n):
            hi[t] = counter[0] - 1

    for tree in trees:
        visit(tree)
    assert len(lo) <= L, (len(lo), L)
    pad = L - len(lo)
    return np.array(lo + [PAD_NODE] * pad, np.int32), np.array(hi + [PAD_NODE] * pad, np.int32)


def _rows(*rows, L=128):
    lo, hi = zip(*(_intervals(r, L) for r in rows))
    return jnp.asarray(np.stack(lo)), jnp.asarray(np.stack(hi))


#: A single causal chain (one node), a depth-3 branching tree (odd node lengths, not aligned to the tiles), three
#: trees in one row with 11 padding tokens.
CHAIN = [(128, [])]
BRANCHING = [(21, [(17, [(9, []), (13, [])]), (11, [(7, []), (19, [(5, [])])]), (26, [])])]
PACKED = [(9, [(10, []), (6, [(5, [])])]), (30, [(12, []), (14, [])]), (13, [(8, []), (10, [])])]


def _inputs(B, L, Q, K, H, key, dtype=jnp.float32):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, L, Q, H), dtype)
    k, v = (jax.random.normal(kk, (B, L, K, H), dtype) for kk in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (B, L, Q, H), dtype)


def _dense(lo, hi):
    mask = tree_attention.tree_mask(lo, hi)
    return lambda q, k, v: T.attention(q, k, v, mask)


def _max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_matches_dense(lo, hi, blocks=BLOCKS, Q=4, K=2, H=64, seed=0):
    """Kernel (TPU interpreter, fp32) = dense path, output and ``dq, dk, dv``, to ``RTOL`` of the reference's largest
    magnitude, row by row; returns the measured relative errors ``{name: [per row]}``."""
    B, L = lo.shape
    q, k, v, cot = _inputs(B, L, Q, K, H, jax.random.key(seed))
    kernel = lambda q, k, v: tree_splash.tree_splash_attention(q, k, v, lo, hi, blocks, True)  # noqa: E731
    out_d, vjp_d = jax.vjp(_dense(lo, hi), q, k, v)
    out_k, vjp_k = jax.vjp(kernel, q, k, v)
    errors = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_k,) + tuple(vjp_k(cot)), (out_d,) + tuple(vjp_d(cot))):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        errors[name] = [_max_rel(a[r], b[r]) for r in range(B)]
    assert all(e <= RTOL for row in errors.values() for e in row), errors
    return errors


def test_kernel_matches_dense_tree_attention():
    """Values and gradients on the three tree shapes, one a row (a causal chain, the depth-3 tree, three trees
    with padding: per-row tables), 4 query heads over 2 KV heads, head size 64, 32-token tiles."""
    lo, hi = _rows(CHAIN, BRANCHING, PACKED)
    _assert_matches_dense(lo, hi)


def test_kernel_rectangular_tiles_odd_head_size_and_mqa():
    """Rectangular tiles (forward 16 x 32, backward 32 x 16), head size 12 (no multiple of 8: the block's last dim
    is the full head), one KV head for 4 query heads (the ``dk, dv`` kernel sums a group of 4)."""
    lo, hi = _rows(PACKED)
    blocks = tree_splash.TreeSplashBlocks(16, 32, 32, 16)
    _assert_matches_dense(lo, hi, blocks, Q=4, K=1, H=12, seed=1)


def test_rows_of_the_packing_layer():
    """The packing layer's own intervals (two small trees in one 32-token row, padding at the end)."""
    from treejax.testing.forests import two_small_trees

    forest, prompts, lens = two_small_trees()
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, 4,
                                packing.PackingConfig(row_length=32))
    assert plan.shape[0] == 1
    _assert_matches_dense(jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi), tree_splash.TreeSplashBlocks(8, 8))


def test_bf16_forward_within_its_rounding_bound():
    """bf16 inputs: the kernel's output against the dense path in fp32 on the same bf16 values. The kernel's
    softmax statistics and accumulators are fp32 like the reference's; it differs by two roundings to bf16 (unit
    roundoff u = 2^-9): ``p`` before the ``p v`` product (as any flash kernel on the MXU: ``|sum_j p_j e_j v_j| <=
    u max|v|``, the weights summing to 1) and the output (``<= u |out| <= u max|v|``). Hence ``atol = 2u max|v|``,
    the bound itself, not a fitted number."""
    lo, hi = _rows(BRANCHING, PACKED)
    q, k, v, _ = _inputs(2, 128, 4, 2, 64, jax.random.key(2), jnp.bfloat16)
    out = tree_splash.tree_splash_attention(q, k, v, lo, hi, BLOCKS, True)
    assert out.dtype == jnp.bfloat16
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _dense(lo, hi)(f32(q), f32(k), f32(v))
    bound = 2 * 2.0**-9 * float(jnp.max(jnp.abs(f32(v))))
    assert float(jnp.max(jnp.abs(f32(out) - want))) <= bound


@pytest.mark.slow  # the same kernels and paths as test_kernel_matches_dense_tree_attention, on longer rows
def test_kernel_matches_dense_on_longer_rows():
    tree = [(40, [(60, [(30, []), (50, [(25, [])])]), (45, [(33, []), (17, [])]), (100, [])])]
    lo, hi = _rows(tree, PACKED + PACKED + PACKED, L=512)
    _assert_matches_dense(lo, hi, tree_splash.TreeSplashBlocks(64, 64), Q=8, K=2, H=64)


#: A root of 32 tokens with two children: the first (32 tokens, key block 1) is invisible to the second's
#: query blocks 2 and 3 (its subtree ended before them).
SIBLINGS = [(32, [(32, []), (64, [])])]


def test_invisible_key_blocks_are_listed_as_skipped():
    """The tables (what the kernels' grids visit) list every tile with a visible pair and, on these rows, only
    those: the sibling row visits 8 of the 10 causal 32-token tiles (query blocks 2, 3 skip the first child's key
    block 1), the three packed trees 8 of 10 (tiles across trees skipped); with 16-token tiles the depth-3 tree
    visits 29 of 36. Full tiles (run without a mask) are all-visible."""
    lo, hi = _rows(SIBLINGS, BRANCHING, PACKED)
    visited = {}
    for blk in (32, 16):
        n = 128 // blk
        kv_list = np.asarray(tree_splash.block_tables(lo, hi, blk, blk, True).kv_list)
        tiles = np.asarray(tree_attention.tree_mask(lo, hi)).reshape(3, n, blk, n, blk)
        some, every = tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))
        for b in range(3):
            for i in range(n):
                count, n_full = kv_list[b, i, 0], kv_list[b, i, 1]
                listed = np.zeros(n, bool)
                listed[kv_list[b, i, 2: 2 + count]] = True
                assert (listed >= some[b, i]).all()  # every tile with a visible pair is visited
                assert every[b, i, kv_list[b, i, 2: 2 + n_full]].all()  # full tiles are all-visible
        visited[blk] = kv_list[:, :, 0].sum(axis=1).tolist()
        assert visited[blk] == some.sum(axis=(1, 2)).tolist()  # exactly the tiles with a visible pair
    kv_list = np.asarray(tree_splash.block_tables(lo, hi, 32, 32, True).kv_list)
    assert [sorted(kv_list[0, i, 2: 2 + kv_list[0, i, 0]]) for i in range(4)] == [[0], [0, 1], [0, 2], [0, 2, 3]]
    assert visited == {32: [8, 10, 8], 16: [28, 29, 22]}  # of 10 and 36 causal tiles


def test_kernel_never_reads_skipped_key_blocks():
    """NaN in the keys and values of key block 1 (the first child) and in the queries and output cotangents of
    query block 1: the second child's queries (blocks 2, 3) must get finite outputs and ``dq``, and the second
    child's keys (blocks 2, 3, seen only by query blocks 2, 3) finite ``dk, dv``, equal to the dense path's on
    inputs with those blocks zeroed: no kernel (forward, ``dq``, ``dk, dv``) touches a skipped tile."""
    lo, hi = _rows(SIBLINGS)
    q, k, v, cot = _inputs(1, 128, 4, 2, 64, jax.random.key(5))
    blk = slice(32, 64)
    poison = lambda x: x.at[:, blk].set(jnp.nan)  # noqa: E731
    zero = lambda x: x.at[:, blk].set(0.0)  # noqa: E731
    kernel = lambda q, k, v: tree_splash.tree_splash_attention(q, k, v, lo, hi, BLOCKS, True)  # noqa: E731
    out_k, vjp_k = jax.vjp(kernel, poison(q), poison(k), poison(v))
    out_d, vjp_d = jax.vjp(_dense(lo, hi), zero(q), zero(k), zero(v))
    grads_k, grads_d = vjp_k(poison(cot)), vjp_d(zero(cot))
    later = slice(64, 128)
    assert np.isnan(np.asarray(out_k[:, blk])).all()  # the poisoned block itself is NaN: the poison is real
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_k,) + tuple(grads_k), (out_d,) + tuple(grads_d)):
        a, b = np.asarray(a[:, later]), np.asarray(b[:, later])
        assert np.isfinite(a).all(), name
        assert _max_rel(a, b) <= RTOL, name


def test_bad_inputs_raise_one_line_value_errors():
    lo, hi = _rows(CHAIN)
    q, k, v, _ = _inputs(1, 128, 4, 2, 16, jax.random.key(0))
    run = lambda q, k, v, blocks=BLOCKS, lo=lo, hi=hi: tree_splash.tree_splash_attention(  # noqa: E731
        q, k, v, lo, hi, blocks, True)
    cases = [
        (lambda: run(q, k, v, tree_splash.TreeSplashBlocks(48, 32)), "block_q=48 must divide the row length 128"),
        (lambda: run(q, k, v, tree_splash.TreeSplashBlocks(32, 32, 12)), "block_q_bwd=12"),
        (lambda: run(q[:, :, :3], k, v), "3 query heads are not a multiple of 2 KV heads"),
        (lambda: run(q, k[:, :64], v[:, :64]), "must share B, L"),
        (lambda: run(q, k, v, lo=lo[:, :64], hi=hi[:, :64]), r"node_lo \(1, 64\)"),
        (lambda: run(q, k, v[..., :8]), "k and v of one shape"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
    # on a TPU tiles must be multiples of the 128 lanes; rows with no such divisor are refused with the fix
    with pytest.raises(ValueError, match="multiple of 128"):
        tree_splash._check(q, k, v, lo, hi, BLOCKS, interpret=False)
    with pytest.raises(ValueError, match=r"PackingConfig.granule = 128"):
        tree_splash.default_blocks(200)
    assert tree_splash.default_blocks(384) == tree_splash.TreeSplashBlocks(128, 128)
    assert tree_splash.default_blocks(512) == tree_splash.TreeSplashBlocks(256, 256)
    assert tree_splash.default_blocks(40, interpret=True) == tree_splash.TreeSplashBlocks(8, 8)


def test_the_tpu_kernel_is_asked_for_by_name():
    # not picked by ``auto`` on a TPU until it has run on TPU hardware (resolve_impl's docstring)
    assert tree_attention.resolve_impl("auto", "tpu") == "xla"
    assert tree_attention.resolve_impl("auto", "gpu") == "pallas"
    assert tree_attention.resolve_impl("auto", "cpu") == "xla"
    assert tree_attention.resolve_impl("pallas_tpu", "gpu") == "pallas_tpu"
    assert packing.PackingConfig(attention_impl="pallas_tpu").attention_impl == "pallas_tpu"
    lo, hi = _rows(CHAIN)
    with pytest.raises(ValueError, match="takes tree_splash.TreeSplashBlocks"):
        from treejax.models.tree_flash import TreeFlashBlocks

        tree_attention.make_tree_attention(lo, hi, "pallas_tpu", TreeFlashBlocks())


def test_memory_plan_counts_the_tpu_kernel_as_not_dense():
    """The memory plan's ``[L, L]`` scores term: not counted for the packed update on a TPU with ``pallas_tpu``;
    counted for ``xla`` (and ``auto``, which is XLA on a TPU), and for the TPU kernel off a TPU (the interpreter)."""
    from types import SimpleNamespace

    from treejax.memory_plan import dense_update_attention

    cfg = lambda impl: SimpleNamespace(packed_update=True, packing=SimpleNamespace(attention_impl=impl))  # noqa
    assert dense_update_attention(cfg("auto"), "tpu", {})
    assert not dense_update_attention(cfg("pallas_tpu"), "tpu", {})
    assert dense_update_attention(cfg("xla"), "tpu", {})
    assert dense_update_attention(cfg("pallas_tpu"), "gpu", {}) and dense_update_attention(cfg("auto"), "cpu", {})
    assert not dense_update_attention(cfg("auto"), "gpu", {}) and not dense_update_attention(cfg("pallas"), "gpu", {})


def test_packed_gradients_through_the_tpu_kernel():
    """``PackingConfig(attention_impl="pallas_tpu")`` end to end: the packed update's loss and gradients (the
    kernel's custom VJP in the layer scan, with remat) equal the expanded batch's (fp32, relative 1e-5; the
    kernel in the interpreter, 32-token rows in one 32-token tile)."""
    from treejax.rl.batch import expanded_batch, forest_to_batch
    from treejax.testing.forests import two_small_trees
    from treejax.rl.layouts import Expanded, Packed
    from treejax.rl.losses import LossConfig
    from treejax.rl.update import make_grad_fn

    cfg = presets.tiny_config("qwen2.5-0.5b")
    params = T.init_params(cfg, jax.random.key(3))
    forest, prompts, lens = two_small_trees()
    adv = jax.random.normal(jax.random.key(4), forest.tokens.shape) * forest.loss_mask
    expanded = expanded_batch(forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv))
    config = packing.PackingConfig(row_length=32, attention_impl="pallas_tpu")
    packed = packing.forest_to_packed(prompts, lens, forest, adv, config=config)
    loss_cfg = LossConfig(eps_high=0.28, entropy_coef=0.01)
    want = jax.jit(make_grad_fn(Expanded(cfg, attention_impl="xla"), loss_cfg))(params, expanded)
    got = jax.jit(make_grad_fn(Packed(cfg, config), loss_cfg, remat="full"))(params, packed)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-5 * np.linalg.norm(np.asarray(b)) + 1e-12


@pytest.mark.devices(8)
def test_tpu_kernel_runs_per_shard_under_a_mesh():
    """Under a context mesh the TPU kernel runs in ``jax.shard_map`` like the GPU one (rows over ``data``, heads
    over ``tensor``): same values and gradients as the dense path."""
    from treejax.parallel.mesh import MeshConfig, make_mesh

    lo, hi = _rows(BRANCHING, PACKED)
    q, k, v, cot = _inputs(2, 128, 4, 2, 16, jax.random.key(9))
    with jax.set_mesh(make_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])):
        attend = tree_attention.make_tree_attention(lo, hi, "pallas_tpu", BLOCKS)
        assert "_per_shard" in attend.__qualname__
        out_k, vjp_k = jax.vjp(jax.jit(attend), q, k, v)
        grads_k = vjp_k(cot)
    out_d, vjp_d = jax.vjp(_dense(lo, hi), q, k, v)
    assert _max_rel(out_k, out_d) <= RTOL
    for name, a, b in zip(("dq", "dk", "dv"), grads_k, vjp_d(cot)):
        assert _max_rel(a, b) <= RTOL, name


def test_kernels_lower_for_the_tpu_platform():
    """Forward and backward lower to Mosaic for the TPU platform (``jax.export``, no TPU needed): the real block
    specs (128-token tiles, the lane width), scalar-prefetched tables and in-kernel ops pass Pallas' TPU lowering
    (its block-shape and op checks; Mosaic's own compile runs only on a TPU). bf16 inputs, head size 64, 2 KV
    heads for 4 query heads."""
    from jax import export

    lo, hi = _rows(BRANCHING, L=256)
    q, k, v, cot = _inputs(1, 256, 4, 2, 64, jax.random.key(0), jnp.bfloat16)
    blocks = tree_splash.TreeSplashBlocks(128, 128)

    def loss(q, k, v):
        out = tree_splash.tree_splash_attention(q, k, v, lo, hi, blocks, False)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(q, k, v)
    text = exported.mlir_module()
    for name in ("tree_splash_forward", "tree_splash_backward_dq", "tree_splash_backward_dkv"):
        assert name in text, name
