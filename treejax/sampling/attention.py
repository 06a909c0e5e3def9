"""Decode attention over a per-layer KV cache ``[B, K, L, H]``: cost follows the longest *live* row.

One decode step of row ``b`` attends its query ``q_b`` to cache slots ``0..pos_b``. The cache is allocated for the
longest possible rollout (``L`` slots), so a plain masked attention reads all ``L`` slots of every row at every
step. Three implementations share the ``attention_fn`` hook of :func:`treejax.models.transformer.decode_step`
(``fn(q [B, 1, Q, H], k_cache [B, K, L, H], v_cache [B, K, L, H], positions [B]) -> [B, 1, Q, H]``):

* ``"ragged"`` (XLA, any backend): slots are visited in blocks of ``C`` with an online (streaming) softmax
  (Milakov & Gimelshein 2018; FlashAttention's decode form)::

      for blocks i = 0 .. n-1,  n = floor(max_b pos_b / C) + 1   (a dynamic trip count: lax.fori_loop)
          s   = q k_i^T / sqrt(H)          masked to slots <= pos_b
          m'  = max(m, max s);   l = l e^{m - m'} + sum e^{s - m'};   acc = acc e^{m - m'} + e^{s - m'} v_i
      out = acc / l

  so the KV bytes read per step are ``n * C`` slots per row instead of ``L``.
* ``"pallas"`` (GPU): JAX's Pallas/Triton split-K decode kernel (``jax.experimental.pallas.ops.gpu``) with the
  per-row length ``pos_b + 1``: blocks past a row's length are skipped, so cost follows each row's own length.
* ``"dense"``: masked attention over the whole cache (the reference).

Rows with ``pos_b >= L`` are *dead* (their key/value write is dropped by the caller); they are excluded from the
ragged bound. Scores and the softmax statistics are fp32; ``L`` must be a multiple of the block size (the sampler
allocates caches that way, :func:`round_cache_length`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

ATTENTION_IMPLS = ("ragged", "pallas", "dense", "auto")


def round_cache_length(length: int, block_size: int) -> int:
    """Smallest multiple of ``block_size`` that is ``>= length``."""
    return -(-length // block_size) * block_size


def _check(q, k_cache):
    if q.shape[1] != 1:
        raise ValueError(f"decode attention expects one query per row, got q of shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"k_cache must be [B, K, L, H] with B = {q.shape[0]}, got {k_cache.shape}")


def ragged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                            block_size: int = 256) -> jax.Array:
    """Online-softmax decode attention over KV blocks up to the maximum live position (module docstring)."""
    _check(q, k_cache)
    B, _, Q, H = q.shape
    K, L = k_cache.shape[1], k_cache.shape[2]
    C = min(block_size, L)
    if L % C:
        raise ValueError(f"cache length {L} must be a multiple of the attention block size {C}")
    G = Q // K
    qg = (q[:, 0].reshape(B, K, G, H).astype(jnp.float32) / math.sqrt(H)).astype(k_cache.dtype)
    live = positions < L
    max_pos = jnp.max(jnp.where(live, positions, 0))
    num_blocks = max_pos // C + 1

    def body(i, carry):
        m, l, acc = carry
        start = i * C
        kb = lax.dynamic_slice_in_dim(k_cache, start, C, axis=2)  # [B, K, C, H]
        vb = lax.dynamic_slice_in_dim(v_cache, start, C, axis=2)
        s = jnp.einsum("bkgh,bkch->bkgc", qg, kb, preferred_element_type=jnp.float32)
        slot = start + jnp.arange(C)
        valid = (slot[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, C]
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        scale = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgc,bkch->bkgh", p.astype(vb.dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((B, K, G), -jnp.inf, jnp.float32), jnp.zeros((B, K, G), jnp.float32),
            jnp.zeros((B, K, G, H), jnp.float32))
    m, l, acc = lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(B, 1, Q, H).astype(q.dtype)


def pallas_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                            block_size: int = 128, k_splits: int | None = None, interpret: bool = False,
                            target_programs: int = 512) -> jax.Array:
    """GPU decode attention through JAX's Pallas (Triton) split-K kernel, per-row length ``positions + 1``.

    The kernel takes ``[B, L, K, H]`` and swaps to heads-major internally; passing our ``[B, K, L, H]`` buffers
    swapped makes the two transposes cancel, so no copy of the cache is made. The grid is rows x KV heads x
    splits; ``k_splits`` (default: ``ceil(target_programs / (B K))``, at most 16) splits each row's slots only
    when rows are too few to fill the GPU: measured on an H200 (qwen2.5-0.5b cache, 2048 live slots), one split
    ran 256 rows in 75-77 us vs 82 us with 9 splits, and 1024 rows in 255-263 us vs 273 us.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_ops

    _check(q, k_cache)
    B, K, L = k_cache.shape[:3]
    if k_splits is None:
        k_splits = min(16, max(1, -(-target_programs // (B * K))))
    splits, block = _pallas_tiling(L, block_size, k_splits)
    live = positions < L
    lengths = jnp.where(live, positions + 1, 1)
    out = pallas_ops.gqa(q[:, 0], jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2), kv_seq_len=lengths,
                         k_splits=splits, block_k=block, interpret=interpret)
    return out[:, None].astype(q.dtype)


def _pallas_tiling(L: int, block_size: int, k_splits: int) -> tuple[int, int]:
    """``(splits, block)`` with ``L == splits * block * n``: block a power of two in [16, block_size], splits any
    divisor of ``L / block`` up to ``k_splits``.

    The first (largest) block that allows at least ``k_splits / 2`` splits wins, else the most splits: few splits
    leave the GPU idle when rows are few (e.g. the sampler's 2304-slot caches = 18 blocks of 128 -> 9 splits; a
    power-of-two-only rule gave 2).
    """
    block = 1 << (max(16, min(block_size, L)).bit_length() - 1)
    best = None
    while block >= 16:
        if L % block == 0:
            n = L // block
            splits = max(d for d in range(1, min(k_splits, n) + 1) if n % d == 0)
            if 2 * splits >= k_splits:
                return splits, block
            if best is None or splits > best[0]:
                best = (splits, block)
        block //= 2
    if best is None:
        raise ValueError(f"cache length {L} must be a multiple of 16 for the Pallas decode kernel")
    return best


def dense_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """Reference: masked attention over the whole cache (reads all ``L`` slots every step)."""
    from treejax.models.transformer import windowed_decode_attention

    _check(q, k_cache)
    return windowed_decode_attention(q, k_cache, v_cache, positions)


def resolve_impl(name: str) -> str:
    """``"auto"`` -> ``"pallas"`` on GPU, ``"ragged"`` elsewhere."""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {name!r}")
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "ragged"
    return name


def make_decode_attention(name: str = "auto", block_size: int = 256):
    """The ``attention_fn`` named ``name`` (see module docstring)."""
    impl = resolve_impl(name)
    if impl == "ragged":
        return functools.partial(ragged_decode_attention, block_size=block_size)
    if impl == "pallas":
        return functools.partial(pallas_decode_attention, block_size=min(block_size, 128))
    return dense_decode_attention

