"""Decode attention over the per-row KV cache ``[B, K, L, H]`` on TPU (Pallas / Mosaic; Pallas' interpreters elsewhere).

One program per (row ``b``, KV head ``k``) holds the ``G`` query heads of that KV head (grouped-query attention:
query head ``k G + g`` reads KV head ``k``) and walks the row's KV blocks of ``block_k`` slots with an online
softmax (Milakov & Gimelshein 2018; FlashAttention's decode form), fp32 statistics in VMEM scratch::

    s   = q k_t^T / sqrt(H)        fp32; slots >= length_b masked
    m'  = max(m, rowmax s),   p = e^{s - m'},   l' = e^{m - m'} l + rowsum p,   acc' = e^{m - m'} acc + p v_t
    o   = acc / l,   lse = m + log l         (after the last block; o = 0, lse = -inf for a row of length 0)

so the kernel returns the log-sum-exp of the scores with the output, which the shared-prefix cascade
(:func:`treejax.sampling.attention.cascade_decode_attention`) needs to merge its prefix and suffix passes.

**Block skipping.** The row lengths are passed by *scalar prefetch* (SMEM). The grid's last axis has ``L /
block_k`` steps; step ``t`` of row ``b`` reads KV block ``min(t, last_b)``, ``last_b = max(ceil(length_b /
block_k) - 1, 0)`` (:func:`kv_block_index`): past the row's last live block the block index repeats, so the
pipeline issues no copy for it, and the body is skipped (``pl.when(t * block_k < length_b)``). HBM traffic per row
and KV head is ``ceil(length_b / block_k)`` blocks, not ``L / block_k``: cost follows each row's own length. The
skipped steps still cost a grid step's overhead each (no copy or compute).

**Layout.** The cache is read in place: blocks ``(block_k, H)`` of ``k_cache[b, k]`` (``H`` the full last dim;
``block_k`` a multiple of 128 on a TPU, since it is the lane dim of the ``[G, block_k]`` score tile; of 8 in the
interpreter). Queries enter as ``[B, K, G, H]`` (``G`` the full dim), outputs leave as fp32 ``[B, K, G, H]`` and
``lse [B, K, G, 1]``. Scores and ``p v`` accumulate in fp32 (``preferred_element_type``); ``p`` is cast to the
cache dtype before the ``p v`` product (bf16 on the MXU for a bf16 cache); a float32 cache gets both dots at
``Precision.HIGHEST`` (Mosaic's ``contract_precision<fp32>``), not Mosaic's default.

Why not JAX's ``ragged_paged_attention`` (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``): it takes
one paged array ``[pages, page_size, 2 K, H]`` with keys and values interleaved per head, token-major, and
returns no log-sum-exp. treejax's cache is two arrays ``[B, K, L, H]``, heads-major (the layout prefill, forking
and sharding share), so using it would mean writing an interleaved copy of every layer's whole cache at every step
(more bytes than the dense path reads), and the cascade could not use it. The older
``paged_attention`` kernel takes ``[K, pages, page_size, H]`` (KV heads outside the rows): again a copy.

Status: checked in Pallas' TPU interpreter (``interpret=True``; tests/sampling/test_tpu_attention.py) and lowered
for the TPU platform through ``jax.export`` (Pallas' Mosaic lowering; Mosaic's own compile runs only on a TPU). It
has not been compiled by Mosaic on a chip, run on TPU hardware or benchmarked there; ``block_k`` is not tuned.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128  #: a TPU vreg's lanes: on a TPU ``block_k`` must be a multiple of it
INTERPRET_BLOCK_MULTIPLE = 8  #: ``block_k``'s multiple in the interpreter (short test caches)
#: Cache dtypes the kernel takes (float16: no native TPU matmul path; not tried) and the head-size multiple.
TPU_CACHE_DTYPES = ("bfloat16", "float32")
TPU_HEAD_MULTIPLE = 64
INTERPRET_MODES = (False, True, "tpu", "hlo")
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: finite, so e^{_MASK - m} = 0 without inf - inf
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def kv_block_index(t, length, block_k: int):
    """KV block read at grid step ``t`` of a row of ``length`` live slots: ``min(t, last)``, ``last =
    max(ceil(length / block_k) - 1, 0)``. Past ``last`` the index repeats, so no block past the row's length is
    copied (block 0 is the one copy of a row of length 0)."""
    last = jnp.maximum(lax.div(length + block_k - 1, block_k) - 1, 0)
    return jnp.minimum(t, last)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, scale, block_k, steps,
                   precision):
    """Row ``program_id(0)``, KV head ``program_id(1)``, KV block step ``t = program_id(2)`` (module docstring).
    Tiles: ``q [G, H]``, ``k, v [block_k, H]``, scratch ``m, l [G, 128]`` (all lanes equal), ``acc [G, H]``."""
    b, t = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(t == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _MASK, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(t * block_k < length)
    def _block():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = lax.dot_general(q, k, _NT, precision=precision, preferred_element_type=jnp.float32) * scale
        valid = t * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1) < length
        s = jnp.where(valid, s, _MASK)
        m_prev, l_prev = m_scr[...], l_scr[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(valid, jnp.exp(s - m_next[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_scr[...] = m_next
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, precision=precision, preferred_element_type=jnp.float32)
        acc_scr[...] = alpha[:, :1] * acc_scr[...] + pv

    @pl.when(t == steps - 1)
    def _end():
        l, m = l_scr[...][:, :1], m_scr[...][:, :1]
        nonempty = l > 0
        safe_l = jnp.where(nonempty, l, 1.0)
        o_ref[...] = acc_scr[...] / safe_l
        lse_ref[...] = jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)


def _interpret_arg(interpret):
    """``pallas_call``'s ``interpret`` for this kernel's flag: ``True`` / ``"tpu"`` Pallas' TPU interpreter,
    ``"hlo"`` the generic one, ``False`` compiled for a TPU."""
    if interpret is True or interpret == "tpu":
        return pltpu.InterpretParams()
    return interpret == "hlo"


def block_multiple(interpret) -> int:
    """``block_k``'s required multiple: the 128 lanes compiled for a TPU, 8 in an interpreter."""
    return NUM_LANES if interpret is False else INTERPRET_BLOCK_MULTIPLE


def tpu_block(L: int, block_size: int, interpret=False) -> int:
    """The kernel's KV block for a cache of ``L`` slots: the largest ``b <= min(block_size, L)`` that divides ``L``
    and is a multiple of :func:`block_multiple`; ``ValueError`` (naming the fix) if there is none."""
    multiple = block_multiple(interpret)
    b = min(block_size, L) // multiple * multiple
    while b >= multiple and L % b:
        b -= multiple
    if b < multiple:
        raise ValueError(f"TPU decode attention: cache length {L} has no KV block that divides it, is at most "
                         f"block_size={block_size} and is a multiple of {multiple}; allocate caches in multiples of "
                         f"{multiple} (the sampler's block_size)")
    return b


def _check(q_BxKxGxH, k_BxKxLxH, v_BxKxLxH, length_B, interpret):
    """``ValueError`` (one line) for inputs the kernel cannot run."""
    if not any(type(interpret) is type(m) and interpret == m for m in INTERPRET_MODES):
        raise ValueError(f"TPU decode attention: interpret={interpret!r} is not one of {INTERPRET_MODES}; pass False "
                         "(TPU), True / 'tpu' (TPU interpreter) or 'hlo' (generic interpreter)")
    if q_BxKxGxH.ndim != 4 or k_BxKxLxH.ndim != 4 or k_BxKxLxH.shape != v_BxKxLxH.shape:
        raise ValueError(f"TPU decode attention: q {q_BxKxGxH.shape} must be [B, K, G, H] and k {k_BxKxLxH.shape}, "
                         f"v {v_BxKxLxH.shape} one shape [B, K, L, H]")
    B, K, _, H = q_BxKxGxH.shape
    if k_BxKxLxH.shape[:2] != (B, K) or k_BxKxLxH.shape[3] != H:
        raise ValueError(f"TPU decode attention: q {q_BxKxGxH.shape} and k {k_BxKxLxH.shape} must share B, K and H")
    if length_B.shape != (B,):
        raise ValueError(f"TPU decode attention: lengths {length_B.shape} must be [B] = ({B},)")
    if not (q_BxKxGxH.dtype == k_BxKxLxH.dtype == v_BxKxLxH.dtype):
        raise ValueError(f"TPU decode attention: q, k and v must share a dtype, got {q_BxKxGxH.dtype}, "
                         f"{k_BxKxLxH.dtype}, {v_BxKxLxH.dtype}; cast q to the cache dtype")
    if k_BxKxLxH.dtype.name not in TPU_CACHE_DTYPES:
        raise ValueError(f"TPU decode attention: cache dtype {k_BxKxLxH.dtype.name} is not one of {TPU_CACHE_DTYPES}")


def tpu_attention_lse(q_BxKxGxH: jax.Array, k_BxKxLxH: jax.Array, v_BxKxLxH: jax.Array, length_B: jax.Array, *,
                      block_k: int, interpret: bool | str = False) -> tuple[jax.Array, jax.Array]:
    """Attention of row ``b``'s ``G`` queries per KV head over slots ``0..length_B[b] - 1``, with its log-sum-exp::

        s_j = q . k_j / sqrt(H),   lse = log sum_{j < length} e^{s_j},   o = sum_{j < length} e^{s_j - lse} v_j

    ``q_BxKxGxH``: unscaled queries in the cache dtype (the kernel scales the fp32 scores); lengths are clipped to
    ``[0, L]``; a row of length 0 gets ``o = 0``, ``lse = -inf`` (weight 0 in
    :func:`treejax.sampling.attention.merge_attention`). ``block_k`` must divide ``L`` and be a multiple of
    :func:`block_multiple` (:func:`tpu_block` picks one). Returns fp32 ``(o_BxKxGxH, lse_BxKxG)``.
    """
    _check(q_BxKxGxH, k_BxKxLxH, v_BxKxLxH, length_B, interpret)
    B, K, G, H = q_BxKxGxH.shape
    L = k_BxKxLxH.shape[2]
    multiple = block_multiple(interpret)
    if block_k <= 0 or L % block_k or block_k % multiple:
        raise ValueError(f"TPU decode attention: block_k={block_k} must divide the cache length {L} and be a "
                         f"multiple of {multiple}; tpu_attention.tpu_block({L}, block_size) picks one")
    steps = L // block_k
    length_B = jnp.clip(length_B.astype(jnp.int32), 0, L)
    precision = lax.Precision.HIGHEST if k_BxKxLxH.dtype == jnp.float32 else None
    q_spec = pl.BlockSpec((None, None, G, H), lambda b, h, t, lens: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, H),
                           lambda b, h, t, lens: (b, h, kv_block_index(t, lens[b], block_k), 0))
    lse_spec = pl.BlockSpec((None, None, G, 1), lambda b, h, t, lens: (b, h, 0, 0))
    kernel = functools.partial(_decode_kernel, scale=1.0 / math.sqrt(H), block_k=block_k, steps=steps,
                               precision=precision)
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, K, steps),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=[pltpu.VMEM((G, NUM_LANES), jnp.float32), pltpu.VMEM((G, NUM_LANES), jnp.float32),
                            pltpu.VMEM((G, H), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((B, K, G, H), jnp.float32), jax.ShapeDtypeStruct((B, K, G, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="treejax_tpu_decode_attention",
    )(length_B, q_BxKxGxH, k_BxKxLxH, v_BxKxLxH)
    return o, lse[..., 0]


def grouped_decode_query(q: jax.Array, k_cache: jax.Array, positions: jax.Array, kernel: str):
    """``(q_BxKxGxH, length_B)`` of a per-row decode call (shared by this kernel and the Mosaic GPU one): ``q [B, 1,
    Q, H]`` grouped by KV head and cast to the cache dtype, and each row's live length ``positions[b] + 1`` (0 for a
    dead row, ``positions[b] >= L``). ``kernel`` names the caller in the errors."""
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"decode attention expects q [B, 1, Q, H], got {q.shape}")
    B, _, Q, H = q.shape
    K, L = k_cache.shape[1], k_cache.shape[2]
    if Q % K:
        raise ValueError(f"{kernel} decode attention: {Q} query heads are not a multiple of {K} KV heads")
    q_BxKxGxH = q[:, 0].reshape(B, K, Q // K, H).astype(k_cache.dtype)
    return q_BxKxGxH, jnp.where(positions < L, positions + 1, 0)


def tpu_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, *,
                         block_size: int = 256, interpret: bool | str = False) -> jax.Array:
    """The sampler's per-row decode attention hook (``q [B, 1, Q, H]``, caches ``[B, K, L, H]``, ``positions
    [B]`` -> ``[B, 1, Q, H]`` in ``q``'s dtype) through :func:`tpu_attention_lse`: row ``b`` attends to slots
    ``0..positions[b]``; a dead row (``positions[b] >= L``) reads no slot and gets 0. ``q`` is cast to the cache
    dtype; the KV block is :func:`tpu_block` of ``L`` and ``block_size``."""
    q_BxKxGxH, length_B = grouped_decode_query(q, k_cache, positions, "TPU")
    B, _, Q, H = q.shape
    L = k_cache.shape[2]
    o, _ = tpu_attention_lse(q_BxKxGxH, k_cache, v_cache, length_B, block_k=tpu_block(L, block_size, interpret),
                             interpret=interpret)
    return o.reshape(B, 1, Q, H).astype(q.dtype)
