"""Tree attention over packed rows: the block-sparse Pallas kernel (interpreter mode on CPU) against the dense XLA
path, values and gradients, and ``forward_tree`` against the expanded rows' forward.

Tolerance: fp32 (``highest`` matmul precision on a GPU, tests/conftest.py), ``atol=1e-5`` on unit-scale values
(outputs and gradients of O(1) random inputs; measured max 1e-6): both compute the same softmax, the kernel in
tiles with an online max (base-2 exponentials), the dense path in one pass.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import forest_from_paths
from treejax.testing.forests import two_small_trees
from treejax.models import presets, tree_attention, tree_flash
from treejax.models import transformer as T
from treejax.rl import packing
from treejax.testing.references import assert_tree_attention_matches_dense

BLOCKS = tree_flash.TreeFlashBlocks(block_q=8, block_k=8, block_bwd=8)


def _two_trees(config=packing.PackingConfig(granule=8)):
    """Two small trees: a node that ends a leaf and has children, a leaf inside its first segment, prompts of
    5 and 3 tokens (the second row also has padding)."""
    forest, prompts, lens = two_small_trees()
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, 4, config)
    return plan, forest, prompts, lens


def _assert_kernel_matches_dense(lo, hi, blocks, key, head_dim=16):
    """The Pallas kernel (interpreter, fp32) equals the dense tree mask's attention on rows ``lo, hi``, values and
    gradients (1e-5): 4 query heads over 2 KV heads of ``head_dim`` (one that is not a power of two runs padded
    tiles with masked loads and stores)."""
    B, L = lo.shape
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, L, 4, head_dim))
    k, v = (jax.random.normal(kk, (B, L, 2, head_dim)) for kk in ks[1:3])
    cot = jax.random.normal(ks[3], q.shape)
    dense = lambda q, k, v: T.attention(q, k, v, tree_attention.tree_mask(lo, hi))  # noqa: E731
    flash = lambda q, k, v: tree_flash.tree_flash_attention(q, k, v, lo, hi, blocks, True)  # noqa: E731
    out_d, vjp_d = jax.vjp(dense, q, k, v)
    out_f, vjp_f = jax.vjp(flash, q, k, v)
    np.testing.assert_allclose(np.asarray(out_f), np.asarray(out_d), atol=1e-5)
    for name, a, b in zip("qkv", vjp_f(cot), vjp_d(cot)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("trees_per_row", [1, 2])
def test_pallas_kernel_matches_dense_tree_attention(trees_per_row):
    # row length 32 holds both trees (19 + 13 tokens) in one row when allowed
    plan, *_ = _two_trees(packing.PackingConfig(row_length=32, max_trees_per_row=trees_per_row))
    assert plan.shape[0] == 3 - trees_per_row
    lo, hi = jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)
    _assert_kernel_matches_dense(lo, hi, BLOCKS, jax.random.key(trees_per_row))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_forward_tree_equals_expanded_forward(impl):
    """Every packed token's hidden state is the one it has in each expanded row (prompt + leaf) through it."""
    cfg = presets.tiny_config("qwen2.5-0.5b")
    params = T.init_params(cfg, jax.random.key(0))
    plan, forest, prompts, lens = _two_trees(packing.PackingConfig(row_length=32))
    assert plan.shape[0] == 1
    # "pallas" runs the kernel in the Pallas interpreter off GPU (one tile per row at this size)
    hidden = T.forward_tree(params, cfg, jnp.asarray(plan.tokens), jnp.asarray(plan.positions),
                            jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi), attention_impl=impl)
    hidden = np.asarray(hidden)
    from treejax.rl.batch import forest_to_batch

    expanded = forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, jnp.zeros(forest.tokens.shape))
    want_all = np.asarray(T.forward(params, cfg, expanded["tokens"], expanded["positions"], expanded["segment_ids"]))
    length = np.asarray(forest.leaf_length)
    for r in range(plan.shape[0]):
        for s in range(plan.shape[2]):
            b = plan.leaf_id[r, s]
            if b < 0:
                continue
            p, w = divmod(int(b), forest.num_leaves)
            want = want_all[b, lens[p]: lens[p] + length[p, w]]
            got = hidden[r, plan.pair_index[r, s, : length[p, w]]]
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"row {r} leaf {b}")


def test_block_tables_cover_every_visible_tile_and_skip_the_rest():
    """The kernel's tile tables list every tile with a visible pair (a superset), and on a binary tree with
    node-aligned blocks exactly those: far fewer than the causal tiles."""
    W, D, S = 8, 3, 8
    paths = np.zeros((1, W, D + 1), np.int64)
    for w in range(W):  # binary tree: node ids by (depth, prefix)
        paths[0, w, 1:] = [(1 << d) - 1 + (w >> (D - d)) for d in range(1, D + 1)]
    tok = np.zeros((1, W, D * S), np.int64)
    for d in range(1, D + 1):
        tok[0, :, (d - 1) * S: d * S] = 3 + paths[0, :, d, None]
    forest = forest_from_paths(paths, np.full((1, W), D * S), S, tokens=tok)
    plan = packing.plan_packing(np.full((1, 8), 5), np.array([8]), forest.leaf_path, forest.leaf_length,
                                forest.tokens, S, packing.PackingConfig(granule=8))
    lo, hi = jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)
    blk = 8
    kv_list, _, q_end = (np.asarray(x) for x in tree_flash.block_tables(lo, hi, blk, blk))
    mask = np.asarray(tree_attention.tree_mask(lo, hi))[0]
    n = mask.shape[0] // blk
    exact = mask.reshape(n, blk, n, blk).any(axis=(1, 3))  # [q block, k block]
    listed = np.zeros_like(exact)
    for i in range(n):
        assert kv_list[0, i, 1] == 0  # no full tiles unless asked
        listed[i, kv_list[0, i, 2: 2 + kv_list[0, i, 0]]] = True
    np.testing.assert_array_equal(listed, exact)  # node-aligned blocks: the table is exact
    for j in range(n):
        viewers = np.nonzero(exact[:, j])[0]
        assert viewers.min() >= j and viewers.max() < q_end[0, j]
    assert exact.sum() < 0.6 * (n * (n + 1) // 2)


def test_packed_gradients_through_the_pallas_kernel():
    """The kernel's custom VJP inside the update's layer scan with remat: packed loss and gradients equal the
    expanded batch's (fp32, relative 1e-5; the kernel in the interpreter)."""
    from treejax.rl.batch import expanded_batch, forest_to_batch
    from treejax.rl.layouts import Expanded, Packed
    from treejax.rl.losses import LossConfig
    from treejax.rl.update import make_grad_fn

    cfg = presets.tiny_config("qwen2.5-0.5b")
    params = T.init_params(cfg, jax.random.key(3))
    _, forest, prompts, lens = _two_trees()
    adv = jax.random.normal(jax.random.key(4), forest.tokens.shape) * forest.loss_mask
    expanded = expanded_batch(forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv))
    packed = packing.forest_to_packed(prompts, lens, forest, adv, config=packing.PackingConfig(row_length=32))
    loss_cfg = LossConfig(eps_high=0.28, entropy_coef=0.01)
    want = jax.jit(make_grad_fn(Expanded(cfg, attention_impl="xla"), loss_cfg))(params, expanded)
    pallas = Packed(cfg, packing.PackingConfig(row_length=32, attention_impl="pallas"))
    got = jax.jit(make_grad_fn(pallas, loss_cfg, remat="full"))(params, packed)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-5 * np.linalg.norm(np.asarray(b)) + 1e-12


def bf16_tree_inputs(q_heads: int, head_dim: int):
    """The GPU kernel tests' inputs: two synthetic depth-4 trees packed one per row (``bench_packed``'s), and
    random bf16 ``q [B, L, q_heads, head_dim]``, ``k, v`` over 2 KV heads and a cotangent like ``q``. Returns
    ``(lo, hi, q, k, v, cot)``."""
    import sys

    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/experiments")
    from bench_packed import synthetic_tree

    prompts, lens, forest = synthetic_tree(2, 4, 3, 64, 40, 200, 0.5)
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, 64,
                                packing.PackingConfig(granule=128, max_trees_per_row=1))
    lo, hi = jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)
    B, L = lo.shape
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, L, q_heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, L, 2, head_dim), jnp.bfloat16) for kk in ks[1:3])
    return lo, hi, q, k, v, jax.random.normal(ks[3], q.shape, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["default", "128,64,64,full=1", "128,64,64,full=1,split=1,dq=128x32,dkv=64x32",
                                   "128,64,64,4,3,full=1"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pallas_kernel_on_gpu_matches_dense(head_dim, tiles):
    """The compiled Triton kernel (bf16 inputs, the update's tiles, and the kernel variants: mask-free full tiles,
    the split backward with rectangular tiles) against the dense path in fp32 on the same bf16 inputs: bf16
    tolerance (probabilities are cast to bf16 before the PV product, as in any flash kernel)."""
    lo, hi, q, k, v, cot = bf16_tree_inputs(8, head_dim)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    dense = lambda q, k, v: T.attention(*f32(q, k, v), tree_attention.tree_mask(lo, hi))  # noqa: E731
    blocks = tree_flash.default_blocks(head_dim) if tiles == "default" else tree_flash.TreeFlashBlocks.parse(tiles)
    flash = lambda q, k, v: tree_flash.tree_flash_attention(q, k, v, lo, hi, blocks)  # noqa: E731
    out_d, vjp_d = jax.vjp(dense, q, k, v)
    out_f, vjp_f = jax.vjp(flash, q, k, v)
    np.testing.assert_allclose(np.asarray(out_f, np.float32), np.asarray(out_d), atol=3e-2)
    for name, a, b in zip("qkv", vjp_f(cot), vjp_d(cot.astype(jnp.float32))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), f"d{name}"


@pytest.mark.devices(8)
@pytest.mark.parametrize("mesh_shape", [(1, 2, 1), (2, 1, 2), (1, 1, 8)])
def test_packed_gradients_through_the_pallas_kernel_on_a_mesh(mesh_shape):
    """Under the loop's context mesh the Pallas tree kernel runs per shard (``jax.shard_map``: rows over
    ``data x fsdp``, heads over ``tensor``; 8-way ``tensor`` does not divide 2 KV heads and leaves them whole):
    packed loss and gradients still equal the expanded batch's on one device."""
    from treejax.parallel.mesh import MeshConfig, make_mesh
    from treejax.rl.batch import expanded_batch, forest_to_batch
    from treejax.rl.layouts import Expanded, Packed
    from treejax.rl.losses import LossConfig
    from treejax.rl.update import make_grad_fn

    cfg = presets.tiny_config("qwen2.5-0.5b")
    params = T.init_params(cfg, jax.random.key(3))
    _, forest, prompts, lens = _two_trees()
    adv = jax.random.normal(jax.random.key(4), forest.tokens.shape) * forest.loss_mask
    expanded = expanded_batch(forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv))
    packed = packing.forest_to_packed(prompts, lens, forest, adv, row_multiple=2,
                                      config=packing.PackingConfig(row_length=32, max_trees_per_row=1))
    assert packed.num_rows == 2
    loss_cfg = LossConfig(eps_high=0.28, entropy_coef=0.01)
    want = jax.jit(make_grad_fn(Expanded(cfg, attention_impl="xla"), loss_cfg))(params, expanded)
    pallas = Packed(cfg, packing.PackingConfig(row_length=32, max_trees_per_row=1, attention_impl="pallas"))
    n = int(np.prod(mesh_shape))
    with jax.set_mesh(make_mesh(MeshConfig(*mesh_shape), jax.devices()[:n])):
        lo = jnp.asarray(packed.inputs.node_lo)
        assert "_per_shard" in tree_attention.make_tree_attention(lo, lo, "pallas").__qualname__
        got = jax.jit(make_grad_fn(pallas, loss_cfg, remat="full"))(params, packed)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-5 * np.linalg.norm(np.asarray(b)) + 1e-12


def test_tiles_that_do_not_divide_the_row_are_halved():
    """A row of 48 tokens with the default 128/64/64 tiles runs on 16-token tiles (the largest power of two that
    divides it) and equals the dense path, forward and backward; a row that is no multiple of 16 is refused with
    the fix named."""
    assert tree_flash._fit(128, 48, "block_q") == 16 and tree_flash._fit(64, 192, "block_k") == 64
    assert tree_flash._fit(128, 64, "block_q") == 64
    with pytest.raises(ValueError, match="multiple of 16"):
        tree_flash._fit(64, 40, "block_k")
    plan, *_ = _two_trees(packing.PackingConfig(row_length=48))
    lo, hi = jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)
    B, L = lo.shape
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (B, L, 4, 16))
    k, v = (jax.random.normal(kk, (B, L, 2, 16)) for kk in ks[1:3])
    blocks = tree_flash.TreeFlashBlocks()  # 128 / 64 / 64: all halved to 16 for this row
    flash = lambda q, k, v: tree_flash.tree_flash_attention(q, k, v, lo, hi, blocks, True)  # noqa: E731
    assert_tree_attention_matches_dense(flash, lo, hi, q, k, v, q, atol=1e-5)  # cotangent: q (as before)


def test_default_blocks_by_head_size_and_row_length():
    """The measured defaults (``tree_flash.default_blocks``): 64-wide tiles for small heads, the split backward for
    large ones, and 128-query, 3-stage forward tiles for small heads on rows of ``LONG_ROW`` tokens or more."""
    assert str(tree_flash.default_blocks(64)) == "64,64,64,full=1"
    assert tree_flash.default_blocks(64, tree_flash.LONG_ROW - 128) == tree_flash.default_blocks(64)
    assert str(tree_flash.default_blocks(64, tree_flash.LONG_ROW)) == "128,64,64,0,3,full=1"
    assert str(tree_flash.default_blocks(128)) == str(tree_flash.default_blocks(128, 98304)) == (
        "128,64,64,full=1,split=1")


def test_tile_settings_parse():
    assert str(tree_flash.TreeFlashBlocks.parse("128,64,64")) == "128,64,64"
    assert tree_flash.TreeFlashBlocks.parse("64,64,32,0,3") == tree_flash.TreeFlashBlocks(64, 64, 32, None, 3)
    assert str(tree_flash.TreeFlashBlocks(64, 64, 32, None, 3)) == "64,64,32,0,3"
    for bad, msg in (("48,64,64", "powers of two"), ("64,64", "expected block_q"), ("a,b,c", "expected block_q"),
                     ("128,64,64,full=2", "bad option"), ("128,64,64,dq=64", "bad option"),
                     ("128,64,64,split=1,dkv=64x24", "powers of two"), ("128,64,64,full=1,4", "expected block_q"),
                     ("128,64,64,dq=64x64", "split_bwd"), ("128,64,64,warps=4", "bad option")):
        with pytest.raises(ValueError, match=msg):
            tree_flash.TreeFlashBlocks.parse(bad)


def test_kernel_variant_options_parse_and_print():
    """The ``key=value`` options after the tiles (``full``, ``split``, ``dq``, ``dkv``, ``bwd_warps``) parse to the
    variant's fields and print back to the same string (the benchmarks' row labels)."""
    text = "128,64,64,0,3,full=1,split=1,dq=128x32,dkv=64x32,bwd_warps=8"
    blocks = tree_flash.TreeFlashBlocks.parse(text)
    assert blocks == tree_flash.TreeFlashBlocks(128, 64, 64, None, 3, full_tiles=True, split_bwd=True,
                                                dq_blocks=(128, 32), dkv_blocks=(64, 32), bwd_warps=8)
    assert str(blocks) == text
    assert tree_flash.TreeFlashBlocks.parse("128,64,64,full=1") == tree_flash.TreeFlashBlocks(full_tiles=True)
    assert str(tree_flash.TreeFlashBlocks.parse("64,64,32,split=1")) == "64,64,32,split=1"
    assert tree_flash.TreeFlashBlocks.parse("128,64,64,full=0,split=0,bwd_warps=0") == tree_flash.TreeFlashBlocks()


@functools.cache
def _synthetic_rows(P, W, D, S, Lp, config):
    """``(lo, hi)`` of ``P`` synthetic trees (``experiments/bench_packed.py``'s, half the leaves stopping inside
    their last segment: odd node lengths) packed by ``config`` (cached: the table and kernel tests share them)."""
    import sys

    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/experiments")
    from bench_packed import synthetic_tree

    prompts, lens, forest = synthetic_tree(P, W, D, S, Lp, 200, 0.5, seed=1)
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, S, config)
    return jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)


#: Layouts of the kernel-variant tests: six 3-token-prompt trees of 7-token segments, four to a row, unaligned;
#: two trees of 16-token segments, one to a row, nodes aligned to 8 tokens (the tests' tile).
_ROWS = {"small_trees": (6, 2, 2, 7, 3, packing.PackingConfig(row_length=128)),
         "aligned": (2, 4, 3, 16, 5, packing.PackingConfig(granule=16, align=8, max_trees_per_row=1))}


@pytest.mark.parametrize("rows", sorted(_ROWS) + ["two_trees"])
def test_block_tables_mark_only_all_visible_tiles_full(rows):
    """With ``full_tiles`` the tables mark a tile full only if every pair in it is visible (exact or conservative:
    the mask-free path must never see an invisible pair), still list every tile with a visible pair, list full
    tiles first and each group ascending, and ``q_list`` is ``kv_list`` transposed. Without it, nothing is full
    and the lists are the same sets, ascending."""
    if rows == "two_trees":
        plan, *_ = _two_trees(packing.PackingConfig(row_length=32, max_trees_per_row=2))
        lo, hi = jnp.asarray(plan.node_lo), jnp.asarray(plan.node_hi)
    else:
        lo, hi = _synthetic_rows(*_ROWS[rows])
    mask = np.asarray(tree_attention.tree_mask(lo, hi))
    B, L = lo.shape
    tables = jax.jit(tree_flash.block_tables, static_argnums=(2, 3, 4))  # one compile, not one per op
    n_full = 0
    for bq, bk in ((8, 8), (16, 8), (8, 16)):
        nq, nk = L // bq, L // bk
        tiles = mask.reshape(B, nq, bq, nk, bk)
        some, every = tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))  # [B, nq, nk]
        plain = tables(lo, hi, bq, bk, False)
        plain_kv = np.asarray(plain.kv_list)
        kv_list, q_list, q_end = (np.asarray(x) for x in tables(lo, hi, bq, bk, True))
        np.testing.assert_array_equal(q_end, np.asarray(plain.q_end))
        for b in range(B):
            listed, full = np.zeros((nq, nk), bool), np.zeros((nq, nk), bool)
            for i in range(nq):
                count, nf, blocks = kv_list[b, i, 0], kv_list[b, i, 1], kv_list[b, i, 2:]
                assert all(np.diff(blocks[:nf]) > 0) and all(np.diff(blocks[nf:count]) > 0)
                listed[i, blocks[:count]], full[i, blocks[:nf]] = True, True
                p_count, p_nf, p_blocks = plain_kv[b, i, 0], plain_kv[b, i, 1], plain_kv[b, i, 2:]
                assert p_count == count and p_nf == 0 and all(np.diff(p_blocks[:count]) > 0)
                assert sorted(p_blocks[:count]) == sorted(blocks[:count])
            assert not (full & ~every[b]).any(), f"{bq}x{bk}: a tile marked full has an invisible pair"
            assert not (some[b] & ~listed).any(), f"{bq}x{bk}: a tile with a visible pair is not listed"
            for j in range(nk):
                count, nf, blocks = q_list[b, j, 0], q_list[b, j, 1], q_list[b, j, 2:]
                assert sorted(blocks[:count]) == list(np.nonzero(listed[:, j])[0])
                assert sorted(blocks[:nf]) == list(np.nonzero(full[:, j])[0])
                assert all(np.diff(blocks[:nf]) > 0) and all(np.diff(blocks[nf:count]) > 0)
                assert count == 0 or blocks[:count].max() < q_end[b, j]
            n_full += full.sum()
    assert n_full > 0


_VARIANTS = {
    "full": tree_flash.TreeFlashBlocks(8, 8, 8, full_tiles=True),
    "split": tree_flash.TreeFlashBlocks(16, 8, 8, split_bwd=True, dq_blocks=(16, 8), dkv_blocks=(16, 8)),
    "full_split": tree_flash.TreeFlashBlocks(8, 16, 8, full_tiles=True, split_bwd=True, dq_blocks=(8, 16),
                                             dkv_blocks=(8, 16)),
}


@pytest.mark.parametrize("rows,variant", [
    ("small_trees", "full"), ("small_trees", "split"), ("small_trees", "full_split"), ("aligned", "full"),
    pytest.param("aligned", "split", marks=pytest.mark.slow),
    pytest.param("aligned", "full_split", marks=pytest.mark.slow)])
def test_kernel_variants_match_dense_tree_attention(rows, variant):
    """Every kernel variant (mask-free full tiles; the split backward with rectangular tiles; both) equals the dense
    path in fp32, values and gradients, at the kernel's tolerance: grouped-query heads (4 query heads over 2 KV
    heads), odd node lengths, several trees per row unaligned, and node-aligned rows."""
    lo, hi = _synthetic_rows(*_ROWS[rows])
    _assert_kernel_matches_dense(lo, hi, _VARIANTS[variant], jax.random.key(7))


@pytest.mark.parametrize("variant", ["full", "split"])
def test_kernel_with_padded_head_size_matches_dense(variant):
    """A head size that is not a power of two (12, padded to 16 columns): the masked loads and stores of the
    forward and of both backward forms equal the dense path."""
    lo, hi = _synthetic_rows(*_ROWS["small_trees"])
    _assert_kernel_matches_dense(lo, hi, _VARIANTS[variant], jax.random.key(8), head_dim=12)
