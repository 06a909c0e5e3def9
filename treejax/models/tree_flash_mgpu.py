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
divide the row length is shrunk to the largest multiple of 64 that does, and rows must be a multiple of 64
tokens. No warp specialisation yet (one warpgroup issues the TMA copies and computes; the pipeline overlaps the
next steps' copies with the current step's math).

Adapted from JAX's ``jax.experimental.pallas.ops.gpu.attention_mgpu`` (Apache-2.0; FlashAttention-3 style
forward and backward on Mosaic GPU: its SMEM tiling/swizzle, wgmma and accumulator usage, layouts of the row
statistics and the transposed ``dk, dv`` kernel), with its causal mask replaced by the tree mask, its dense key
loop replaced by a pipeline over the listed blocks, tile skipping, full tiles and the scale added.

Status: tested in Mosaic GPU's interpret mode on CPU (``InterpretGPUParams``: wgmma, TMA copies, barriers and
the pipelines simulated, with its race detector in a ``slow`` test) against the dense path, on jax 0.10.2 and
0.11.2, and lowered through Pallas' Mosaic GPU lowering for the ``cuda`` platform on a CPU (every primitive has a
lowering rule, layouts agree, SMEM fits; ``tests/models/test_tree_flash_mgpu.py``). On an NVIDIA H200 (jax 0.11.2)
it compiled and ran: its bf16 forward is within 2e-3 of the Triton kernel's, the packed update's first-step loss
and gradient norm with it equal the expanded update's (cuDNN) to 2e-7 / 4.5e-4, and fwd+bwd it takes 1.80 ms at
qwen2.5-0.5b's heads (Triton 1.70, cuDNN 1.99), 2.30 ms at qwen2.5-1.5b's (Triton 2.43, cuDNN 2.76) on a depth-4
tree, and 17.5 ms on TreePO's 14 x 512 row (Triton 21.8, cuDNN 14.5): ``experiments/results/mgpu/``, docs/
performance.md. The test file ran on the GPU until the call's time limit cut it after 6 passing tests; in file
order the last of them is the 0.5b-head case of the ``gpu``-marked comparison (values and gradients against the
dense path and Triton), so the 1.5b-head case is unchecked on the chip and ``auto`` keeps the Triton kernel until
it is.
Interpret mode runs a slightly different program from the GPU's in three places (:func:`_mma`, :class:`_Lay`):
no layout casts, register operands of a wgmma staged through SMEM (on jax 0.10 transposed ones too), and
accumulation by adding a fresh product instead of ``run_state`` on the accumulator; the GPU forms are the ones
attention_mgpu uses.
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
    warpgroup, as are the backward grids' blocks ``dq_blocks[0]`` and ``dkv_blocks[0]``); ``block_k``: key rows
    per forward tile; ``dq_blocks = (query block, key block)`` of the ``dq`` kernel, ``dkv_blocks = (key block,
    query block)`` of the ``dk, dv`` kernel (grid block first). All multiples of 64; where one does not divide the
    row, the largest multiple of 64 below it that does is used. ``max_concurrent_steps``: the pipelines' SMEM
    buffers (TMA copies in flight). ``full_tiles``: tiles proven all-visible run without a mask;
    ``skip_empty``: a listed tile whose mask is all false is skipped (a ``lax.cond`` on a full-tile reduction;
    off: it is computed, masked, with the same result)."""

    block_k: int = 64
    dq_blocks: tuple[int, int] = (64, 64)
    dkv_blocks: tuple[int, int] = (64, 64)
    max_concurrent_steps: int = 2
    full_tiles: bool = True
    skip_empty: bool = True
    block_q: int = 64

    def __post_init__(self):
        sizes = (self.block_q, self.block_k, *self.dq_blocks, *self.dkv_blocks)
        if any(b < MIN_TILE or b % MIN_TILE for b in sizes):
            raise ValueError(f"TreeFlashMgpuBlocks: tiles must be multiples of {MIN_TILE}, got {sizes}")
        if (self.block_q, self.dq_blocks[0], self.dkv_blocks[0]) != (64, 64, 64):
            raise ValueError("TreeFlashMgpuBlocks: the grid's blocks (block_q, dq_blocks[0], dkv_blocks[0]) must be 64 "
                             f"(one warpgroup's wgmma rows), got {self.block_q}, {self.dq_blocks}, {self.dkv_blocks}")
        if self.max_concurrent_steps < 1:
            raise ValueError("TreeFlashMgpuBlocks: max_concurrent_steps must be >= 1")

    @classmethod
    def parse(cls, text: str) -> "TreeFlashMgpuBlocks":
        """``"default"`` or comma-separated ``key=value`` options (the benchmark's ``--mgpu`` syntax): ``k=N``
        (:attr:`block_k`), ``dq=QxK``, ``dkv=KxQ``, ``stages=N`` (:attr:`max_concurrent_steps`), ``full=0|1``,
        ``skip=0|1``. E.g. ``k=128,dq=64x128,dkv=64x128,stages=3``."""
        kw: dict = {}
        for opt in [p.strip() for p in text.split(",")] if text.strip() != "default" else []:
            key, _, val = opt.partition("=")
            pair = val.split("x")
            if key in ("k", "stages") and val.isdigit():
                kw["block_k" if key == "k" else "max_concurrent_steps"] = int(val)
            elif key in ("full", "skip") and val in ("0", "1"):
                kw["full_tiles" if key == "full" else "skip_empty"] = val == "1"
            elif key in ("dq", "dkv") and len(pair) == 2 and all(x.isdigit() for x in pair):
                kw[f"{key}_blocks"] = (int(pair[0]), int(pair[1]))
            else:
                raise ValueError(f"Mosaic GPU tree tiles {text!r}: bad option {opt!r} (k=N, dq=QxK, dkv=KxQ, "
                                 "stages=N, full=0|1, skip=0|1, or 'default')")
        return cls(**kw)

    def __str__(self) -> str:
        """``mgpu `` and the :meth:`parse` options that differ from the defaults (``mgpu default``: none)."""
        pairs = (("dq", self.dq_blocks), ("dkv", self.dkv_blocks))
        opts = ([f"k={self.block_k}"] if self.block_k != 64 else []) + [
            f"{name}={b[0]}x{b[1]}" for name, b in pairs if b != (64, 64)] + (
            [f"stages={self.max_concurrent_steps}"] if self.max_concurrent_steps != 2 else []) + (
            [] if self.full_tiles else ["full=0"]) + ([] if self.skip_empty else ["skip=0"])
        return "mgpu " + (",".join(opts) or "default")

    def describe(self, L: int, H: int) -> str:
        """What runs on rows of ``L`` tokens: tiles after halving, buffers, variants."""
        k = _fit(self.block_k, L, "block_k")
        (dq_q, dq_k), (dkv_k, dkv_q) = ((_fit(x, L, "tile") for x in b) for b in (self.dq_blocks, self.dkv_blocks))
        return (f"Mosaic GPU: fwd q{self.block_q}/k{k}, dq q{dq_q}/k{dq_k}, dk,dv k{dkv_k}/q{dkv_q}, "
                f"{self.max_concurrent_steps} TMA buffers, " + ("full tiles unmasked" if self.full_tiles else
                                                               "every tile masked")
                + (", empty tiles skipped" if self.skip_empty else ""))


#: rows of at least this many tokens at 64-wide heads take 128-query tiles in the ``dk, dv`` kernel
#: (:func:`default_blocks`)
LONG_ROW = 65_536


def default_blocks(head_dim: int, row_length: int) -> TreeFlashMgpuBlocks:
    """The tiles the library uses when none are given: :class:`TreeFlashMgpuBlocks`' defaults, except on rows of
    at least :data:`LONG_ROW` tokens at 64-wide heads, where the ``dk, dv`` kernel takes 128-query tiles
    (``dkv_blocks=(64, 128)``). Measured on an NVIDIA H200 (jax 0.11.2, bf16, fwd+bwd of TreePO's 14 x 512 row,
    98,304 tokens, qwen2.5-0.5b's heads; two calls): 16.36 / 16.36 ms against the defaults' 17.49 / 17.07 (cuDNN on
    the expanded rows 14.51 / 14.30); 128-key tiles in the other kernels, 3 buffers, or warp-specialised kernels
    were slower there (``experiments/results/mgpu/session4/``). Elsewhere the defaults stay: that tile alone is
    unmeasured on the depth-4 rows, where 128-wide tiles in all three kernels were slower."""
    if head_dim == 64 and row_length >= LONG_ROW:
        return TreeFlashMgpuBlocks(dkv_blocks=(64, 128))
    return TreeFlashMgpuBlocks()


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
    """The tile used on rows of ``L``: the largest multiple of 64 up to ``min(block, L)`` that divides ``L``."""
    if L % MIN_TILE:
        raise ValueError(f"tree flash attention (Mosaic GPU): row length {L} is not a multiple of {MIN_TILE}; pad "
                         f"rows to a multiple of {MIN_TILE} (PackingConfig.granule)")
    b = min(block, L) // MIN_TILE * MIN_TILE
    while L % b:
        b -= MIN_TILE
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


def _check_compiled_dtype(dtype, interpret) -> None:
    if not interpret and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"tree flash attention (Mosaic GPU): compiled kernels take bfloat16 or float16 q, k, v, got "
                         f"{jnp.dtype(dtype).name} (fp32 runs in interpret mode only)")


def _fwd_tile(plgpu, q_smem, k_smem, v_smem, carry, mask, *, scale, dtype, on_device, shape):
    """The forward's online-softmax update by one key tile (``mask=None``: a full tile), base 2::

        s = q k^T scale,  m' = max(m, rowmax s),  l' = 2^(m - m') l + rowsum 2^(s - m'),  acc' = 2^(m - m') acc + 2^(s - m') v
    """
    acc, m_i, l_i = carry
    s = _mma(plgpu, None, q_smem, k_smem, on_device, shape, b_transposed=True) * scale
    if mask is not None:
        s = jnp.where(mask, s, _MASK)
    m_next = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_next)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
    l_next = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    acc = _mma(plgpu, acc, p.astype(dtype), v_smem, on_device, a_in_regs=True)
    return acc, m_next, l_next


def _forward(q, k, v, lo, hi, blocks: TreeFlashMgpuBlocks, interpret):
    plgpu = _plgpu()
    _check(q, k, v)
    B, L, Q, H = q.shape
    G = Q // k.shape[2]
    dtype = q.dtype
    _check_compiled_dtype(dtype, interpret)
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

            tile_fn = functools.partial(_fwd_tile, plgpu, q_smem, k_smem, v_smem, scale=scale, dtype=dtype,
                                        on_device=on_device, shape=(bq, bk))
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


def _dq(q, k, v, lo, hi, do, lse, delta, blocks: TreeFlashMgpuBlocks, interpret):
    """``dq [B, L, Q, H]`` (``q``'s dtype): per query block, a pipeline over its ``kv_list`` row::

        p = 2^(s log2 e - lse),  dp = do v^T,  dq = scale sum_j (p (dp - delta)) k_j
    """
    plgpu = _plgpu()
    B, L, Q, H = q.shape
    G = Q // k.shape[2]
    dtype = q.dtype
    bq, bk = (_fit(x, L, f"dq_blocks[{n}]") for n, x in enumerate(blocks.dq_blocks))
    if bq != 64:
        raise ValueError(f"tree flash attention (Mosaic GPU): dq_blocks[0] must be 64 (one warpgroup), got {bq}")
    sm_scale = 1.0 / math.sqrt(H)
    kv_list = block_tables(lo, hi, bq, bk, blocks.full_tiles).kv_list
    qkv_t = _smem_transforms(dtype, H)
    on_device = not interpret
    lay = _Lay(plgpu, on_device)

    def kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem,
               qlo_smem, lse_smem, delta_smem, bars):
        b, h, i = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        kvh = lax.div(h, jnp.array(G, h.dtype))
        q0 = i * bq
        rows = pl.ds(q0, bq)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, bars.at[1])
        plgpu.copy_gmem_to_smem(lo_ref.at[b, rows], qlo_smem, bars.at[2])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem, bars.at[3])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem, bars.at[4])
        for n in range(5):
            plgpu.barrier_wait(bars.at[n])
        q_lo = lay.load(qlo_smem, lay.row())
        lse = lay.load(lse_smem, lay.row())
        delta = lay.load(delta_smem, lay.row())
        count, n_full = kv_ref[b, i, 0], kv_ref[b, i, 1]
        block_of = lambda t: kv_ref[b, i, t + 2]  # noqa: E731

        def body(idx, k_smem, v_smem, klo_smem, khi_smem, dq):
            t = idx[0]
            start_k = block_of(t) * bk

            def mask_fn():
                k_lo, k_hi = lay.load(klo_smem, lay.col()), lay.load(khi_smem, lay.col())
                return _tile_mask(lay, q_lo, q0, k_lo, k_hi, start_k, (bq, bk), False)

            def tile_fn(dq, mask):
                s = _mma(plgpu, None, q_smem, k_smem, on_device, (bq, bk), b_transposed=True) * (sm_scale * _LOG2E)
                if mask is not None:
                    s = jnp.where(mask, s, _MASK)
                p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
                dp = _mma(plgpu, None, do_smem, v_smem, on_device, (bq, bk), b_transposed=True)
                ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0]))
                return _mma(plgpu, dq, ds.astype(dtype), k_smem, on_device, a_in_regs=True)

            return _listed_tile(plgpu, t, n_full, mask_fn, tile_fn, dq, blocks.skip_empty)

        kv_spec = plgpu.BlockSpec((bk, H), lambda t: (block_of(t), 0), transforms=qkv_t)
        pos_spec = plgpu.BlockSpec((bk,), lambda t: (block_of(t),))
        dq = plgpu.emit_pipeline(
            body, grid=(count,), in_specs=[kv_spec, kv_spec, pos_spec, pos_spec],
            max_concurrent_steps=blocks.max_concurrent_steps, init_carry=lay.full((bq, H), 0, lay.wgmma),
        )(k_ref.at[b, :, kvh, :], v_ref.at[b, :, kvh, :], lo_ref.at[b], hi_ref.at[b])
        q_smem[...] = (dq * sm_scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=[plgpu.SMEM((bq, H), dtype, transforms=qkv_t), plgpu.SMEM((bq, H), dtype, transforms=qkv_t),
                       plgpu.SMEM((bq,), jnp.int32), plgpu.SMEM((bq,), jnp.float32), plgpu.SMEM((bq,), jnp.float32),
                       plgpu.Barrier(num_barriers=5)],
        grid=(Q, L // bq, B),
        grid_names=("heads", "q_seq", "batch"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, lo, hi, kv_list, do, lse, delta)


def _dkdv_tile(plgpu, lay, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, carry, mask, *, sm_scale, dtype,
               on_device, shape):
    """One query tile's ``(dk, dv)`` update of a key block, transposed (``mask=None``: a full tile)::

        s^T = k q^T,  p^T = 2^(s^T log2 e - lse),  dv += p^T do,  dk += (p^T (v do^T - delta)) q   (scale: after)
    """
    dk, dv = carry
    st = _mma(plgpu, None, k_smem, q_smem, on_device, shape, b_transposed=True) * (sm_scale * _LOG2E)
    if mask is not None:
        st = jnp.where(mask, st, _MASK)
    lse = lay.load(lse_smem, lay.col())
    pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
    dv = _mma(plgpu, dv, pt.astype(dtype), do_smem, on_device, a_in_regs=True)
    dpt = _mma(plgpu, None, v_smem, do_smem, on_device, shape, b_transposed=True)
    delta = lay.load(delta_smem, lay.col())
    dst = pt * (dpt - lax.broadcast_in_dim(delta, st.shape, [1]))
    return _mma(plgpu, dk, dst.astype(dtype), q_smem, on_device, a_in_regs=True), dv


def _store_dk_dv(plgpu, out_smem, values_and_refs) -> None:
    """Writes ``(value, GMEM ref)`` pairs through one fp32 staging tile (SMEM: 32 KiB at head 128), in order."""
    for n, (x, ref) in enumerate(values_and_refs):
        if n:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous copy has read the tile
        out_smem[...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, ref)
    plgpu.wait_smem_to_gmem(0)


def _dkdv(q, k, v, lo, hi, do, lse, delta, blocks: TreeFlashMgpuBlocks, interpret):
    """``dk, dv [B, L, Q, H]`` (fp32, per query head): per key block, a pipeline over its ``q_list`` row, in the
    transposed form (attention_mgpu's)::

        s^T = k q^T,  p^T = 2^(s^T log2 e - lse),  dv += p^T do,  dp^T = v do^T,  dk += scale (p^T (dp^T - delta)) q
    """
    plgpu = _plgpu()
    B, L, Q, H = q.shape
    G = Q // k.shape[2]
    dtype = q.dtype
    bk, bq = (_fit(x, L, f"dkv_blocks[{n}]") for n, x in enumerate(blocks.dkv_blocks))
    if bk != 64:
        raise ValueError(f"tree flash attention (Mosaic GPU): dkv_blocks[0] must be 64 (one warpgroup), got {bk}")
    sm_scale = 1.0 / math.sqrt(H)
    q_list = block_tables(lo, hi, bq, bk, blocks.full_tiles).q_list
    qkv_t = _smem_transforms(dtype, H)
    out_t = _smem_transforms(jnp.float32, H)
    on_device = not interpret
    lay = _Lay(plgpu, on_device)

    def kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, qt_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
               v_smem, klo_smem, khi_smem, out_smem, bars):
        b, h, j = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("kv_seq")
        kvh = lax.div(h, jnp.array(G, h.dtype))
        k0 = j * bk
        cols = pl.ds(k0, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, cols, kvh], k_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[b, cols, kvh], v_smem, bars.at[1])
        plgpu.copy_gmem_to_smem(lo_ref.at[b, cols], klo_smem, bars.at[2])
        plgpu.copy_gmem_to_smem(hi_ref.at[b, cols], khi_smem, bars.at[3])
        for n in range(4):
            plgpu.barrier_wait(bars.at[n])
        k_lohi = (lay.load(klo_smem, lay.row()), lay.load(khi_smem, lay.row()))
        count, n_full = qt_ref[b, j, 0], qt_ref[b, j, 1]
        block_of = lambda t: qt_ref[b, j, t + 2]  # noqa: E731

        def body(idx, q_smem, do_smem, lse_smem, delta_smem, qlo_smem, carry):
            t = idx[0]
            start_q = block_of(t) * bq

            def mask_fn():
                return _tile_mask(lay, k_lohi, k0, lay.load(qlo_smem, lay.col()), None, start_q, (bk, bq), True)

            tile_fn = functools.partial(_dkdv_tile, plgpu, lay, k_smem, v_smem, q_smem, do_smem, lse_smem,
                                        delta_smem, sm_scale=sm_scale, dtype=dtype, on_device=on_device,
                                        shape=(bk, bq))
            return _listed_tile(plgpu, t, n_full, mask_fn, tile_fn, carry, blocks.skip_empty)

        row_spec = plgpu.BlockSpec((bq, H), lambda t: (block_of(t), 0), transforms=qkv_t)
        vec_spec = plgpu.BlockSpec((bq,), lambda t: (block_of(t),))
        zeros = lay.full((bk, H), 0, lay.wgmma)
        dk, dv = plgpu.emit_pipeline(
            body, grid=(count,), in_specs=[row_spec, row_spec, vec_spec, vec_spec, vec_spec],
            max_concurrent_steps=blocks.max_concurrent_steps, init_carry=(zeros, zeros),
        )(q_ref.at[b, :, h, :], do_ref.at[b, :, h, :], lse_ref.at[b, h], delta_ref.at[b, h], lo_ref.at[b])
        _store_dk_dv(plgpu, out_smem, ((dk * sm_scale, dk_ref.at[b, cols, h]), (dv, dv_ref.at[b, cols, h])))

    f32 = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return plgpu.kernel(
        kernel,
        out_type=[f32, f32],
        scratch_types=[plgpu.SMEM((bk, H), dtype, transforms=qkv_t), plgpu.SMEM((bk, H), dtype, transforms=qkv_t),
                       plgpu.SMEM((bk,), jnp.int32), plgpu.SMEM((bk,), jnp.int32),
                       plgpu.SMEM((bk, H), jnp.float32, transforms=out_t), plgpu.Barrier(num_barriers=4)],
        grid=(Q, L // bk, B),
        grid_names=("heads", "kv_seq", "batch"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, lo, hi, q_list, do, lse, delta)


def _interpret_arg(interpret):
    """``interpret`` as the kernels take it: ``True`` -> Mosaic GPU's interpret mode, ``False`` -> compiled."""
    if interpret is True:
        return interpret_params()
    return interpret or None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tree_flash_attention(q, k, v, node_lo, node_hi, blocks: TreeFlashMgpuBlocks = TreeFlashMgpuBlocks(),
                         interpret: bool = False):
    """Tree-masked attention (module docstring) by the Mosaic GPU kernels. ``q: [B, L, Q, H]``, ``k, v: [B, L,
    K, H]``, ``node_lo, node_hi: [B, L]`` int32; returns ``[B, L, Q, H]`` in ``q``'s dtype. ``L`` must be a
    multiple of 64, ``H`` a multiple of 64. ``interpret=True``: Mosaic GPU's interpret mode (CPU)."""
    return _forward(q, k, v, node_lo, node_hi, blocks, _interpret_arg(interpret))[0]


def _vjp_fwd(q, k, v, lo, hi, blocks, interpret):
    out, lse = _forward(q, k, v, lo, hi, blocks, _interpret_arg(interpret))
    return out, (q, k, v, lo, hi, out, lse)


def _vjp_bwd(blocks, interpret, res, do):
    q, k, v, lo, hi, out, lse = res
    B, L, Q, H = q.shape
    K = k.shape[2]
    interp = _interpret_arg(interpret)
    do = do.astype(q.dtype)
    delta = jnp.einsum("blqh,blqh->bql", out.astype(jnp.float32), do.astype(jnp.float32))
    dq = _dq(q, k, v, lo, hi, do, lse, delta, blocks, interp)
    dk, dv = _dkdv(q, k, v, lo, hi, do, lse, delta, blocks, interp)
    group_sum = lambda x: x.reshape(B, L, K, Q // K, H).sum(axis=3).astype(k.dtype)  # noqa: E731
    return dq, group_sum(dk), group_sum(dv), None, None


tree_flash_attention.defvjp(_vjp_fwd, _vjp_bwd)


def make_attention(node_lo_BxL, node_hi_BxL, blocks: TreeFlashMgpuBlocks | None = None, interpret: bool = False):
    """``attend(q, k, v)`` closure for :func:`treejax.models.tree_attention.make_tree_attention` (``blocks``
    default: :func:`default_blocks` of the call's head size and row length)."""
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)
    return lambda q, k, v: tree_flash_attention(
        q, k, v, lo, hi, blocks or default_blocks(q.shape[-1], q.shape[1]), interpret)
