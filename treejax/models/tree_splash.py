"""Block-sparse flash attention for tree-packed rows on TPU (Pallas / Mosaic; Pallas' interpreters elsewhere).

Same function as the dense path of :mod:`treejax.models.tree_attention` and the GPU kernel
:mod:`treejax.models.tree_flash`::

    out_i = sum_j softmax_j(s_ij) v_j,   s_ij = q_i . k_j / sqrt(H)  where visible(i, j), else masked
    visible(i, j) = (j <= i) & (lo_j <= lo_i <= hi_j)      (lo/hi: the token's node preorder interval)

The tree enters only as the two ``[B, L]`` interval vectors (``O(L)`` metadata); no ``[L, L]`` mask exists
anywhere: each tile's mask is computed in the kernel from the tile's slices of ``lo``/``hi`` and two iotas.

**Online softmax** (FlashAttention-2, Dao 2023, arXiv 2307.08691; the structure of JAX's splash attention):
queries in blocks of ``block_q``, keys in blocks of ``block_k``. For one query block the kernel keeps, in fp32
VMEM scratch, the running row max ``m``, the running row sum ``l`` and the unnormalised output ``acc``; each
visited key block updates them::

    s = q k^T / sqrt(H)  (masked entries -> -0.7 f32max),   m' = max(m, rowmax s),   p = exp(s - m') (masked -> 0)
    alpha = exp(m - m'),   l' = alpha l + rowsum p,   acc' = alpha acc + p v
    out = acc / l,   lse = m + log l       (after the last visited block; the diagonal tile is always visited,
                                            so l >= exp(s_ii - m) > 0)

**Block skipping**: the per-block interval summaries of :func:`treejax.models.tree_flash.block_tables` list, per
query block ``i``, the key blocks ``j`` that may hold a visible pair (``j <= i``, ``min lo_k <= max lo_q``,
``min lo_q <= max hi_k``; a superset of the exact tiles, exact when nodes are aligned to the tiles), the tiles
proven all-visible ("full") first. The tables are passed by *scalar prefetch* (SMEM). The grid's last axis walks
the list: step ``t`` of query block ``i`` reads key block ``kv_list[i, 2 + min(t, count - 1)]``; past ``count``
the block index repeats, so the pipeline issues no DMA for it, and the body is skipped (``pl.when``). Full tiles
run without the mask (no iota, compare or select). A key block no query of the block can see (a sibling subtree
that ended before the block, another tree of the row) is never read.

**Backward** (same paper, Algorithm 2), two kernels like splash attention's: ``delta_i = sum_h o_ih do_ih`` (XLA),
``p_ij = exp(s_ij - lse_i)`` recomputed from the saved ``lse``, ``ds_ij = p_ij (do_i . v_j - delta_i)``:

* ``dq``: grid over query blocks and their listed key blocks (``kv_list``): ``dq_i = sum_j ds_ij k_j / sqrt(H)``.
* ``dk, dv``: grid over key blocks, the query heads of the KV head's group, and the query blocks that may see the
  key block (``q_list``: ``kv_list`` transposed), in the transposed orientation (scores ``[block_k, block_q]``):
  ``dv_j = sum_i p_ij do_i``, ``dk_j = sum_i ds_ij q_i / sqrt(H)``, accumulated over the group's query heads in
  VMEM, so ``dk, dv`` are written once per KV head (no per-query-head copy to sum afterwards).

**Layout**: rows ``[B, L, heads, H]`` (the packed update's) are transposed to ``[B, heads, L, H]`` around the
kernels, so every block's last two dims are ``(rows, H)``: ``H`` the full dim (any head size), rows a multiple of
the tile (on a TPU a multiple of 128, the lane width, since ``block_k`` and, in the ``dk, dv`` kernel,
``block_q`` are lane dims of the score tiles). Grouped-query attention: query head ``h`` reads KV head
``h // (Q / K)``. Interval slices enter as columns ``[rows, 1]`` and rows ``[1, cols]``; softmax statistics are
fp32; ``p`` is cast to ``v``'s dtype before the ``p v`` product (bf16 on the MXU for bf16 inputs; exact for fp32).

Limits: the tables live in SMEM (``B * (L/block_q) * (L/block_k + 2)`` int32 for each of the forward's and the
backward's tables), so very long rows want larger tiles. The list axis of each grid has a static ``L / block``
steps (the causal worst case): steps past a list's count cost a grid step's overhead, with no copy or compute.
The kernel has been checked in Pallas' TPU interpreter
(``interpret=True``; tests/models/test_tree_splash.py) and lowered for the TPU platform through ``jax.export``
(Pallas' Mosaic lowering; Mosaic's own compile runs only on a TPU); it has not been run or benchmarked on TPU
hardware, and the default tiles (:func:`default_blocks`) are not tuned.

Structure adapted from JAX's ``jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py``
(Apache-2.0; the JAX Authors): the forward's scratch-resident online softmax over a grid axis of listed key
blocks, the data-dependent key/value index maps over a prefetched block list, and the split ``dq`` / ``dk, dv``
backward. The mask function, block tables, GQA accumulation over a group in the ``dk, dv`` kernel and the layout
are treejax's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from treejax.models.tree_flash import block_tables

NUM_LANES = 128  #: a TPU vreg's lanes: on a TPU both tiles must be multiples of it
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: finite, so exp(_MASK - m) = 0 without inf - inf
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class TreeSplashBlocks:
    """Tile sizes of the TPU tree kernel: ``block_q`` / ``block_k`` the forward's query / key blocks,
    ``block_q_bwd`` / ``block_k_bwd`` both backward kernels' (``None``: the forward's). Each must divide the row
    length; on a TPU each must be a multiple of 128 (in the interpreter, of 8). Default: :func:`default_blocks`."""

    block_q: int = 256
    block_k: int = 256
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None

    def bwd(self) -> tuple[int, int]:
        return self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k


def default_blocks(row_length: int, interpret=False) -> TreeSplashBlocks:
    """Square tiles: the largest of 256 and 128 (not tuned on hardware) that divides ``row_length``; in the
    interpreter (``interpret``) down to 8, so short test rows run. Rows with no such divisor raise ``ValueError``."""
    floor = 8 if interpret else NUM_LANES
    b = 256
    while b > floor and row_length % b:
        b //= 2
    if row_length % b:
        raise ValueError(f"tree TPU attention: row length {row_length} is not a multiple of {b}; pad rows to a "
                         f"multiple of {b} (PackingConfig.granule = {b})")
    return TreeSplashBlocks(b, b)


def _check(q, k, v, lo, hi, blocks: TreeSplashBlocks, interpret):
    """``ValueError`` (one line naming the fix) for shapes the kernel cannot run."""
    if not any(type(interpret) is type(m) and interpret == m for m in INTERPRET_MODES):
        raise ValueError(f"tree TPU attention: interpret={interpret!r} is not one of {INTERPRET_MODES}; pass False "
                         "(TPU), True / 'tpu' (TPU interpreter) or 'hlo' (generic interpreter)")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"tree TPU attention: q {q.shape}, k {k.shape}, v {v.shape} must be [B, L, heads, H] with "
                         "k and v of one shape")
    B, L, Q, H = q.shape
    K = k.shape[2]
    if k.shape[:2] != (B, L) or k.shape[3] != H:
        raise ValueError(f"tree TPU attention: q {q.shape} and k {k.shape} must share B, L and the head size H; "
                         "pass k, v of the same rows and head size")
    if Q % K:
        raise ValueError(f"tree TPU attention: {Q} query heads are not a multiple of {K} KV heads; use a query head "
                         "count divisible by the KV head count (grouped-query attention)")
    if lo.shape != (B, L) or hi.shape != (B, L):
        raise ValueError(f"tree TPU attention: node_lo {lo.shape} / node_hi {hi.shape} must be [B, L] = {(B, L)}; "
                         "pass the packed rows' intervals")
    multiple = 8 if interpret else NUM_LANES
    for name, b in (("block_q", blocks.block_q), ("block_k", blocks.block_k),
                    ("block_q_bwd", blocks.bwd()[0]), ("block_k_bwd", blocks.bwd()[1])):
        if b <= 0 or L % b or b % multiple:
            raise ValueError(f"tree TPU attention: {name}={b} must divide the row length {L} and be a multiple of "
                             f"{multiple}; pick tiles dividing L (tree_splash.default_blocks({L}) does) or pad rows")


def _mask(q_lo_col, k_lo_row, k_hi_row, q0, k0, shape):
    """``shape = (block_q, block_k)`` tree mask of one tile: query positions ``q0 + row``, key positions
    ``k0 + col``; ``q_lo_col [block_q, 1]``, ``k_lo_row, k_hi_row [1, block_k]``."""
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    k_pos = k0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (k_pos <= q_pos) & (k_lo_row <= q_lo_col) & (q_lo_col <= k_hi_row)


def _mask_t(k_lo_col, k_hi_col, q_lo_row, k0, q0, shape):
    """The transposed tile mask, ``shape = (block_k, block_q)``: ``k_lo_col, k_hi_col [block_k, 1]``,
    ``q_lo_row [1, block_q]``."""
    k_pos = k0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    q_pos = q0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (k_pos <= q_pos) & (k_lo_col <= q_lo_row) & (q_lo_row <= k_hi_col)


def _listed(table_ref, b, i, t):
    """The block that step ``t`` of row ``b``'s list ``i`` reads: entry ``t``, or past the list's end its last
    entry (the same block again: the pipeline issues no copy, and the body does not run)."""
    return table_ref[b, i, 2 + jnp.minimum(t, table_ref[b, i, 0] - 1)]


def _run_tiles(table_ref, b, i, t, tile):
    """Runs ``tile(masked)`` for step ``t`` of list ``i``: unmasked for its full tiles, masked for the rest, not at
    all past its count."""
    count, n_full = table_ref[b, i, 0], table_ref[b, i, 1]

    @pl.when(t < n_full)
    def _full():
        tile(False)

    @pl.when((t >= n_full) & (t < count))
    def _partial():
        tile(True)


# ----------------------------------------------------------------------------------------------------- forward
def _fwd_kernel(kv_ref, q_ref, k_ref, v_ref, qlo_ref, klo_ref, khi_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *,
                scale, block_q, block_k, steps):
    """Forward of query block ``i = program_id(2)`` of row ``program_id(0)``, head ``program_id(1)``, at step
    ``t = program_id(3)`` of its key-block list (module docstring)."""
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _MASK, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def tile(masked: bool):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
        if masked:
            j = _listed(kv_ref, b, i, t)
            vis = _mask(qlo_ref[...], klo_ref[...], khi_ref[...], i * block_q, j * block_k, s.shape)
            s = jnp.where(vis, s, _MASK)
        m_prev, l_prev = m_scr[...], l_scr[...]  # [block_q, 128], all lanes equal
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_next[:, :1])
        if masked:
            p = jnp.where(vis, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_scr[...] = m_next
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
        acc_scr[...] = alpha[:, :1] * acc_scr[...] + pv

    _run_tiles(kv_ref, b, i, t, tile)

    @pl.when(t == steps - 1)
    def _end():
        l = l_scr[...][:, :1]
        o_ref[...] = (acc_scr[...] / l).astype(o_ref.dtype)
        lse_ref[...] = m_scr[...][:, :1] + jnp.log(l)


INTERPRET_MODES = (False, True, "tpu", "hlo")


def _interpret_arg(interpret):
    """``pallas_call``'s ``interpret`` for this kernel's ``interpret`` flag (:func:`tree_splash_attention`)."""
    if interpret is True or interpret == "tpu":
        return pltpu.InterpretParams()
    return interpret == "hlo"


def _layouts(lo, hi):
    """``(lo_col, hi_col, lo_row, hi_row)``: the intervals as ``[B, L, 1]`` columns and ``[B, 1, L]`` rows."""
    lo, hi = lo.astype(jnp.int32), hi.astype(jnp.int32)
    return lo[:, :, None], hi[:, :, None], lo[:, None, :], hi[:, None, :]


def _forward(q, k, v, lo, hi, blocks: TreeSplashBlocks, interpret):
    """``(out [B, L, Q, H], lse [B, Q, L] fp32)``."""
    _check(q, k, v, lo, hi, blocks, interpret)
    B, L, Q, H = q.shape
    K = k.shape[2]
    G = Q // K
    bq, bk = blocks.block_q, blocks.block_k
    nq, nk = L // bq, L // bk
    lo_col, _, lo_row, hi_row = _layouts(lo, hi)
    kv_list = block_tables(lo.astype(jnp.int32), hi.astype(jnp.int32), bq, bk, True).kv_list
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # [B, heads, L, H]

    q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, kv: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, kv: (b, lax.div(h, G), _listed(kv, b, i, t), 0))
    qlo_spec = pl.BlockSpec((None, bq, 1), lambda b, h, i, t, kv: (b, i, 0))
    krow_spec = pl.BlockSpec((None, 1, bk), lambda b, h, i, t, kv: (b, 0, _listed(kv, b, i, t)))
    lse_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, t, kv: (b, h, i, 0))
    kernel = functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(H), block_q=bq, block_k=bk, steps=nk)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Q, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, qlo_spec, krow_spec, krow_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), jnp.float32), pltpu.VMEM((bq, NUM_LANES), jnp.float32),
                            pltpu.VMEM((bq, H), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(qt.shape, q.dtype), jax.ShapeDtypeStruct((B, Q, L, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="tree_splash_forward",
    )(kv_list, qt, kt, vt, lo_col, lo_row, hi_row)
    return out.transpose(0, 2, 1, 3), lse[..., 0]


# ---------------------------------------------------------------------------------------------------- backward
def _dq_kernel(kv_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qlo_ref, klo_ref, khi_ref, dq_ref, dq_scr,
               *, scale, block_q, block_k, steps):
    """``dq`` of query block ``i = program_id(2)`` at step ``t = program_id(3)`` of its key-block list::

        p = exp(s - lse),  ds = p (do v^T - delta),  dq = sum_j ds k_j scale
    """
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def tile(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse_ref[...])  # lse [block_q, 1]
        if masked:
            j = _listed(kv_ref, b, i, t)
            p = jnp.where(_mask(qlo_ref[...], klo_ref[...], khi_ref[...], i * block_q, j * block_k, s.shape), p, 0.0)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        dq_scr[...] += lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32)

    _run_tiles(kv_ref, b, i, t, tile)

    @pl.when(t == steps - 1)
    def _end():
        dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(qtab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, klo_ref, khi_ref, qlo_ref, dk_ref, dv_ref,
                dk_scr, dv_scr, *, scale, block_q, block_k, group, steps):
    """``dk, dv`` of key block ``j = program_id(2)`` of KV head ``program_id(1)``, accumulated over the group's query
    heads ``g = program_id(3)`` and the listed query blocks (step ``t = program_id(4)``), transposed tiles::

        p^T = exp(k q^T scale - lse),  dv = sum p^T do,  ds^T = p^T (v do^T - delta),  dk = sum ds^T q scale
    """
    b, j, g, t = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (t == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def tile(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s_t = lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32) * scale  # [block_k, block_q]
        p_t = jnp.exp(s_t - lse_ref[...])  # lse [1, block_q]
        if masked:
            i = _listed(qtab_ref, b, j, t)
            vis = _mask_t(klo_ref[...], khi_ref[...], qlo_ref[...], j * block_k, i * block_q, s_t.shape)
            p_t = jnp.where(vis, p_t, 0.0)
        dv_scr[...] += lax.dot_general(p_t.astype(do.dtype), do, _NN, preferred_element_type=jnp.float32)
        dp_t = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
        ds_t = p_t * (dp_t - delta_ref[...])
        dk_scr[...] += lax.dot_general(ds_t.astype(q.dtype), q, _NN, preferred_element_type=jnp.float32)

    _run_tiles(qtab_ref, b, j, t, tile)

    @pl.when((g == group - 1) & (t == steps - 1))
    def _end():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(q, k, v, lo, hi, out, lse, do, blocks: TreeSplashBlocks, interpret):
    B, L, Q, H = q.shape
    K = k.shape[2]
    G = Q // K
    bq, bk = blocks.bwd()
    nq, nk = L // bq, L // bk
    scale = 1.0 / math.sqrt(H)
    lo_col, hi_col, lo_row, hi_row = _layouts(lo, hi)
    tables = block_tables(lo.astype(jnp.int32), hi.astype(jnp.int32), bq, bk, True)
    delta = jnp.einsum("blqh,blqh->bql", out.astype(jnp.float32), do.astype(jnp.float32))  # [B, Q, L]
    qt, kt, vt, dot = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
    interp = _interpret_arg(interpret)

    # dq: grid (row, query head, query block, step over its key blocks)
    q_spec = pl.BlockSpec((None, None, bq, H), lambda b, h, i, t, kv: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, i, t, kv: (b, lax.div(h, G), _listed(kv, b, i, t), 0))
    col_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, t, kv: (b, h, i, 0))  # lse, delta columns
    qlo_spec = pl.BlockSpec((None, bq, 1), lambda b, h, i, t, kv: (b, i, 0))
    krow_spec = pl.BlockSpec((None, 1, bk), lambda b, h, i, t, kv: (b, 0, _listed(kv, b, i, t)))
    dq_t = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=bq, block_k=bk, steps=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Q, nq, nk),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, col_spec, col_spec, qlo_spec, krow_spec, krow_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interp,
        name="tree_splash_backward_dq",
    )(tables.kv_list, qt, kt, vt, dot, lse[..., None], delta[..., None], lo_col, lo_row, hi_row)

    # dk, dv: grid (row, KV head, key block, query head in the group, step over the query blocks that see it)
    head = lambda kh, g: kh * G + g  # noqa: E731
    qg_spec = pl.BlockSpec((None, None, bq, H),
                           lambda b, kh, j, g, t, qt_: (b, head(kh, g), _listed(qt_, b, j, t), 0))
    own_spec = pl.BlockSpec((None, None, bk, H), lambda b, kh, j, g, t, qt_: (b, kh, j, 0))
    row_spec = pl.BlockSpec((None, None, 1, bq),  # lse, delta rows
                            lambda b, kh, j, g, t, qt_: (b, head(kh, g), 0, _listed(qt_, b, j, t)))
    kcol_spec = pl.BlockSpec((None, bk, 1), lambda b, kh, j, g, t, qt_: (b, j, 0))
    qrow_spec = pl.BlockSpec((None, 1, bq), lambda b, kh, j, g, t, qt_: (b, 0, _listed(qt_, b, j, t)))
    dk_t, dv_t = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=bq, block_k=bk, group=G, steps=nq),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, K, nk, G, nq),
            in_specs=[qg_spec, own_spec, own_spec, qg_spec, row_spec, row_spec, kcol_spec, kcol_spec, qrow_spec],
            out_specs=[own_spec, own_spec],
            scratch_shapes=[pltpu.VMEM((bk, H), jnp.float32), pltpu.VMEM((bk, H), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(kt.shape, k.dtype), jax.ShapeDtypeStruct(vt.shape, v.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interp,
        name="tree_splash_backward_dkv",
    )(tables.q_list, qt, kt, vt, dot, lse[:, :, None, :], delta[:, :, None, :], lo_col, hi_col, lo_row)
    back = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return back(dq_t), back(dk_t), back(dv_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tree_splash_attention(q, k, v, node_lo, node_hi, blocks: TreeSplashBlocks | None = None,
                          interpret: bool | str = False):
    """Tree-masked attention on TPU (module docstring). ``q: [B, L, Q, H]``, ``k, v: [B, L, K, H]`` (``Q % K ==
    0``), ``node_lo, node_hi: [B, L]`` int; returns ``[B, L, Q, H]`` in ``q``'s dtype. ``blocks``: the tiles
    (``None``: :func:`default_blocks` of ``L``). ``interpret``: ``False`` compiles for a TPU; ``True`` (or
    ``"tpu"``) runs Pallas' TPU interpreter (``pltpu.InterpretParams()``, any backend: it models the TPU's memory,
    fills uninitialised buffers with NaN and raises on out-of-bounds reads; its callbacks cannot be partially
    evaluated, so not under ``jax.checkpoint``); ``"hlo"`` runs Pallas' generic interpreter (plain XLA ops, fine
    under ``jax.checkpoint``: what :func:`treejax.models.tree_attention.make_tree_attention` uses off a TPU)."""
    return _forward(q, k, v, node_lo, node_hi, blocks or default_blocks(q.shape[1], interpret), interpret)[0]


def _vjp_fwd(q, k, v, lo, hi, blocks, interpret):
    out, lse = _forward(q, k, v, lo, hi, blocks or default_blocks(q.shape[1], interpret), interpret)
    return out, (q, k, v, lo, hi, out, lse)


def _vjp_bwd(blocks, interpret, res, do):
    q, k, v, lo, hi, out, lse = res
    dq, dk, dv = _backward(q, k, v, lo, hi, out, lse, do, blocks or default_blocks(q.shape[1], interpret), interpret)
    return dq, dk, dv, None, None


tree_splash_attention.defvjp(_vjp_fwd, _vjp_bwd)


def make_attention(node_lo_BxL, node_hi_BxL, blocks: TreeSplashBlocks | None = None, interpret: bool | str = False):
    """``attend(q, k, v)`` closure for :func:`treejax.models.tree_attention.make_tree_attention`."""
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)
    return lambda q, k, v: tree_splash_attention(q, k, v, lo, hi, blocks, interpret)
