"""Block-sparse flash attention for tree-packed rows (Pallas; Triton on GPU, the Pallas interpreter elsewhere).

Same function as the dense path of :mod:`treejax.models.tree_attention`::

    out_i = sum_j softmax_j(s_ij) v_j,   s_ij = q_i . k_j / sqrt(H)  where visible(i, j), else -inf
    visible(i, j) = (j <= i) & (lo_j <= lo_i <= hi_j)      (lo/hi: the token's node preorder interval)

computed FlashAttention-2 style (Dao 2023, arXiv 2307.08691): queries in blocks of ``block_q`` (the grid), keys
in blocks of ``block_k``, an online softmax in fp32 and base 2 (``m``: running max, ``l``: running sum,
``lse = m + log2 l``), ``O(block)`` memory. Only tiles that may hold a visible pair are visited
(:func:`block_tables`, built once per forward in XLA from per-block interval summaries: key block ``j`` may be
visible to query block ``i`` iff ``j <= i``, ``min lo_k <= max lo_q`` and ``min lo_q <= max hi_k``, a superset
of the exact tiles). In a row laid out in preorder the key blocks before a query block are its ancestors
(visible) or subtrees that ended before it (``hi < lo_q``: invisible), so a query block of a depth-``d`` node
visits ``~ (n_p + d S) / block_k`` tiles, not ``i / block_k``: the forward and ``dq`` loops read a list of key
blocks per query block; the ``dk, dv`` loop runs over the query blocks ``[j, end_j)`` that may see key block ``j``
(contiguous in preorder: a key's viewers are the rest of its node and its node's subtree). Inside a tile the
exact mask is applied, and a tile with no visible pair is skipped (``lax.cond``). With ``PackingConfig.align``
a multiple of the tiles, tiles are node-aligned and the tables exact.

Backward (same paper, Algorithm 2): ``delta_i = sum_h o_ih do_ih`` (XLA), then one fused kernel per key block:
``dv_j = sum_i p_ij do_i``, ``dk_j = scale sum_i p_ij (do_i . v_j - delta_i) q_i`` over the query blocks at or
after it (skipping invisible tiles), and ``dq_i`` over the key blocks up to it, with
``p_ij = 2^(s_ij log2 e - lse_i)`` recomputed from the saved ``lse``. Grouped-query attention reads KV head
``h // (Q / K)``; ``dk``/``dv`` are produced per query head and summed over each group.

Adapted from JAX's ``jax.experimental.pallas.ops.gpu.attention`` (Apache-2.0; segment-id masking replaced by the
tree mask, tile skipping and GQA added). Correctness is tested against the dense path in interpreter mode on
CPU; GPU speed is measured by ``experiments/bench_packed.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class TreeFlashBlocks:
    """Tile sizes (powers of two; halved where they do not divide the row length). ``block_q``/``block_k``:
    forward; ``block_bwd``: the fused backward's query and key blocks; ``num_warps`` (``None``: 4 for
    head_dim <= 64, else 8). Defaults: see :data:`DEFAULT_BLOCKS`."""

    block_q: int = 128
    block_k: int = 64
    block_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    @classmethod
    def parse(cls, text: str) -> "TreeFlashBlocks":
        """``"block_q,block_k,block_bwd[,num_warps[,num_stages]]"`` (the benchmarks' ``--tiles`` syntax; warps
        0 = the default)."""
        parts = text.split(",")
        if not 3 <= len(parts) <= 5 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"tree flash tiles {text!r}: expected block_q,block_k,block_bwd[,num_warps[,num_stages]]"
                             " (integers)")
        v = [int(p) for p in parts]
        if any(b < 16 or b & (b - 1) for b in v[:3]):
            raise ValueError(f"tree flash tiles {text!r}: block sizes must be powers of two >= 16")
        return cls(v[0], v[1], v[2], (v[3] or None) if len(v) > 3 else None, v[4] if len(v) > 4 else 2)

    def __str__(self) -> str:
        extra = (f",{self.num_warps or 0}" if self.num_warps or self.num_stages != 2 else "") + (
            f",{self.num_stages}" if self.num_stages != 2 else "")
        return f"{self.block_q},{self.block_k},{self.block_bwd}{extra}"


#: Tile sizes used when none are given (benchmarks may set this before tracing to try others). Chosen by
#: ``experiments/bench_tree_attention.py`` on an H200 (16,384-token rows of a W=16, depth-4, 512-token-segment
#: tree, fwd+bwd; results in experiments/results/packed/): 128,64,64 took 5.26 / 5.72 ms for head_dim 64 / 128
#: (qwen2.5-0.5b / 1.5b heads) against 6.33 / 9.85 ms for the former 64,64,32; the best for head_dim 64,
#: 64,64,64, was 1.5% faster (5.18 ms).
DEFAULT_BLOCKS = TreeFlashBlocks()


def _visible(q_lo, span_q, k_lo, k_hi, span_k):
    """``[bq, bk]`` tree mask of one tile."""
    return ((span_q[:, None] >= span_k[None, :]) & (k_lo[None, :] <= q_lo[:, None])
            & (q_lo[:, None] <= k_hi[None, :]))


def _any(mask):
    return jnp.max(jnp.max(mask.astype(jnp.int32), axis=1), axis=0) > 0


def block_tables(lo_BxL: jax.Array, hi_BxL: jax.Array, block_q: int, block_k: int):
    """Tile tables of packed rows (module docstring).

    Returns ``kv_list [B, nq, 1 + nk]`` (entry 0: how many key blocks query block ``i`` may see; then their
    indices, ascending) and ``q_end [B, nk]`` (one past the last query block that may see key block ``j``)."""
    B, L = lo_BxL.shape
    nq, nk = L // block_q, L // block_k
    klo = lo_BxL.reshape(B, nk, block_k).min(-1)
    khi = hi_BxL.reshape(B, nk, block_k).max(-1)
    qlo_min = lo_BxL.reshape(B, nq, block_q).min(-1)
    qlo_max = lo_BxL.reshape(B, nq, block_q).max(-1)
    causal = (jnp.arange(nk) * block_k)[None, :] <= (jnp.arange(nq) * block_q + block_q - 1)[:, None]
    vis = causal[None] & (klo[:, None, :] <= qlo_max[:, :, None]) & (qlo_min[:, :, None] <= khi[:, None, :])
    count = jnp.sum(vis, axis=-1).astype(jnp.int32)
    order = jnp.argsort(jnp.where(vis, 0, 1), axis=-1, stable=True).astype(jnp.int32)
    kv_list = jnp.concatenate([count[..., None], order], axis=-1)
    q_end = jnp.max(jnp.where(vis, jnp.arange(1, nq + 1)[None, :, None], 0), axis=1).astype(jnp.int32)
    return kv_list, q_end


def _fwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, o_ref, lse_ref, *, scale, block_q, block_k,
                head_dim):
    from jax.experimental.pallas import triton as plgpu

    start_q = pl.program_id(0)
    hp = q_ref.shape[-1]
    head_mask = (jnp.arange(hp) < head_dim)[None, :]
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    q_slice = pl.ds(start_q * block_q, block_q)
    q_lo = lo_ref[q_slice]
    span_q = start_q * block_q + jnp.arange(block_q)

    def body(t, carry):
        start_k = kv_ref[t + 1]
        k_slice = pl.ds(start_k * block_k, block_k)
        mask = _visible(q_lo, span_q, lo_ref[k_slice], hi_ref[k_slice], start_k * block_k + jnp.arange(block_k))

        def tile(carry):
            o_prev, m_prev, l_prev = carry
            k = plgpu.load(k_ref.at[k_slice, :], mask=head_mask, other=0.0)
            qk = plgpu.dot(q, k.T) * (scale * _LOG2E)
            qk = jnp.where(mask, qk, _MASK)
            m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
            correction = jnp.exp2(m_prev - m_next)
            s = jnp.exp2(qk - m_next[:, None])
            v = plgpu.load(v_ref.at[k_slice, :], mask=head_mask, other=0.0)
            o_next = correction[:, None] * o_prev + plgpu.dot(s.astype(v.dtype), v)
            return o_next, m_next, correction * l_prev + jnp.sum(s, axis=-1)

        return lax.cond(_any(mask), tile, lambda c: c, carry)

    init = (jnp.zeros((block_q, hp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    o, m, l = lax.fori_loop(0, kv_ref[0], body, init)  # the diagonal tile is always listed: l > 0
    o = o / l[:, None]
    lse_ref[...] = m + jnp.log2(l)
    plgpu.store(o_ref.at[:, : o.shape[-1]], o.astype(o_ref.dtype), mask=head_mask)


def _bwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, qend_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref,
                dv_ref, *, scale, block, head_dim):
    from jax.experimental.pallas import triton as plgpu

    hp = q_ref.shape[-1]
    head_mask = (jnp.arange(hp) < head_dim)[None, :]
    ld = lambda ref: plgpu.load(ref, mask=head_mask, other=0.0)  # noqa: E731

    # dK, dV of key block i over the query blocks that may see it (causal: from block i on).
    start_k = pl.program_id(2)
    k_slice = pl.ds(start_k * block, block)
    k = ld(k_ref.at[k_slice, :])
    v = ld(v_ref.at[k_slice, :])
    k_lo, k_hi = lo_ref[k_slice], hi_ref[k_slice]
    span_k = start_k * block + jnp.arange(block)

    def dkdv_body(start_q, carry):
        q_slice = pl.ds(start_q * block, block)
        mask = _visible(lo_ref[q_slice], start_q * block + jnp.arange(block), k_lo, k_hi, span_k)

        def tile(carry):
            dv, dk = carry
            q = ld(q_ref.at[q_slice, :])
            qk = jnp.where(mask, plgpu.dot(q, k.T) * (scale * _LOG2E), _MASK)
            p = jnp.exp2(qk - lse_ref[q_slice][:, None])
            do = ld(do_ref.at[q_slice, :])
            dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
            dp = plgpu.dot(do, v.T) - delta_ref[q_slice][:, None]
            ds = p * dp * scale
            return dv, dk + plgpu.dot(ds.astype(q.dtype).T, q)

        return lax.cond(_any(mask), tile, lambda c: c, carry)

    zeros = jnp.zeros((block, hp), jnp.float32)
    dv, dk = lax.fori_loop(start_k, qend_ref[start_k], dkdv_body, (zeros, zeros))
    plgpu.store(dv_ref.at[:, : dv.shape[-1]], dv.astype(dv_ref.dtype), mask=head_mask)
    plgpu.store(dk_ref.at[:, : dk.shape[-1]], dk.astype(dk_ref.dtype), mask=head_mask)

    # dQ of query block i over the key blocks up to it.
    start_q = pl.program_id(2)
    q_slice = pl.ds(start_q * block, block)
    q = ld(q_ref.at[q_slice, :])
    q_lo = lo_ref[q_slice]
    span_q = start_q * block + jnp.arange(block)
    lse = lse_ref[q_slice]
    do = ld(do_ref.at[q_slice, :])
    delta = delta_ref[q_slice]

    def dq_body(t, dq):
        start_k = kv_ref[t + 1]
        kk_slice = pl.ds(start_k * block, block)
        mask = _visible(q_lo, span_q, lo_ref[kk_slice], hi_ref[kk_slice], start_k * block + jnp.arange(block))

        def tile(dq):
            kk = ld(k_ref.at[kk_slice, :])
            vv = ld(v_ref.at[kk_slice, :])
            qk = jnp.where(mask, plgpu.dot(q, kk.T) * (scale * _LOG2E), _MASK)
            p = jnp.exp2(qk - lse[:, None])
            ds = p * (plgpu.dot(do, vv.T) - delta[:, None]) * scale
            return dq + plgpu.dot(ds.astype(kk.dtype), kk)

        return lax.cond(_any(mask), tile, lambda d: d, dq)

    dq = lax.fori_loop(0, kv_ref[0], dq_body, jnp.zeros((block, hp), jnp.float32))
    plgpu.store(dq_ref.at[:, : dq.shape[-1]], dq.astype(dq_ref.dtype), mask=head_mask)


def _fit(block: int, L: int, name: str) -> int:
    """The tile actually used: the largest power of two ``<= min(block, L)`` that divides the row length ``L``
    (down to 16; Triton tiles are powers of two), so any row length that is a multiple of 16 runs with the
    largest configured tile that fits it."""
    b = 1 << (min(block, L).bit_length() - 1)
    while b > 16 and L % b:
        b //= 2
    if L % b:
        raise ValueError(f"tree flash attention: row length {L} is not a multiple of {name}={b}; pad rows to a "
                         "multiple of 16 (PackingConfig.granule)")
    return b


def _check(q, k):
    B, Lq, Q, H = q.shape
    K = k.shape[2]
    if k.shape[:2] != (B, Lq) or Q % K:
        raise ValueError(f"tree flash attention: q {q.shape} and k {k.shape} must share [B, L] with Q % K == 0")


def _forward(q, k, v, lo, hi, blocks: TreeFlashBlocks, interpret: bool):
    from jax.experimental.pallas import triton as plgpu

    B, L, Q, H = q.shape
    K = k.shape[2]
    G = Q // K
    _check(q, k)
    bq, bk = _fit(blocks.block_q, L, "block_q"), _fit(blocks.block_k, L, "block_k")
    hp = pl.next_power_of_2(H)
    warps = blocks.num_warps or (4 if H <= 64 else 8)
    kernel = functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(H), block_q=bq, block_k=bk, head_dim=H)
    kv_list, _ = block_tables(lo, hi, bq, bk)
    row = pl.BlockSpec((None, L), lambda i, b, h: (b, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(L // bq, B, Q),
        in_specs=[pl.BlockSpec((None, bq, None, hp), lambda i, b, h: (b, i, h, 0)),
                  pl.BlockSpec((None, L, None, hp), lambda i, b, h: (b, 0, h // G, 0)),
                  pl.BlockSpec((None, L, None, hp), lambda i, b, h: (b, 0, h // G, 0)), row, row,
                  pl.BlockSpec((None, None, kv_list.shape[-1]), lambda i, b, h: (b, i, 0))],
        out_specs=[pl.BlockSpec((None, bq, None, hp), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, Q, L), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="tree_flash_forward",
    )(q, k, v, lo, hi, kv_list)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tree_flash_attention(q, k, v, node_lo, node_hi, blocks: TreeFlashBlocks = TreeFlashBlocks(),
                         interpret: bool = False):
    """Tree-masked attention (module docstring). ``q: [B, L, Q, H]``, ``k, v: [B, L, K, H]``, ``node_lo, node_hi:
    [B, L]`` int32; returns ``[B, L, Q, H]`` in ``q``'s dtype. ``L`` must be a multiple of 16 (tiles that do
    not divide ``L`` are halved)."""
    return _forward(q, k, v, node_lo, node_hi, blocks, interpret)[0]


def _vjp_fwd(q, k, v, lo, hi, blocks, interpret):
    out, lse = _forward(q, k, v, lo, hi, blocks, interpret)
    return out, (q, k, v, lo, hi, out, lse)


def _vjp_bwd(blocks, interpret, res, do):
    from jax.experimental.pallas import triton as plgpu

    q, k, v, lo, hi, out, lse = res
    B, L, Q, H = q.shape
    K = k.shape[2]
    G = Q // K
    blk = _fit(blocks.block_bwd, L, "block_bwd")
    hp = pl.next_power_of_2(H)
    delta = jnp.einsum("blqh,blqh->bql", out.astype(jnp.float32), do.astype(jnp.float32))
    kv_list, q_end = block_tables(lo, hi, blk, blk)
    full = lambda n: pl.BlockSpec((None, L, None, hp), lambda b, h, i, n=n: (b, 0, h // n, 0))  # noqa: E731
    row = pl.BlockSpec((None, L), lambda b, h, i: (b, 0))
    stat = pl.BlockSpec((None, None, L), lambda b, h, i: (b, h, 0))
    tile = pl.BlockSpec((None, blk, None, hp), lambda b, h, i: (b, i, h, 0))
    dq, dk, dv = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=1.0 / math.sqrt(H), block=blk, head_dim=H),
        grid=(B, Q, L // blk),
        in_specs=[full(1), full(G), full(G), row, row,
                  pl.BlockSpec((None, None, kv_list.shape[-1]), lambda b, h, i: (b, i, 0)),
                  pl.BlockSpec((None, L // blk), lambda b, h, i: (b, 0)), full(1), stat, stat],
        out_specs=[tile, tile, tile],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct(q.shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps or 4, num_stages=blocks.num_stages),
        interpret=interpret,
        name="tree_flash_backward",
    )(q, k, v, lo, hi, kv_list, q_end, do, lse, delta)
    group_sum = lambda x: x.reshape(B, L, K, G, H).sum(axis=3).astype(k.dtype)  # noqa: E731
    return dq, group_sum(dk), group_sum(dv), None, None


tree_flash_attention.defvjp(_vjp_fwd, _vjp_bwd)


def make_attention(node_lo_BxL, node_hi_BxL, blocks: TreeFlashBlocks | None = None, interpret: bool = False):
    """``attend(q, k, v)`` closure for :func:`treejax.models.tree_attention.make_tree_attention` (``blocks``
    default: :data:`DEFAULT_BLOCKS`)."""
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)
    return lambda q, k, v: tree_flash_attention(q, k, v, lo, hi, blocks, interpret)
