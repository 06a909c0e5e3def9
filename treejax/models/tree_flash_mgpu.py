"""Block-sparse flash attention for tree-packed rows as Pallas **Mosaic GPU** kernels (Hopper: wgmma, TMA).

The same function as :mod:`treejax.models.tree_flash` (the Triton kernel) and the dense path of
:mod:`treejax.models.tree_attention`::

    out_i = sum_j softmax_j(s_ij) v_j,   s_ij = q_i . k_j / sqrt(H)  where visible(i, j), else masked
    visible(i, j) = (j <= i) & (lo_j <= lo_i <= hi_j)

with the same inputs (``q [B, L, Q, H]``, ``k, v [B, L, K, H]``, ``node_lo, node_hi [B, L]`` int32; grouped-query
heads read KV head ``h // (Q / K)``), the same outputs, a ``custom_vjp`` with a forward kernel and two backward
kernels (``dq``; ``dk, dv``), and the same tile tables (:func:`treejax.models.tree_flash.block_tables`, reused:
rows ``[count, n_full, blocks...]``, full tiles first).

Structure (each kernel is one ``plgpu.kernel`` with a grid ``(Q heads, blocks, B)``, one warpgroup per block):

* forward, per query block of ``block_q`` (64) rows: ``q`` and the block's ``lo`` are copied GMEM -> SMEM by TMA;
  then a software pipeline (``plgpu.emit_pipeline``, ``max_concurrent_steps`` buffers, a *dynamic* grid of
  ``count`` steps) walks the query block's ``kv_list`` row: step ``t`` TMA-loads key block ``row[2 + t]`` of
  ``k``, ``v``, ``lo``, ``hi`` while earlier steps compute (the table entry is a scalar load from GMEM inside the
  pipeline's index map). Steps ``t < n_full`` are full tiles (no mask); the others build the exact tile mask
  from the ``lo``/``hi`` vectors and positions, and a tile without a visible pair is skipped (``lax.cond`` on
  the mask's maximum; :attr:`TreeFlashMgpuBlocks.skip_empty`). ``s = q k^T`` and ``o += p v`` are wgmma's into
  fp32 accumulators; the online softmax is the Triton kernel's (base 2, ``lse = m + log2 l``).
* ``dq``, per query block: ``q``, ``do``, ``lse``, ``delta`` in SMEM; a pipeline over the same ``kv_list`` row
  (the ``dq`` tiles' table): ``p = 2^(s log2 e - lse)``, ``dp = do v^T``, ``dq += (p (dp - delta)) k``.
* ``dk, dv``, per key block of ``block_k`` rows: ``k``, ``v`` and the block's ``lo``/``hi`` in SMEM; a pipeline
  over the key block's ``q_list`` row loading ``q``, ``do``, ``lse``, ``delta`` and the query block's ``lo``:
  ``s^T = k q^T``, ``dv += p^T do``, ``dp^T = v do^T``, ``dk += (p^T (dp^T - delta)) q``; ``dk, dv`` per query
  head in fp32, summed over each KV group in XLA (as the Triton kernel does).

Unlike the Triton kernel there is no padded head: ``head_dim`` must be a multiple of 64 (the swizzled SMEM tiles
and wgmma), and tiles are multiples of 64 (``block_q`` is 64: one warpgroup's wgmma rows); a tile that does not
divide the row length is halved down to 64, and rows must be a multiple of 64 tokens. No warp specialisation
yet (one warpgroup issues the TMA copies and computes; the pipeline overlaps the next steps' copies with the
current step's math).

Adapted from JAX's ``jax.experimental.pallas.ops.gpu.attention_mgpu`` (Apache-2.0; FlashAttention-3 style
forward and backward on Mosaic GPU: its SMEM tiling/swizzle, wgmma and accumulator usage, layouts of the row
statistics and the transposed ``dk, dv`` kernel), with its causal mask replaced by the tree mask, its dense key
loop replaced by a pipeline over the listed blocks, tile skipping, full tiles and the scale added.

Status: tested in Mosaic GPU's interpret mode on CPU (``InterpretGPUParams``: wgmma, TMA copies and barriers
simulated) against the dense path, on jax 0.10.2 and 0.11.2 (``tests/models/test_tree_flash_mgpu.py``); it
has **not** been compiled by the real Mosaic GPU lowering or run on a GPU yet (the ``gpu``-marked test and
``experiments/bench_tree_attention.py --impls`` do that).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from treejax.models.tree_flash import block_tables

_LOG2E = math.log2(math.e)
_LN2_INV = 1.4426950408889634  # 1 / ln 2: log2(x) = ln(x) / ln 2 (as attention_mgpu computes it)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
MIN_TILE = 64  #: the smallest tile (wgmma rows of one warpgroup; swizzled 64-row tiles)


@dataclasses.dataclass(frozen=True)
class TreeFlashMgpuBlocks:
    """Tiles and variants of the Mosaic GPU kernels. ``block_q``: query rows per forward block (64: one
    warpgroup); ``block_k``: key rows per forward tile; ``dq_blocks = (query block, key block)`` of the ``dq``
    kernel, ``dkv_blocks = (key block, query block)`` of the ``dk, dv`` kernel (grid block first). All multiples
    of 64, halved (down to 64) where they do not divide the row. ``max_concurrent_steps``: the pipelines' SMEM
    buffers (TMA copies in flight). ``full_tiles``: tiles proven all-visible run without a mask;
    ``skip_empty``: a listed tile whose mask is all false is skipped (a ``lax.cond`` on a full-tile reduction;
    off: it is computed, masked, with the same result)."""

    block_q: int = 64
    block_k: int = 64
    dq_blocks: tuple[int, int] = (64, 64)
    dkv_blocks: tuple[int, int] = (64, 64)
    max_concurrent_steps: int = 2
    full_tiles: bool = True
    skip_empty: bool = True

    def __post_init__(self):
        sizes = (self.block_q, self.block_k, *self.dq_blocks, *self.dkv_blocks)
        if any(b < MIN_TILE or b % MIN_TILE for b in sizes):
            raise ValueError(f"TreeFlashMgpuBlocks: tiles must be multiples of {MIN_TILE}, got {sizes}")
        if self.max_concurrent_steps < 1:
            raise ValueError("TreeFlashMgpuBlocks: max_concurrent_steps must be >= 1")

    def __str__(self) -> str:
        return (f"mgpu q{self.block_q}/k{self.block_k}, dq {self.dq_blocks[0]}x{self.dq_blocks[1]}, "
                f"dkv {self.dkv_blocks[0]}x{self.dkv_blocks[1]}, {self.max_concurrent_steps} stages"
                + (", full tiles unmasked" if self.full_tiles else "") + ("" if self.skip_empty else ", no skip"))


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def interpret_params():
    """Mosaic GPU's interpret mode (runs the kernels on the CPU; jax >= 0.10): ``plgpu.InterpretGPUParams``
    (exported from jax 0.11), else the class in ``jax._src`` (0.10)."""
    plgpu = _plgpu()
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def _fit(block: int, L: int, name: str) -> int:
    """The tile used on rows of ``L``: ``block`` halved while it does not divide ``L``, down to 64."""
    if L % MIN_TILE:
        raise ValueError(f"tree flash attention (Mosaic GPU): row length {L} is not a multiple of {MIN_TILE}; pad "
                         f"rows to a multiple of {MIN_TILE} (PackingConfig.granule)")
    b = min(block, L)
    while L % b or b % MIN_TILE:
        b //= 2
    if b < MIN_TILE:
        raise ValueError(f"tree flash attention (Mosaic GPU): no {name} tile fits row length {L}")
    return b


def _smem_transforms(dtype, head_dim: int):
    """Tiling + swizzle of ``[rows, head_dim]`` SMEM tiles (attention_mgpu's ``(8, 64)`` / 128-byte swizzle for
    16-bit types; 32-wide tiles for fp32)."""
    plgpu = _plgpu()
    item = jnp.dtype(dtype).itemsize
    swizzle = min(128, head_dim * item)
    return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))


def _check(q, k, v):
    B, L, Q, H = q.shape
    K = k.shape[2]
    if k.shape != (B, L, K, H) or v.shape != k.shape or Q % K:
        raise ValueError(f"tree flash attention (Mosaic GPU): q {q.shape}, k {k.shape}, v {v.shape} must share "
                         "[B, L, :, H] with Q % K == 0")
    if H % 64:
        raise ValueError(f"tree flash attention (Mosaic GPU): head_dim {H} must be a multiple of 64 (no padded "
                         "heads; use attention_impl='pallas' for this model)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"tree flash attention (Mosaic GPU): q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")


class _Lay:
    """Layout annotations of the kernels' register arrays: ``plgpu.layout_cast`` / ``plgpu.broadcasted_iota`` on
    a GPU; nothing in interpret mode, which keeps values in their logical layout (jax 0.11 treats
    ``layout_cast`` as a no-op there; jax 0.10's interpreter does not run it at all)."""

    def __init__(self, plgpu, on_device: bool):
        self.plgpu, self.on_device = plgpu, on_device

    def cast(self, x, layout):
        return self.plgpu.layout_cast(x, layout) if self.on_device else x

    @property
    def wgmma(self):
        return self.plgpu.Layout.WGMMA

    def row(self):  # one value per row of a wgmma tile
        return self.plgpu.Layout.WGMMA.reduce(1)

    def col(self):  # one value per column of a wgmma tile
        return self.plgpu.Layout.WGMMA.reduce(0)

    def iota(self, shape, dim):
        if self.on_device:
            return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.plgpu.Layout.WGMMA)
        return lax.broadcasted_iota(jnp.int32, shape, dim)

    def load(self, ref, layout):
        """A 1-D SMEM vector in a row/column layout: ``ref[...]`` followed at once by ``layout_cast``, which the
        lowering takes as the load's layout (as ``plgpu.load(ref, (), layout=...)`` does; the interpreter of
        jax 0.10 runs neither ``plgpu.load`` nor ``layout_cast``)."""
        return self.cast(ref[...], layout)

    def full(self, shape, value, layout):
        return self.cast(jnp.full(shape, value, jnp.float32), layout)


def _tile_mask(lay, rows_lo, rows_pos0, cols_lo, cols_hi, cols_pos0, shape, transposed: bool):
    """The exact tree mask of one tile in the wgmma layout. ``transposed=False``: rows are queries (``rows_lo``
    one per row), columns keys (``cols_lo``/``cols_hi`` one per column); ``transposed=True``: rows are keys
    (``rows_lo`` is then the keys' ``(lo, hi)`` pair), columns queries (``cols_lo``)."""
    row_pos = lay.iota(shape, 0) + rows_pos0
    col_pos = lay.iota(shape, 1) + cols_pos0
    if not transposed:
        q_lo = lax.broadcast_in_dim(rows_lo, shape, [0])
        k_lo, k_hi = lax.broadcast_in_dim(cols_lo, shape, [1]), lax.broadcast_in_dim(cols_hi, shape, [1])
        return (row_pos >= col_pos) & (k_lo <= q_lo) & (q_lo <= k_hi)
    k_lo, k_hi = (lax.broadcast_in_dim(x, shape, [0]) for x in rows_lo)
    q_lo = lax.broadcast_in_dim(cols_lo, shape, [1])
    return (col_pos >= row_pos) & (k_lo <= q_lo) & (q_lo <= k_hi)


#: jax 0.10's Mosaic GPU interpreter cannot read a transposed SMEM ref in a wgmma (0.11's can)
_INTERPRET_STAGES_TRANSPOSE = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)


def _mma(plgpu, acc, a, b, on_device: bool, shape=None, a_in_regs=False, b_transposed=False):
    """``acc + a @ b`` by wgmma (``acc=None``: ``a @ b`` into a fresh ``shape`` accumulator). ``a``: an SMEM ref,
    or (``a_in_regs``) a register array (``p``, ``ds``); ``b``: an SMEM ref, read transposed
    (``b.transpose((1, 0))``) with ``b_transposed``. On a GPU the accumulator stays in the wgmma accumulator
    (``pl.run_state`` of ``plgpu.ACC.init(acc)``) and ``a`` may come from registers, as in attention_mgpu.
    Mosaic GPU's interpret mode runs neither ``run_state`` nor a register ``a`` (jax 0.10, 0.11), so there ``a``
    is staged through SMEM and the product, taken into a fresh accumulator, is added (same values); jax 0.10's
    interpreter also gets ``b^T`` staged through SMEM."""
    if on_device:
        b = b.transpose((1, 0)) if b_transposed else b
        if acc is None:
            def fresh(acc_ref):
                plgpu.wgmma(acc_ref, a, b)
                return acc_ref[...]

            return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))

        def issue(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(issue)(plgpu.ACC.init(acc))
    shape = acc.shape if acc is not None else shape
    staged = []  # (value, SMEM type) of the operands staged through SMEM
    if a_in_regs:
        staged.append((a, plgpu.SMEM(a.shape, a.dtype)))
    stage_b = b_transposed and _INTERPRET_STAGES_TRANSPOSE
    if stage_b:
        bt = b[...].T
        staged.append((bt, plgpu.SMEM(bt.shape, bt.dtype)))
    elif b_transposed:
        b = b.transpose((1, 0))

    def product(*refs):
        *smem, acc_ref = refs
        ops = [a, b]
        for n, (ref, (value, _)) in enumerate(zip(smem, staged)):
            ref[...] = value
            ops[0 if (a_in_regs and n == 0) else 1] = ref
        if smem:
            plgpu.commit_smem()
        plgpu.wgmma(acc_ref, *ops)
        return acc_ref[...]

    def with_smem(*smem):
        return pl.run_scoped(lambda acc_ref: product(*smem, acc_ref), plgpu.ACC(shape, jnp.float32))

    out = pl.run_scoped(with_smem, *[t for _, t in staged]) if staged else with_smem()
    return out if acc is None else acc + out


def _any(mask):
    """Whether a wgmma-layout boolean tile has a true entry (a scalar)."""
    hit = jnp.where(mask, 1.0, 0.0).astype(jnp.float32)
    return jnp.max(jnp.max(hit, axis=1), axis=0) > 0.5


def _listed_tile(plgpu, t, n_full, mask_fn, tile_fn, carry, skip_empty: bool):
    """Step ``t`` of a pipeline over a table row: a full tile (``t < n_full``) runs ``tile_fn(carry, None)``,
    a partial one ``tile_fn(carry, mask)``, skipped when ``skip_empty`` and the mask is all false."""

    def partial(c):
        mask = mask_fn()
        if not skip_empty:
            return tile_fn(c, mask)
        return lax.cond(_any(mask), lambda c: tile_fn(c, mask), lambda c: c, c)

    return lax.cond(t < n_full, lambda c: tile_fn(c, None), partial, carry)


def _forward(q, k, v, lo, hi, blocks: TreeFlashMgpuBlocks, interpret):
    plgpu = _plgpu()
    _check(q, k, v)
    B, L, Q, H = q.shape
    G = Q // k.shape[2]
    dtype = q.dtype
    bq, bk = _fit(blocks.block_q, L, "block_q"), _fit(blocks.block_k, L, "block_k")
    if bq != 64:
        raise ValueError(f"tree flash attention (Mosaic GPU): block_q must be 64 (one warpgroup), got {bq}")
    scale = _LOG2E / math.sqrt(H)
    kv_list = block_tables(lo, hi, bq, bk, blocks.full_tiles).kv_list
    qkv_t = _smem_transforms(dtype, H)
    steps = blocks.max_concurrent_steps
    on_device = not interpret
    lay = _Lay(plgpu, on_device)

    def kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, out_ref, lse_ref, q_smem, qlo_smem, lse_smem, bars):
        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        kvh = lax.div(h, jnp.array(G, h.dtype))
        q0 = i * bq
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(lo_ref.at[b, pl.ds(q0, bq)], qlo_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        q_lo = lay.load(qlo_smem, lay.row())
        count, n_full = kv_ref[b, i, 0], kv_ref[b, i, 1]
        block_of = lambda t: kv_ref[b, i, t + 2]  # noqa: E731

        def body(idx, k_smem, v_smem, klo_smem, khi_smem, carry):
            t = idx[0]
            start_k = block_of(t) * bk

            def mask_fn():
                k_lo = lay.load(klo_smem, lay.col())
                k_hi = lay.load(khi_smem, lay.col())
                return _tile_mask(lay, q_lo, q0, k_lo, k_hi, start_k, (bq, bk), False)

            def tile_fn(c, mask):
                acc, m_i, l_i = c

                s = _mma(plgpu, None, q_smem, k_smem, on_device, (bq, bk), b_transposed=True) * scale
                if mask is not None:
                    s = jnp.where(mask, s, _MASK)
                m_next = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_next)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
                l_next = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = _mma(plgpu, acc, p.astype(dtype), v_smem, on_device, a_in_regs=True)
                return acc, m_next, l_next

            return _listed_tile(plgpu, t, n_full, mask_fn, tile_fn, carry, blocks.skip_empty)

        carry = (lay.full((bq, H), 0, lay.wgmma), lay.full((bq,), -jnp.inf, lay.row()), lay.full((bq,), 0, lay.row()))
        kv_spec = plgpu.BlockSpec((bk, H), lambda t: (block_of(t), 0), transforms=qkv_t)
        pos_spec = plgpu.BlockSpec((bk,), lambda t: (block_of(t),))
        acc, m_i, l_i = plgpu.emit_pipeline(
            body, grid=(count,), in_specs=[kv_spec, kv_spec, pos_spec, pos_spec], max_concurrent_steps=steps,
            init_carry=carry,
        )(k_ref.at[b, :, kvh, :], v_ref.at[b, :, kvh, :], lo_ref.at[b], hi_ref.at[b])
        # the diagonal tile is always listed and visible: l > 0
        q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
        lse_smem[...] = m_i + jnp.log(l_i) * _LN2_INV
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    out, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, Q, L), jnp.float32)],
        scratch_types=[plgpu.SMEM((bq, H), dtype, transforms=qkv_t), plgpu.SMEM((bq,), jnp.int32),
                       plgpu.SMEM((bq,), jnp.float32), plgpu.Barrier(num_barriers=2)],
        grid=(Q, L // bq, B),
        grid_names=("heads", "q_seq", "batch"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, lo, hi, kv_list)
    return out, lse
