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

Full tiles (``TreeFlashBlocks.full_tiles``): most listed tiles are an ancestor's key block seen by a
descendant's query block, where every pair is visible. A tile is marked *full* when the block summaries prove
it::

    (j_blk + 1) block_k - 1 <= i_blk block_q      (the key block ends before the query block starts: j <= i)
    max lo_k <= min lo_q                          (lo_j <= lo_i for every pair)
    max lo_q <= min hi_k                          (lo_i <= hi_j for every pair)

(sufficient, not necessary: a tile marked full is all-visible; a full tile not marked runs the masked path,
still exact). The tables then list each block's full tiles first, and the kernels run two loops: the full tiles
without a mask, a ``jnp.where`` or a ``lax.cond``, then the partial ones (diagonal, node boundaries) as above.
The ``dk, dv`` loop then reads a list of query blocks per key block (:attr:`BlockTables.q_list`) instead of
the range ``[j, end_j)``.

Backward (same paper, Algorithm 2): ``delta_i = sum_h o_ih do_ih`` (XLA), then one fused kernel per key block:
``dv_j = sum_i p_ij do_i``, ``dk_j = scale sum_i p_ij (do_i . v_j - delta_i) q_i`` over the query blocks at or
after it (skipping invisible tiles), and ``dq_i = scale sum_j p_ij (do_i . v_j - delta_i) k_j`` over the key
blocks up to it, with ``p_ij = 2^(s_ij log2 e - lse_i)`` recomputed from the saved ``lse``. With
``TreeFlashBlocks.split_bwd`` the two loops run as two kernels (``dq``: grid over query blocks of ``dq_blocks[0]``,
key blocks of ``dq_blocks[1]``; ``dk, dv``: grid over key blocks of ``dkv_blocks[0]``, query blocks of
``dkv_blocks[1]``), each with its own tile sizes and fewer live registers. Grouped-query attention reads KV head
``h // (Q / K)``; ``dk``/``dv`` are produced per query head and summed over each group.

Adapted from JAX's ``jax.experimental.pallas.ops.gpu.attention`` (Apache-2.0; segment-id masking replaced by the
tree mask, tile skipping and GQA added). Correctness is tested against the dense path in interpreter mode on
CPU; GPU speed is measured by ``experiments/bench_tree_attention.py`` and ``experiments/bench_packed.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class TreeFlashBlocks:
    """Tile sizes and kernel variants. ``block_q``/``block_k``: the forward's query and key blocks; ``block_bwd``:
    the fused backward's query and key blocks (powers of two; halved where they do not divide the row length);
    ``num_warps`` (``None``: 4 for head_dim <= 64, else 8) and ``num_stages``: Triton's. Variants (module
    docstring; off in the dataclass, on in :func:`default_blocks`): ``full_tiles``: tiles proven all-visible run
    without a mask; ``split_bwd``: the backward as a ``dq`` and a ``dk, dv`` kernel, with ``dq_blocks = (query
    block, key block)`` and ``dkv_blocks = (key block, query block)`` (the grid's block first; ``None``:
    ``block_bwd`` for both); ``bwd_warps``: the backward kernels' warps (``None``: ``num_warps``, else 4). Used
    when none are given: :func:`default_blocks`."""

    block_q: int = 128
    block_k: int = 64
    block_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2
    full_tiles: bool = False
    split_bwd: bool = False
    dq_blocks: tuple[int, int] | None = None
    dkv_blocks: tuple[int, int] | None = None
    bwd_warps: int | None = None

    def __post_init__(self):
        if (self.dq_blocks or self.dkv_blocks) and not self.split_bwd:
            raise ValueError("TreeFlashBlocks: dq_blocks / dkv_blocks are the split backward's (split_bwd=True)")

    @classmethod
    def parse(cls, text: str) -> "TreeFlashBlocks":
        """``"block_q,block_k,block_bwd[,num_warps[,num_stages]][,key=value...]"`` (the benchmarks' ``--tiles``
        syntax; warps 0 = the default). Keys: ``full=0|1`` (:attr:`full_tiles`), ``split=0|1``
        (:attr:`split_bwd`), ``dq=QxK`` and ``dkv=KxQ`` (the split kernels' blocks, grid block first; they need
        ``split=1``), ``bwd_warps=N`` (0 = the default). E.g. ``128,64,64,full=1,split=1,dq=128x32,dkv=128x32``."""
        parts = [p.strip() for p in text.split(",")]
        n_pos = next((i for i, p in enumerate(parts) if "=" in p), len(parts))
        pos, opts = parts[:n_pos], parts[n_pos:]
        if not 3 <= len(pos) <= 5 or not all(p.isdigit() for p in pos) or not all("=" in p for p in opts):
            raise ValueError(f"tree flash tiles {text!r}: expected block_q,block_k,block_bwd[,num_warps[,num_stages]]"
                             " (integers), then key=value options (full, split, dq, dkv, bwd_warps)")
        v = [int(p) for p in pos]
        kw = dict(block_q=v[0], block_k=v[1], block_bwd=v[2], num_warps=(v[3] or None) if len(v) > 3 else None,
                  num_stages=v[4] if len(v) > 4 else 2)
        sizes = v[:3]
        for opt in opts:
            key, _, val = opt.partition("=")
            key, val = key.strip(), val.strip()
            if key in ("full", "split") and val in ("0", "1"):
                kw["full_tiles" if key == "full" else "split_bwd"] = val == "1"
            elif key == "bwd_warps" and val.isdigit():
                kw["bwd_warps"] = int(val) or None
            elif key in ("dq", "dkv") and len(val.split("x")) == 2 and all(s.isdigit() for s in val.split("x")):
                kw[f"{key}_blocks"] = tuple(int(s) for s in val.split("x"))
                sizes += list(kw[f"{key}_blocks"])
            else:
                raise ValueError(f"tree flash tiles {text!r}: bad option {opt!r} (full=0|1, split=0|1, dq=QxK, "
                                 "dkv=KxQ, bwd_warps=N)")
        if any(b < 16 or b & (b - 1) for b in sizes):
            raise ValueError(f"tree flash tiles {text!r}: block sizes must be powers of two >= 16")
        return cls(**kw)

    def __str__(self) -> str:
        extra = (f",{self.num_warps or 0}" if self.num_warps or self.num_stages != 2 else "") + (
            f",{self.num_stages}" if self.num_stages != 2 else "")
        opts = ([",full=1"] if self.full_tiles else []) + ([",split=1"] if self.split_bwd else []) + [
            f",{name}={b[0]}x{b[1]}" for name, b in (("dq", self.dq_blocks), ("dkv", self.dkv_blocks)) if b] + (
            [f",bwd_warps={self.bwd_warps}"] if self.bwd_warps else [])
        return f"{self.block_q},{self.block_k},{self.block_bwd}{extra}" + "".join(opts)

    def split_tiles(self, L: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The split backward's tiles on rows of ``L`` tokens, after halving: ``((dq query block, dq key block),
        (dk,dv key block, dk,dv query block))``; ``block_bwd`` where ``dq_blocks`` / ``dkv_blocks`` are unset."""
        b = self.block_bwd
        dq = tuple(_fit(x, L, f"dq_blocks[{n}]") for n, x in enumerate(self.dq_blocks or (b, b)))
        dkv = tuple(_fit(x, L, f"dkv_blocks[{n}]") for n, x in enumerate(self.dkv_blocks or (b, b)))
        return dq, dkv

    def describe(self, L: int, H: int) -> str:
        """What runs on rows of ``L`` tokens at head size ``H``: tiles after halving (``q``: query block, ``k``:
        key block), warps, stages, variants."""
        fwd = f"q{_fit(self.block_q, L, 'block_q')}/k{_fit(self.block_k, L, 'block_k')}"
        warps = self.num_warps or (4 if H <= 64 else 8)
        bwd_warps = self.bwd_warps or self.num_warps or 4
        if self.split_bwd:
            (dq_q, dq_k), (dkv_k, dkv_q) = self.split_tiles(L)
            bwd = f"split, dq q{dq_q}/k{dq_k} + dk,dv k{dkv_k}/q{dkv_q}"
        else:
            b = _fit(self.block_bwd, L, "block_bwd")
            bwd = f"fused q{b}/k{b}"
        return (f"fwd {fwd} ({warps} warps), bwd {bwd} ({bwd_warps} warps), {self.num_stages} stages, "
                + ("full tiles unmasked" if self.full_tiles else "every tile masked"))


LONG_ROW = 65536  #: rows at least this long take the long-row forward tiles (:func:`default_blocks`)


def default_blocks(head_dim: int, row_length: int | None = None) -> TreeFlashBlocks:
    """The kernel settings used when none are given, by head size and row length. Chosen by
    ``experiments/bench_tree_attention.py`` on an H200 (fwd+bwd, bf16, against cuDNN on the same leaves' expanded
    rows in the same call; ``experiments/results/perf_round/tree_attention_*_h200*.json``).

    One 16,384-token row of a W=16, depth-4, 512-token-segment tree, 64-token prompt (cuDNN 2.07 / 2.59 ms):

    * ``head_dim <= 64`` (qwen2.5-0.5b heads): ``64,64,64,full=1``, 1.77 ms (161 TFLOP/s, 1.17x cuDNN's), against
      3.48 ms for the former default ``128,64,64`` (every tile masked) and 2.00 ms for ``128,64,64,full=1``;
    * larger heads (qwen2.5-1.5b, 128): ``128,64,64,full=1,split=1``, 2.37 ms (206 TFLOP/s, 1.09x cuDNN's),
      against 3.84 ms for ``128,64,64`` and 2.57 ms for ``128,64,64,full=1``.

    Rows of at least :data:`LONG_ROW` tokens at ``head_dim <= 64`` (TreePO's 14 x 512 tree: one 98,304-token
    row, 7,232-token paths): ``128,64,64,4,3,full=1`` (128-query forward tiles, 3 pipeline stages; the fused
    backward's 64 x 64 tiles as before). Forward 5.97 ms against 6.75 ms, fwd+bwd 21.8 against 22.5 ms (cuDNN:
    4.14 / 14.8 ms), and the whole 14 x 512 packed update 5,724 against 5,831 ms (``bench_packed.py --depth
    14``, same call). On the depth-4 row above the same setting is slower (2.05 against 1.93 ms), hence the
    threshold. Larger heads were not measured on long rows and keep their setting.
    """
    if head_dim <= 64:
        if row_length is not None and row_length >= LONG_ROW:
            return TreeFlashBlocks(128, 64, 64, None, 3, full_tiles=True)
        return TreeFlashBlocks(64, 64, 64, full_tiles=True)
    return TreeFlashBlocks(128, 64, 64, full_tiles=True, split_bwd=True)


def _visible(q_lo, span_q, k_lo, k_hi, span_k):
    """``[bq, bk]`` tree mask of one tile."""
    return ((span_q[:, None] >= span_k[None, :]) & (k_lo[None, :] <= q_lo[:, None])
            & (q_lo[:, None] <= k_hi[None, :]))


def _any(mask):
    return jnp.max(jnp.max(mask.astype(jnp.int32), axis=1), axis=0) > 0


class BlockTables(NamedTuple):
    """Tile tables of packed rows (:func:`block_tables`). A list row is ``[count, n_full, blocks...]``: the
    ``count`` blocks that may hold a visible pair, the ``n_full`` tiles proven all-visible first, then the
    partial ones, each group ascending (entries past ``count``: unused)."""

    kv_list: jax.Array  #: ``[B, nq, 2 + nk]``: per query block, the key blocks it may see
    q_list: jax.Array  #: ``[B, nk, 2 + nq]``: per key block, the query blocks that may see it
    q_end: jax.Array  #: ``[B, nk]``: one past the last query block that may see key block ``j``


def _tile_list(vis_BxMxN, full_BxMxN):
    """``[B, M, 2 + N]`` list rows (:class:`BlockTables`) of a visibility table and its full tiles."""
    rank = 2 - vis_BxMxN.astype(jnp.int32) - full_BxMxN.astype(jnp.int32)  # 0 full, 1 partial, 2 invisible
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(vis_BxMxN, axis=-1).astype(jnp.int32)
    n_full = jnp.sum(full_BxMxN, axis=-1).astype(jnp.int32)
    return jnp.concatenate([count[..., None], n_full[..., None], order], axis=-1)


def block_tables(lo_BxL: jax.Array, hi_BxL: jax.Array, block_q: int, block_k: int,
                 full_tiles: bool = False) -> BlockTables:
    """Tile tables of packed rows (module docstring): query blocks of ``block_q``, key blocks of ``block_k``.
    Tile ``(i, j)`` is listed iff ``j <= i`` (causal), ``min lo_k <= max lo_q`` and ``min lo_q <= max hi_k`` (a
    superset of the tiles with a visible pair); with ``full_tiles`` it is marked full iff the key block ends
    before the query block starts, ``max lo_k <= min lo_q`` and ``max lo_q <= min hi_k`` (then every pair is
    visible; full implies listed). Without ``full_tiles`` no tile is marked and the lists are ascending."""
    B, L = lo_BxL.shape
    nq, nk = L // block_q, L // block_k
    lo_k, hi_k = lo_BxL.reshape(B, 1, nk, block_k), hi_BxL.reshape(B, 1, nk, block_k)
    lo_q = lo_BxL.reshape(B, nq, 1, block_q)
    klo_min, klo_max, khi_min, khi_max = lo_k.min(-1), lo_k.max(-1), hi_k.min(-1), hi_k.max(-1)  # [B, 1, nk]
    qlo_min, qlo_max = lo_q.min(-1), lo_q.max(-1)  # [B, nq, 1]
    first_q = (jnp.arange(nq) * block_q)[None, :, None]  # first / last position of a query block, key block
    last_q = first_q + block_q - 1
    first_k = (jnp.arange(nk) * block_k)[None, None, :]
    last_k = first_k + block_k - 1
    vis_BxQxK = (first_k <= last_q) & (klo_min <= qlo_max) & (qlo_min <= khi_max)
    full_BxQxK = (last_k <= first_q) & (klo_max <= qlo_min) & (qlo_max <= khi_min) & vis_BxQxK
    if not full_tiles:
        full_BxQxK = jnp.zeros_like(full_BxQxK)
    q_end = jnp.max(jnp.where(vis_BxQxK, jnp.arange(1, nq + 1)[None, :, None], 0), axis=1).astype(jnp.int32)
    return BlockTables(_tile_list(vis_BxQxK, full_BxQxK),
                       _tile_list(vis_BxQxK.swapaxes(1, 2), full_BxQxK.swapaxes(1, 2)), q_end)


def _io(hp: int, head_dim: int):
    """``(load, store)`` of ``[rows, hp]`` tiles whose last ``hp - head_dim`` columns are padding."""
    from jax.experimental.pallas import triton as plgpu

    head_mask = (jnp.arange(hp) < head_dim)[None, :]

    def store(ref, x):
        plgpu.store(ref.at[:, : x.shape[-1]], x.astype(ref.dtype), mask=head_mask)

    return (lambda ref: plgpu.load(ref, mask=head_mask, other=0.0)), store


def _fwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, o_ref, lse_ref, *, scale, block_q, block_k,
                head_dim, full_tiles):
    """Forward of query block ``i = program_id(0)``: the online softmax over its listed key blocks (full tiles
    first, unmasked, when ``full_tiles``; then the rest, masked, skipping tiles without a visible pair)::

        s = q k^T scale log2(e) (masked: -inf),  m' = max(m, rowmax s),  l' = 2^(m - m') l + rowsum 2^(s - m'),
        o' = 2^(m - m') o + 2^(s - m') v;   out = o / l,  lse = m + log2 l
    """
    from jax.experimental.pallas import triton as plgpu

    ld, store = _io(q_ref.shape[-1], head_dim)
    start_q = pl.program_id(0)
    q = ld(q_ref)
    q_slice = pl.ds(start_q * block_q, block_q)
    q_lo = lo_ref[q_slice]
    span_q = start_q * block_q + jnp.arange(block_q)

    def tile(start_k, carry, mask=None):
        """The online-softmax update by key block ``start_k`` (``mask=None``: a full tile)."""
        o_prev, m_prev, l_prev = carry
        k_slice = pl.ds(start_k * block_k, block_k)
        k = ld(k_ref.at[k_slice, :])
        qk = plgpu.dot(q, k.T) * (scale * _LOG2E)
        if mask is not None:
            qk = jnp.where(mask, qk, _MASK)
        m_next = jnp.maximum(m_prev, jnp.max(qk, axis=-1))
        correction = jnp.exp2(m_prev - m_next)
        s = jnp.exp2(qk - m_next[:, None])
        v = ld(v_ref.at[k_slice, :])
        o_next = correction[:, None] * o_prev + plgpu.dot(s.astype(v.dtype), v)
        return o_next, m_next, correction * l_prev + jnp.sum(s, axis=-1)

    def partial_tile(t, carry):
        start_k = kv_ref[t + 2]
        k_slice = pl.ds(start_k * block_k, block_k)
        mask = _visible(q_lo, span_q, lo_ref[k_slice], hi_ref[k_slice], start_k * block_k + jnp.arange(block_k))
        return lax.cond(_any(mask), functools.partial(tile, start_k, mask=mask), lambda c: c, carry)

    hp = q_ref.shape[-1]
    carry = (jnp.zeros((block_q, hp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    n_full = 0
    if full_tiles:
        n_full = kv_ref[1]
        carry = lax.fori_loop(0, n_full, lambda t, c: tile(kv_ref[t + 2], c), carry)
    o, m, l = lax.fori_loop(n_full, kv_ref[0], partial_tile, carry)  # the diagonal tile is always listed: l > 0
    o = o / l[:, None]
    lse_ref[...] = m + jnp.log2(l)
    store(o_ref, o)


def _dkdv_loop(q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, qtab_ref, start_k, *, scale,
               block_q, block_k, ld, full_tiles):
    """``(dk, dv)`` ``[block_k, hp]`` (fp32) of key block ``start_k`` over the query blocks that may see it::

        p_ij = 2^(s_ij log2 e - lse_i),  dv_j = sum_i p_ij do_i,  dk_j = scale sum_i p_ij (do_i . v_j - delta_i) q_i

    ``qtab_ref``: with ``full_tiles`` this key block's ``q_list`` row (full tiles first, unmasked), else the row's
    ``q_end`` (the range from the query block holding the key block's first position to ``q_end[start_k]``)."""
    from jax.experimental.pallas import triton as plgpu

    k_slice = pl.ds(start_k * block_k, block_k)
    k, v = ld(k_ref.at[k_slice, :]), ld(v_ref.at[k_slice, :])
    k_lo, k_hi = lo_ref[k_slice], hi_ref[k_slice]
    span_k = start_k * block_k + jnp.arange(block_k)

    def tile(start_q, carry, mask=None):
        dk, dv = carry
        q_slice = pl.ds(start_q * block_q, block_q)
        q = ld(q_ref.at[q_slice, :])
        qk = plgpu.dot(q, k.T) * (scale * _LOG2E)
        if mask is not None:
            qk = jnp.where(mask, qk, _MASK)
        p = jnp.exp2(qk - lse_ref[q_slice][:, None])
        do = ld(do_ref.at[q_slice, :])
        dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
        dp = plgpu.dot(do, v.T) - delta_ref[q_slice][:, None]
        ds = p * dp * scale
        return dk + plgpu.dot(ds.astype(q.dtype).T, q), dv

    def partial_tile(start_q, carry):
        q_slice = pl.ds(start_q * block_q, block_q)
        mask = _visible(lo_ref[q_slice], start_q * block_q + jnp.arange(block_q), k_lo, k_hi, span_k)
        return lax.cond(_any(mask), functools.partial(tile, start_q, mask=mask), lambda c: c, carry)

    zeros = jnp.zeros((block_k, k.shape[-1]), jnp.float32)
    if not full_tiles:
        first_q = start_k if block_q == block_k else lax.div(start_k * block_k, block_q)  # holds the key block's start
        return lax.fori_loop(first_q, qtab_ref[start_k], partial_tile, (zeros, zeros))
    n_full = qtab_ref[1]
    carry = lax.fori_loop(0, n_full, lambda t, c: tile(qtab_ref[t + 2], c), (zeros, zeros))
    return lax.fori_loop(n_full, qtab_ref[0], lambda t, c: partial_tile(qtab_ref[t + 2], c), carry)


def _dq_loop(q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, kv_ref, start_q, *, scale, block_q,
             block_k, ld, full_tiles):
    """``dq`` ``[block_q, hp]`` (fp32) of query block ``start_q`` over its listed key blocks (``kv_ref``: its
    ``kv_list`` row; full tiles first, unmasked, when ``full_tiles``)::

        dq_i = scale sum_j p_ij (do_i . v_j - delta_i) k_j
    """
    from jax.experimental.pallas import triton as plgpu

    q_slice = pl.ds(start_q * block_q, block_q)
    q, do = ld(q_ref.at[q_slice, :]), ld(do_ref.at[q_slice, :])
    lse, delta = lse_ref[q_slice], delta_ref[q_slice]
    q_lo = lo_ref[q_slice]
    span_q = start_q * block_q + jnp.arange(block_q)

    def tile(start_k, dq, mask=None):
        k_slice = pl.ds(start_k * block_k, block_k)
        k, v = ld(k_ref.at[k_slice, :]), ld(v_ref.at[k_slice, :])
        qk = plgpu.dot(q, k.T) * (scale * _LOG2E)
        if mask is not None:
            qk = jnp.where(mask, qk, _MASK)
        p = jnp.exp2(qk - lse[:, None])
        ds = p * (plgpu.dot(do, v.T) - delta[:, None]) * scale
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    def partial_tile(t, dq):
        start_k = kv_ref[t + 2]
        k_slice = pl.ds(start_k * block_k, block_k)
        mask = _visible(q_lo, span_q, lo_ref[k_slice], hi_ref[k_slice], start_k * block_k + jnp.arange(block_k))
        return lax.cond(_any(mask), functools.partial(tile, start_k, mask=mask), lambda d: d, dq)

    dq = jnp.zeros((block_q, q.shape[-1]), jnp.float32)
    n_full = 0
    if full_tiles:
        n_full = kv_ref[1]
        dq = lax.fori_loop(0, n_full, lambda t, d: tile(kv_ref[t + 2], d), dq)
    return lax.fori_loop(n_full, kv_ref[0], partial_tile, dq)


def _bwd_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, qtab_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref,
                dv_ref, *, scale, block, head_dim, full_tiles):
    """The fused backward of block ``i = program_id(2)`` (square tiles of ``block``): ``dk, dv`` of key block
    ``i`` (:func:`_dkdv_loop`), then ``dq`` of query block ``i`` (:func:`_dq_loop`)."""
    ld, store = _io(q_ref.shape[-1], head_dim)
    i = pl.program_id(2)
    refs = (q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref)
    kw = dict(scale=scale, block_q=block, block_k=block, ld=ld, full_tiles=full_tiles)
    dk, dv = _dkdv_loop(*refs, qtab_ref, i, **kw)
    store(dv_ref, dv)
    store(dk_ref, dk)
    store(dq_ref, _dq_loop(*refs, kv_ref, i, **kw))


def _dkdv_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, qtab_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 scale, block_q, block_k, head_dim, full_tiles):
    """Split backward: ``dk, dv`` of key block ``program_id(2)`` (:func:`_dkdv_loop`)."""
    ld, store = _io(q_ref.shape[-1], head_dim)
    dk, dv = _dkdv_loop(q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, qtab_ref,
                        pl.program_id(2), scale=scale, block_q=block_q, block_k=block_k, ld=ld, full_tiles=full_tiles)
    store(dv_ref, dv)
    store(dk_ref, dk)


def _dq_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, kv_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, block_q,
               block_k, head_dim, full_tiles):
    """Split backward: ``dq`` of query block ``program_id(2)`` (:func:`_dq_loop`)."""
    ld, store = _io(q_ref.shape[-1], head_dim)
    store(dq_ref, _dq_loop(q_ref, k_ref, v_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref, kv_ref, pl.program_id(2),
                           scale=scale, block_q=block_q, block_k=block_k, ld=ld, full_tiles=full_tiles))


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
    kernel = functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(H), block_q=bq, block_k=bk, head_dim=H,
                               full_tiles=blocks.full_tiles)
    kv_list = block_tables(lo, hi, bq, bk, blocks.full_tiles).kv_list
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


def _q_table(tables: BlockTables, full_tiles: bool):
    """The ``dk, dv`` loop's table and its spec on a ``(b, h, key block)`` grid (:func:`_dkdv_loop`)."""
    if full_tiles:
        return tables.q_list, pl.BlockSpec((None, None, tables.q_list.shape[-1]), lambda b, h, i: (b, i, 0))
    return tables.q_end, pl.BlockSpec((None, tables.q_end.shape[-1]), lambda b, h, i: (b, 0))


def _vjp_bwd(blocks, interpret, res, do):
    from jax.experimental.pallas import triton as plgpu

    q, k, v, lo, hi, out, lse = res
    B, L, Q, H = q.shape
    K = k.shape[2]
    G = Q // K
    hp = pl.next_power_of_2(H)
    full_tiles = blocks.full_tiles
    delta = jnp.einsum("blqh,blqh->bql", out.astype(jnp.float32), do.astype(jnp.float32))
    whole = lambda n: pl.BlockSpec((None, L, None, hp), lambda b, h, i, n=n: (b, 0, h // n, 0))  # noqa: E731
    row = pl.BlockSpec((None, L), lambda b, h, i: (b, 0))
    stat = pl.BlockSpec((None, None, L), lambda b, h, i: (b, h, 0))
    tile = lambda n: pl.BlockSpec((None, n, None, hp), lambda b, h, i: (b, i, h, 0))  # noqa: E731
    list_spec = lambda t: pl.BlockSpec((None, None, t.shape[-1]), lambda b, h, i: (b, i, 0))  # noqa: E731
    inputs = [whole(1), whole(G), whole(G), row, row]  # q, k, v, lo, hi
    grads = [whole(1), stat, stat]  # do, lse, delta
    params = plgpu.CompilerParams(num_warps=blocks.bwd_warps or blocks.num_warps or 4, num_stages=blocks.num_stages)
    scale = 1.0 / math.sqrt(H)
    f32 = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if not blocks.split_bwd:
        blk = _fit(blocks.block_bwd, L, "block_bwd")
        tables = block_tables(lo, hi, blk, blk, full_tiles)
        q_table, q_spec = _q_table(tables, full_tiles)
        dq, dk, dv = pl.pallas_call(
            functools.partial(_bwd_kernel, scale=scale, block=blk, head_dim=H, full_tiles=full_tiles),
            grid=(B, Q, L // blk),
            in_specs=inputs + [list_spec(tables.kv_list), q_spec] + grads,
            out_specs=[tile(blk)] * 3,
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), f32, f32],
            compiler_params=params,
            interpret=interpret,
            name="tree_flash_backward",
        )(q, k, v, lo, hi, tables.kv_list, q_table, do, lse, delta)
    else:
        (dq_q, dq_k), (dkv_k, dkv_q) = blocks.split_tiles(L)
        dq_tables = block_tables(lo, hi, dq_q, dq_k, full_tiles)
        dkv_tables = dq_tables if (dkv_q, dkv_k) == (dq_q, dq_k) else block_tables(lo, hi, dkv_q, dkv_k, full_tiles)
        kv_list = dq_tables.kv_list
        dq = pl.pallas_call(
            functools.partial(_dq_kernel, scale=scale, block_q=dq_q, block_k=dq_k, head_dim=H, full_tiles=full_tiles),
            grid=(B, Q, L // dq_q),
            in_specs=inputs + [list_spec(kv_list)] + grads,
            out_specs=tile(dq_q),
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            compiler_params=params,
            interpret=interpret,
            name="tree_flash_backward_dq",
        )(q, k, v, lo, hi, kv_list, do, lse, delta)
        q_table, q_spec = _q_table(dkv_tables, full_tiles)
        dk, dv = pl.pallas_call(
            functools.partial(_dkdv_kernel, scale=scale, block_q=dkv_q, block_k=dkv_k, head_dim=H,
                              full_tiles=full_tiles),
            grid=(B, Q, L // dkv_k),
            in_specs=inputs + [q_spec] + grads,
            out_specs=[tile(dkv_k)] * 2,
            out_shape=[f32, f32],
            compiler_params=params,
            interpret=interpret,
            name="tree_flash_backward_dkdv",
        )(q, k, v, lo, hi, q_table, do, lse, delta)
    group_sum = lambda x: x.reshape(B, L, K, G, H).sum(axis=3).astype(k.dtype)  # noqa: E731
    return dq, group_sum(dk), group_sum(dv), None, None


tree_flash_attention.defvjp(_vjp_fwd, _vjp_bwd)


def make_attention(node_lo_BxL, node_hi_BxL, blocks: TreeFlashBlocks | None = None, interpret: bool = False):
    """``attend(q, k, v)`` closure for :func:`treejax.models.tree_attention.make_tree_attention` (``blocks``
    default: :func:`default_blocks` of the head size and row length)."""
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)
    return lambda q, k, v: tree_flash_attention(q, k, v, lo, hi, blocks or default_blocks(q.shape[-1], q.shape[1]),
                                                interpret)
