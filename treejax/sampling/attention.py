"""Decode attention over a per-layer KV cache ``[B, K, L, H]``: cost follows the longest *live* row.

One decode step of row ``b`` attends its query ``q_b`` to cache slots ``0..pos_b``. The cache is allocated for the
longest possible rollout (``L`` slots), so a plain masked attention reads all ``L`` slots of every row at every
step. Five implementations share the ``attention_fn`` hook of :func:`treejax.models.transformer.decode_step`
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
  jax 0.11 deprecates that module (a ``DeprecationWarning`` at import) and Pallas' Triton backend with it.
* ``"pallas_mgpu"`` (Hopper GPU): treejax's Pallas **Mosaic GPU** kernel, :mod:`treejax.sampling.mgpu_attention`,
  the Triton path's successor: one program per (row, KV head) with that KV head's ``G`` query heads zero-padded to
  the 64 rows of a wgmma, the row's KV blocks TMA-pipelined over a dynamic trip count ``ceil((pos_b + 1) /
  block)`` (blocks past a row's last live block are neither loaded nor computed; a dead row loads none), the
  online softmax in fp32 registers, the log-sum-exp returned with the output. Tested in Mosaic GPU's interpret
  mode on CPU, lowered for the ``cuda`` platform, and compiled on an H200 against the Triton kernel and the dense
  path (tests/sampling/test_mgpu_attention.py); there it ran slower than the Triton kernel (0.76-0.90x alone), so
  ``"auto"`` picks it only where the Triton kernel is gone from JAX (below).
* ``"pallas_tpu"`` (TPU): treejax's Pallas TPU (Mosaic) kernel, :mod:`treejax.sampling.tpu_attention`: one
  program per (row, KV head) with that KV head's ``G`` query heads, the row lengths ``pos_b + 1`` scalar-prefetched
  so the KV block index stops at each row's last live block (blocks past it are neither copied nor computed), the
  same online softmax in fp32 VMEM scratch, and the log-sum-exp returned with the output. It reads the
  ``[B, K, L, H]`` cache in place; JAX's ``ragged_paged_attention`` would need an interleaved, token-major paged
  copy of the cache every step and returns no log-sum-exp (that module's docstring). Tested in Pallas' TPU
  interpreter and lowered for the TPU platform (``jax.export``); not yet compiled by Mosaic or run on TPU hardware.
* ``"dense"``: masked attention over the whole cache (the reference).

Shared-prefix caches (``TreeConfig.prefix_cache = "shared"``, :class:`treejax.sampling.cache.SharedPrefixCache`)
take :func:`cascade_decode_attention` instead: a prefix pass per prompt (queries grouped by prompt, so each
prompt's KV is read once per step) and a suffix pass per row, each returning its log-sum-exp, merged exactly
(:func:`merge_attention`). The two passes run as the per-row implementation does (:func:`resolve_cascade_impl`):
the Pallas kernel where the per-row attention resolved to ``"pallas"`` (``gqa(..., return_residuals=True)``
returns the softmax statistics ``(l, m)``, so ``lse = m + log l``: :func:`_pallas_attention_lse`), the TPU kernel
where it resolved to ``"pallas_tpu"`` (it returns ``lse`` itself: :func:`_tpu_cascade_passes`; the prefix pass
holds a prompt's ``W G`` queries of a KV head in one program), the Mosaic GPU kernel where it resolved to
``"pallas_mgpu"`` (it returns ``lse`` too: :func:`_mgpu_cascade_passes`; the prefix pass holds up to 128 of a
prompt's ``W G`` queries of a KV head in one program), the ragged online-softmax loop otherwise
(:func:`_ragged_attention_lse`). The prefix pass puts all ``W G`` queries of a
prompt's KV head into one program where it can (``block_h``, :func:`default_prefix_block_h`): the kernel pads
the heads of a (row, KV head) to ``block_h`` and reads the row's KV once per ``block_h`` heads.

Rows with ``pos_b >= L`` are *dead* (their key/value write is dropped by the caller); they are excluded from the
ragged bound. Scores and the softmax statistics are fp32; ``L`` must be a multiple of the block size (the sampler
allocates caches that way, :func:`round_cache_length`). Every implementation casts ``q`` to the cache dtype
before the score matmul and returns ``q``'s dtype (a float32 model may keep a bfloat16 cache; Triton's dot
rejects mixed operands: "a and b must have the same element type", ``jax/_src/pallas/triton/lowering.py``
l. 2431-2435 in jax 0.10.2).

Choosing the implementation (:func:`resolve_impl`, once, when the sampler is built)
----------------------------------------------------------------------------------
``"auto"`` takes ``"pallas"`` on a GPU where all of the kernel's constraints hold and the cache is 16-bit,
``"pallas_tpu"`` on a TPU where all of the TPU kernel's constraints hold and the cache is bfloat16, ``"ragged"``
otherwise (CPU, other head sizes, float32 caches); a forced ``"pallas"``, ``"pallas_mgpu"`` or ``"pallas_tpu"``
whose constraints do not hold raises a ``ConfigError`` (a ``ValueError``) then, not inside a trace. ``"auto"``
takes ``"pallas_mgpu"`` on a GPU only where this JAX no longer ships the Triton kernel
(:func:`triton_decode_available`; it was deprecated in jax 0.11): on an H200 the Mosaic GPU kernel ran at
0.76-0.90x of the Triton kernel's speed alone and 0.93-1.00x of its decode step (docs/performance.md).

On a TPU, ``"auto"`` picks a kernel that has run only in Pallas' TPU interpreter: the issue asked that the decode
path on a TPU use a TPU kernel, and the kernel passes Pallas' Mosaic lowering for the TPU platform (block shapes,
scalar prefetch, in-kernel ops; tests/sampling/test_tpu_attention.py), but Mosaic's own compile and the kernel's
speed have not been checked on a chip. If it fails to compile there, ``attention="ragged"``
(``make_model_fns``; ``RunConfig.decode_attention`` for training runs) is the exact XLA fallback. (The packed
update's TPU tree kernel is stricter: its ``"auto"`` keeps XLA on a TPU, :mod:`treejax.models.tree_attention`.)

The TPU kernel's constraints (:func:`tpu_problem`):

* the backend a TPU, or ``interpret=True`` (Pallas' TPU interpreter, any backend: how the tests run it).
* head size ``H`` a multiple of 64. Pallas' lowering takes any ``H`` (the K/V block's last dim is the full head),
  but ``H`` is the lane dim of every K/V tile: 64 fills half of the 128 lanes (qwen2.5-0.5b, smollm2), multiples
  of 128 fill them; 24, 80, 96, ... would pad lanes and have not been tried, so they take ``"ragged"``.
* cache dtype bfloat16 or float32 (float16 has no native TPU matmul path; not tried). A float32 cache gets both
  dots at ``Precision.HIGHEST`` (Mosaic's fp32 contract precision); ``"auto"`` leaves float32 caches to
  ``"ragged"`` as on the GPU (the fp32 kernel was never timed).
* ``block_size`` a multiple of 128 (8 in the interpreter): the KV block (:func:`treejax.sampling.tpu_attention.
  tpu_block`, the largest such divisor of the cache length up to ``block_size``) is the lane dim of the
  ``[G, block]`` score tile.
* any number of query heads per KV head (``Q % K == 0``) and of KV heads.

The GPU kernel's constraints (:func:`pallas_problem`):

* head size ``H`` a power of two in [16, 256]. The kernel loads ``[16, H]`` query and ``[block, H]`` K/V tiles,
  and the Triton lowering needs every array size to be a power of two (``lowering.py`` l. 286-300); heads below
  16 are left out (a dot shallower than the 16-deep bf16 tensor-core tile; not tried). Non-power-of-two heads
  (24, 80, 96, ...) take ``"ragged"``.
  Padding them instead (q, k, v zero-padded to the next power of two ``H'``, ``sm_scale = 1/sqrt(H)``, output
  sliced) is exact, but the cache is ``[B, K, L, H]`` in HBM, so the padded K/V is a fresh copy of every layer's
  whole cache at every step: it reads ``L H`` and writes ``L H'`` values per row and KV head whatever the live
  length, more bytes than the dense path reads, where both kernels exist to read only live slots. Allocating
  the cache padded avoids the copy but changes the layout that prefill, forking and sharding share and wastes
  ``(H' - H) / H`` of the cache (33% at 24 and 96, 60% at 80). The exact ragged path is the simpler correct
  choice; its GPU speed against a padded kernel is for a measurement to settle.
* the cache length a multiple of 16 (``block_size % 16 == 0``; caches are allocated in multiples of it): the
  kernel's split length and block must be >= 16 (``decode_attention.py`` l. 157-169).
* cache dtype bfloat16, float16 or float32. ``pl.dot`` takes ``precision=`` or ``allow_tf32=``
  (``jax/_src/pallas/primitives.py`` l. 503-543) but the kernel passes neither
  (``jax/experimental/pallas/ops/gpu/decode_attention.py`` l. 55-59), so ``lax.dot_general`` takes
  ``jax.default_matmul_precision`` at trace time (``jax/_src/lax/lax.py`` l. 9555-9559), and the Triton lowering
  turns precision DEFAULT/HIGH on float32 operands into TF32 (``lowering.py`` l. 2316, 2358-2359, 2389-2390):
  with the default setting a float32 cache would silently get TF32 scores and outputs. :func:`pallas_decode_attention`
  therefore traces the kernel under ``default_matmul_precision("highest")``, which the lowering maps to IEEE fp32
  for float32 operands and to the native dot for 16-bit ones (l. 2391-2394): a forced ``"pallas"`` is exact
  in fp32. ``"auto"`` still gives float32 caches ``"ragged"``: the IEEE-fp32 Triton dot (no tensor cores) was never
  timed or run on the GPU here, and the XLA path's fp32 matmuls follow the precision policy like the rest of the
  model.
* any number of query heads per KV head (the kernel masks its 16-row query tile) and of KV heads.

The Mosaic GPU kernel's constraints (:func:`mgpu_problem`; :mod:`treejax.sampling.mgpu_attention` says why):

* the backend a GPU (a Hopper one: compute capability 9.0, TMA and wgmma; checked where a GPU is present), or
  ``interpret=True`` (Mosaic GPU's interpret mode, any backend: how the tests run it).
* head size ``H`` 64 or 128 (the swizzled SMEM tiles' width and the wgmma depth; 256 would not fit SMEM with the
  kernel's fp32 output tile; other sizes take ``"ragged"`` or ``"pallas"``).
* cache dtype bfloat16 or float16 (wgmma takes 16-bit operands; float32 only in interpret mode).
* ``block_size`` a multiple of 64: the KV block (:func:`treejax.sampling.mgpu_attention.mgpu_block`, 128 or 64 slots)
  must divide the cache length.
* any number of query heads per KV head (padded to 64-row query tiles) and of KV heads.

K/V tiles of the kernel are capped at :data:`PALLAS_TILE_BYTES` (``block * H * itemsize``), the largest tile it
was measured with (bfloat16, ``H`` = 128, 128 slots: qwen2.5-1.5b on an H200): larger heads or a float32 cache get
shorter blocks instead of larger tiles.

On a device mesh (:func:`shard_decode_attention`)
-------------------------------------------------
XLA's SPMD partitioner cannot split a Pallas custom call (Triton on GPU, Mosaic on TPU): given a cache sharded
over rows it gathers the whole cache onto every device and runs the kernel replicated -- correct, but every device
then reads every row's KV, so more devices decode no faster. The sampler therefore wraps the kernel in
``jax.shard_map`` over the cache's own sharding (rows over ``data x fsdp``, KV heads over ``tensor``, the query
heads with their KV heads): each device runs the kernel on its rows and heads, and the attention is per row and
per KV-head group, so the result is exactly the unsharded one. ``"pallas_tpu"`` and ``"pallas_mgpu"`` take the
same wrapper. The XLA paths (``ragged``, ``dense``) are partitioned by GSPMD and need no wrapper.
The cascade has no such wrapper (a row's prompt prefix need not sit on the row's shard: rows are permuted and
sliced), so on a mesh of more than one device it takes the XLA passes (:func:`resolve_cascade_impl`).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from treejax.errors import ConfigError
from treejax.models.dense_attention import windowed_decode_attention
from treejax.parallel.axis_rules import DEFAULT_RULES
from treejax.parallel.mesh import rows_and_heads
from treejax.sampling import mgpu_attention as mgpu_lib
from treejax.sampling import tpu_attention as tpu_lib

ATTENTION_IMPLS = ("ragged", "pallas", "pallas_mgpu", "pallas_tpu", "dense", "auto")
#: ``cascade`` choices (:func:`resolve_cascade_impl`; "auto": the kernel's passes where the per-row attention is a
#: kernel, ``"pallas"``, ``"pallas_mgpu"`` or ``"pallas_tpu"``).
CASCADE_IMPLS = ("auto", "xla")
#: Head sizes and cache dtypes the Pallas kernel takes, and its K/V tile cap in bytes (module docstring).
PALLAS_HEAD_DIMS = (16, 32, 64, 128, 256)
PALLAS_CACHE_DTYPES = ("bfloat16", "float16", "float32")
PALLAS_TILE_BYTES = 128 * 128 * 2
#: The passes :func:`cascade_decode_attention` can run (:func:`resolve_cascade_impl` picks one).
CASCADE_PASSES = ("xla", "pallas", "pallas_mgpu", "pallas_tpu")
#: The per-row kernels, each with cascade passes of its own (:func:`resolve_cascade_impl`).
KERNEL_IMPLS = ("pallas", "pallas_mgpu", "pallas_tpu")


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
    out, _ = _ragged_attention_lse(qg, k_cache, v_cache, positions, C)
    return out.reshape(B, 1, Q, H).astype(q.dtype)


def _ragged_attention_lse(qg_BxKxGxH: jax.Array, k_BxKxLxH: jax.Array, v_BxKxLxH: jax.Array, last_B: jax.Array,
                          C: int) -> tuple[jax.Array, jax.Array]:
    """The online-softmax loop of :func:`ragged_decode_attention`, also returning the log-sum-exp.

    ``qg_BxKxGxH``: the queries already scaled by ``1/sqrt(H)`` and cast to the cache dtype (``G`` queries per KV
    head; any number). Query row ``b`` attends to slots ``0..last_B[b]`` (``last_B[b] < 0``: none; ``>= L``: a
    dead row, also none, and excluded from the loop bound). Returns fp32 ``(o_BxKxGxH, lse_BxKxG)``::

        s_j = q . k_j,   lse = log sum_{j <= last} e^{s_j},   o = sum_j e^{s_j - lse} v_j

    (``o = 0`` and ``lse = -inf`` for a row with no slot), so two partial attentions over disjoint slot sets merge
    exactly (:func:`merge_attention`). ``L`` must be a multiple of ``C``.
    """
    B, K, G, H = qg_BxKxGxH.shape
    L = k_BxKxLxH.shape[2]
    live = last_B < L
    max_pos = jnp.max(jnp.where(live, last_B, 0))
    num_blocks = max_pos // C + 1  # 0 when every row's last slot is -1 (floor division)

    def body(i, carry):
        m, l, acc = carry
        start = i * C
        kb = lax.dynamic_slice_in_dim(k_BxKxLxH, start, C, axis=2)  # [B, K, C, H]
        vb = lax.dynamic_slice_in_dim(v_BxKxLxH, start, C, axis=2)
        s = jnp.einsum("bkgh,bkch->bkgc", qg_BxKxGxH, kb, preferred_element_type=jnp.float32)
        slot = start + jnp.arange(C)
        valid = (slot[None, :] <= last_B[:, None])[:, None, None, :]  # [B, 1, 1, C]
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
    lse = jnp.where(l > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out, lse


def merge_attention(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array) -> jax.Array:
    """Exact softmax attention over the union of two disjoint slot sets from the two partial results
    (fp32 ``o [..., H]``, ``lse [...]``, e.g. of :func:`_ragged_attention_lse`)::

        m = max(lse1, lse2),   o = (e^{lse1 - m} o1 + e^{lse2 - m} o2) / (e^{lse1 - m} + e^{lse2 - m})

    A side with no slot has ``lse = -inf`` and weight 0; with neither, ``o = 0``."""
    m = jnp.maximum(lse1, lse2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    den = w1 + w2
    return (w1[..., None] * o1 + w2[..., None] * o2) / jnp.where(den > 0, den, 1.0)[..., None]


def _attention_block(L: int, block_size: int) -> int:
    """The loop's block: ``min(block_size, L)`` if it divides ``L``, else the whole length (one block; caches of
    the ``"dense"`` model fns are not rounded to blocks)."""
    C = min(block_size, L)
    return C if L % C == 0 else L


def cascade_decode_attention(q_Rx1xQxH: jax.Array, k_suf_RxKxLsxH: jax.Array, v_suf_RxKxLsxH: jax.Array,
                             suffix_pos_R: jax.Array, k_pre_PxKxLpxH: jax.Array, v_pre_PxKxLpxH: jax.Array, *,
                             prefix_len_P: jax.Array, row_prompt_R: jax.Array, row_rank_R: jax.Array,
                             rows_per_prompt: int, impl: str = "xla", block_size: int = 256,
                             prefix_block_h: int | None = None, prefix_num_warps: int | None = None,
                             interpret: bool = False, target_programs: int = 512) -> jax.Array:
    """Decode attention over a shared-prefix ("cascade", Hydragen-style) cache; exact.

    Row ``r`` belongs to prompt ``p = row_prompt_R[r]``, whose first ``n_p = prefix_len_P[p]`` tokens' keys/values
    are stored once, in ``k_pre[p, :, 0:n_p]``; the row's own tokens (from the prompt's last token on) are in its
    suffix ``k_suf[r, :, 0..suffix_pos_R[r]]`` (suffix slot ``j`` = position ``n_p + j``; this step's key already
    written). The query attends to the union, as one softmax, computed as two partial attentions merged by
    log-sum-exp (fp32 statistics, :func:`merge_attention`)::

        (o1, lse1) = attn(q_r, k_pre[p, :, :n_p])                 prefix, read once per prompt
        (o2, lse2) = attn(q_r, k_suf[r, :, :suffix_pos_r + 1])      suffix, per row
        o_r = (e^{lse1 - m} o1 + e^{lse2 - m} o2) / (e^{lse1 - m} + e^{lse2 - m}),   m = max(lse1, lse2)

    Prefix part without a per-row gather of the prefix: row ``r`` has a rank ``row_rank_R[r] < W`` unique among
    the rows of its prompt (``W = rows_per_prompt``), so its query is scattered to prompt ``p``'s query block
    (:func:`_group_queries_by_prompt`: ``[P, K, W*G, H]``, query ``w G + g`` of KV head ``k``; entries of absent
    rows are zero and their outputs unused): each prompt is then one "row" with ``W*G`` queries per KV head,
    which reads every prompt's prefix once per step however many rows decode from it; the outputs are gathered
    back by ``p * W + rank``. Rows may be in any physical order (the tree sampler permutes and slices them). Dead
    rows (``suffix_pos_R >= Ls``) get an unused, finite output and do not lengthen the suffix pass. Returns
    ``[R, 1, Q, H]`` in ``q``'s dtype; ``q`` is cast to the cache dtype before the score matmul.

    ``impl`` (:func:`resolve_cascade_impl`) runs both passes as

    * ``"xla"``: the ragged online-softmax loop (:func:`_ragged_attention_lse`; ``q`` scaled by ``1/sqrt(H)``
      in fp32 before the cast, as :func:`ragged_decode_attention`), blocks of ``block_size`` slots (a cache
      length it does not divide is read in one block); every backend.
    * ``"pallas"``: JAX's Pallas/Triton split-K kernel with its residuals (:func:`_pallas_attention_lse`; GPU,
      or Pallas' interpreter with ``interpret``): K/V blocks of at most ``block_size`` slots capped to
      :data:`PALLAS_TILE_BYTES` (:func:`pallas_block`), splits by ``target_programs`` (as
      :func:`pallas_decode_attention`); the prefix pass covers ``prefix_block_h`` queries per program (default
      :func:`default_prefix_block_h` of ``W G``) with ``prefix_num_warps`` warps (``None``: the kernel's 4), the
      suffix pass the kernel's 16. Both cache lengths must be multiples of 16 (:func:`_pallas_tiling`); traced
      under ``default_matmul_precision("highest")`` (module docstring: fp32 caches get IEEE fp32 dots, not TF32).
    * ``"pallas_mgpu"``: treejax's Mosaic GPU kernel, which returns ``lse`` (:func:`_mgpu_cascade_passes`; a Hopper
      GPU, or Mosaic GPU's interpret mode with ``interpret``): KV blocks
      :func:`treejax.sampling.mgpu_attention.mgpu_block` of each cache length and ``block_size`` (128 or 64 slots;
      lengths multiples of 64); the prefix pass holds up to 128 of a prompt's ``W G`` queries of a KV head in one
      program (``prefix_block_h`` / ``prefix_num_warps`` do not apply).
    * ``"pallas_tpu"``: treejax's Pallas TPU kernel, which returns ``lse`` (:func:`_tpu_cascade_passes`; TPU, or
      Pallas' TPU interpreter with ``interpret``): KV blocks :func:`treejax.sampling.tpu_attention.tpu_block` of
      each cache length and ``block_size`` (multiples of 128 on a TPU, of 8 in the interpreter); the prefix pass
      holds a prompt's ``W G`` queries of a KV head in one program (``prefix_block_h`` / ``prefix_num_warps`` do
      not apply).
    """
    R, _, Q, H = q_Rx1xQxH.shape
    P, K = k_pre_PxKxLpxH.shape[:2]
    W = rows_per_prompt
    if k_suf_RxKxLsxH.shape[0] != R or k_suf_RxKxLsxH.shape[1] != K:
        raise ValueError(f"suffix cache must be [R={R}, K={K}, Ls, H], got {k_suf_RxKxLsxH.shape}")
    if impl not in CASCADE_PASSES:
        raise ValueError(f"cascade impl must be one of {CASCADE_PASSES}, got {impl!r}")
    flat_R = row_prompt_R * W + row_rank_R
    caches = (k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R, k_pre_PxKxLpxH, v_pre_PxKxLpxH, prefix_len_P)
    if impl == "xla":
        passes = _xla_cascade_passes(q_Rx1xQxH, *caches, flat_R, P, W, block_size)
    elif impl == "pallas_tpu":
        passes = _tpu_cascade_passes(q_Rx1xQxH, *caches, flat_R, P, W, block_size, interpret)
    elif impl == "pallas_mgpu":
        passes = _mgpu_cascade_passes(q_Rx1xQxH, *caches, flat_R, P, W, block_size, interpret)
    else:
        passes = _pallas_cascade_passes(q_Rx1xQxH, *caches, flat_R, P, W, block_size, prefix_block_h,
                                        prefix_num_warps, interpret, target_programs)
    o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG = passes
    o1_PWxKxGxH, lse1_PWxKxG = _ungroup_prompt_outputs(o1_PxKxWGxH, lse1_PxKxWG, W)
    idx_R = jnp.clip(flat_R, 0, P * W - 1)
    out = merge_attention(o1_PWxKxGxH[idx_R], lse1_PWxKxG[idx_R], o2_RxKxGxH, lse2_RxKxG)
    return out.reshape(R, 1, Q, H).astype(q_Rx1xQxH.dtype)


def _xla_cascade_passes(q_Rx1xQxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R, k_pre_PxKxLpxH, v_pre_PxKxLpxH,
                        prefix_len_P, flat_R, P: int, W: int, block_size: int):
    """The cascade's two passes as the ragged online-softmax loop (:func:`_ragged_attention_lse`),
    ``(o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG)``: ``q`` scaled by ``1/sqrt(H)`` in fp32 before the cast
    to the cache dtype; the suffix per row over slots ``0..suffix_pos``, the prefix with the queries grouped by
    prompt, one pass over each prompt's prefix."""
    R, _, Q, H = q_Rx1xQxH.shape
    K = k_pre_PxKxLpxH.shape[1]
    Lp, Ls = k_pre_PxKxLpxH.shape[2], k_suf_RxKxLsxH.shape[2]
    qg_RxKxGxH = (q_Rx1xQxH[:, 0].reshape(R, K, Q // K, H).astype(jnp.float32) / math.sqrt(H)).astype(
        k_suf_RxKxLsxH.dtype)
    o2_RxKxGxH, lse2_RxKxG = _ragged_attention_lse(qg_RxKxGxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R,
                                                   _attention_block(Ls, block_size))
    q_PxKxWGxH = _group_queries_by_prompt(qg_RxKxGxH.astype(k_pre_PxKxLpxH.dtype), flat_R, P, W)
    o1_PxKxWGxH, lse1_PxKxWG = _ragged_attention_lse(q_PxKxWGxH, k_pre_PxKxLpxH, v_pre_PxKxLpxH, prefix_len_P - 1,
                                                     _attention_block(Lp, block_size))
    return o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG


def _pallas_cascade_passes(q_Rx1xQxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R, k_pre_PxKxLpxH,
                           v_pre_PxKxLpxH, prefix_len_P, flat_R, P: int, W: int, block_size: int,
                           prefix_block_h: int | None, prefix_num_warps: int | None, interpret, target_programs: int):
    """The cascade's two passes through JAX's Pallas/Triton split-K kernel with its residuals
    (:func:`_pallas_attention_lse`, which scales ``q`` itself), ``(o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH,
    lse2_RxKxG)``: dead rows read one slot (their output is unused); the prefix pass covers ``prefix_block_h``
    queries per program (default :func:`default_prefix_block_h` of ``W G``) with ``prefix_num_warps`` warps."""
    R, _, Q, H = q_Rx1xQxH.shape
    K = k_pre_PxKxLpxH.shape[1]
    qg_RxKxGxH = q_Rx1xQxH[:, 0].reshape(R, K, Q // K, H).astype(k_suf_RxKxLsxH.dtype)
    pallas = functools.partial(_pallas_attention_lse, block_size=block_size, target_programs=target_programs,
                               interpret=interpret)
    Ls = k_suf_RxKxLsxH.shape[2]
    suffix_len_R = jnp.where(suffix_pos_R < Ls, suffix_pos_R + 1, 1)
    o2_RxKxGxH, lse2_RxKxG = pallas(qg_RxKxGxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_len_R)
    q_PxKxWGxH = _group_queries_by_prompt(qg_RxKxGxH.astype(k_pre_PxKxLpxH.dtype), flat_R, P, W)
    block_h = default_prefix_block_h(W * (Q // K)) if prefix_block_h is None else prefix_block_h
    o1_PxKxWGxH, lse1_PxKxWG = pallas(q_PxKxWGxH, k_pre_PxKxLpxH, v_pre_PxKxLpxH, prefix_len_P, block_h=block_h,
                                      num_warps=prefix_num_warps)
    return o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG


def _tpu_cascade_passes(q_Rx1xQxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R, k_pre_PxKxLpxH, v_pre_PxKxLpxH,
                        prefix_len_P, flat_R, P: int, W: int, block_size: int, interpret):
    """The cascade's two passes through the TPU kernel (:func:`treejax.sampling.tpu_attention.tpu_attention_lse`),
    ``(o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG)``: the suffix pass per row over slots
    ``0..suffix_pos_R`` (dead rows, ``suffix_pos_R >= Ls``: length 0, ``o = 0``, ``lse = -inf``), the prefix pass
    per prompt over ``prefix_len_P`` slots with the prompt's ``W G`` queries of a KV head in one program (the
    prompt's prefix is read once per step and KV head). Queries unscaled in the cache dtype (the kernel scales the
    fp32 scores); KV blocks :func:`treejax.sampling.tpu_attention.tpu_block` of each cache length."""
    R, _, Q, H = q_Rx1xQxH.shape
    K = k_suf_RxKxLsxH.shape[1]
    Lp, Ls = k_pre_PxKxLpxH.shape[2], k_suf_RxKxLsxH.shape[2]
    qg_RxKxGxH = q_Rx1xQxH[:, 0].reshape(R, K, Q // K, H).astype(k_suf_RxKxLsxH.dtype)
    suffix_len_R = jnp.where(suffix_pos_R < Ls, suffix_pos_R + 1, 0)
    o2_RxKxGxH, lse2_RxKxG = tpu_lib.tpu_attention_lse(qg_RxKxGxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_len_R,
                                                       block_k=tpu_lib.tpu_block(Ls, block_size, interpret),
                                                       interpret=interpret)
    q_PxKxWGxH = _group_queries_by_prompt(qg_RxKxGxH.astype(k_pre_PxKxLpxH.dtype), flat_R, P, W)
    o1_PxKxWGxH, lse1_PxKxWG = tpu_lib.tpu_attention_lse(q_PxKxWGxH, k_pre_PxKxLpxH, v_pre_PxKxLpxH, prefix_len_P,
                                                         block_k=tpu_lib.tpu_block(Lp, block_size, interpret),
                                                         interpret=interpret)
    return o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG


def _mgpu_cascade_passes(q_Rx1xQxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_pos_R, k_pre_PxKxLpxH, v_pre_PxKxLpxH,
                         prefix_len_P, flat_R, P: int, W: int, block_size: int, interpret):
    """The cascade's two passes through the Mosaic GPU kernel (:func:`treejax.sampling.mgpu_attention.
    mgpu_attention_lse`, which returns ``lse``), ``(o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG)``: the suffix
    pass per row over slots ``0..suffix_pos_R`` (dead rows: length 0, no KV block loaded, ``o = 0``, ``lse =
    -inf``), the prefix pass per prompt over ``prefix_len_P`` slots with a prompt's ``W G`` queries of a KV head in
    one program up to 128 queries (:func:`treejax.sampling.mgpu_attention.mgpu_block_q`; the prefix is read
    ``ceil(W G / 128)`` times per step and KV head). Queries unscaled in the cache dtype (the kernel scales the fp32
    scores); KV blocks :func:`treejax.sampling.mgpu_attention.mgpu_block` of each cache length and
    ``block_size``."""
    R, _, Q, H = q_Rx1xQxH.shape
    K = k_suf_RxKxLsxH.shape[1]
    G = Q // K
    Lp, Ls = k_pre_PxKxLpxH.shape[2], k_suf_RxKxLsxH.shape[2]
    dtype = k_suf_RxKxLsxH.dtype
    qg_RxKxGxH = q_Rx1xQxH[:, 0].reshape(R, K, G, H).astype(dtype)
    suffix_len_R = jnp.where(suffix_pos_R < Ls, suffix_pos_R + 1, 0)
    bq_suf, bq_pre = mgpu_lib.mgpu_block_q(G), mgpu_lib.mgpu_block_q(W * G)
    o2_RxKxGxH, lse2_RxKxG = mgpu_lib.mgpu_attention_lse(
        qg_RxKxGxH, k_suf_RxKxLsxH, v_suf_RxKxLsxH, suffix_len_R, block_q=bq_suf,
        block_k=mgpu_lib.mgpu_block(Ls, block_size, H, dtype, bq_suf), interpret=interpret)
    q_PxKxWGxH = _group_queries_by_prompt(qg_RxKxGxH.astype(k_pre_PxKxLpxH.dtype), flat_R, P, W)
    o1_PxKxWGxH, lse1_PxKxWG = mgpu_lib.mgpu_attention_lse(
        q_PxKxWGxH, k_pre_PxKxLpxH, v_pre_PxKxLpxH, prefix_len_P, block_q=bq_pre,
        block_k=mgpu_lib.mgpu_block(Lp, block_size, H, k_pre_PxKxLpxH.dtype, bq_pre), interpret=interpret)
    return o1_PxKxWGxH, lse1_PxKxWG, o2_RxKxGxH, lse2_RxKxG


def _group_queries_by_prompt(qg_RxKxGxH: jax.Array, flat_R: jax.Array, P: int, W: int) -> jax.Array:
    """Row ``r``'s queries scattered to slot ``flat_R[r] = p W + w`` and regrouped per prompt and KV head:
    ``q_PxKxWGxH[p, k, w G + g] = qg_RxKxGxH[r, k, g]`` (zero where no row has that slot; out-of-range slots are
    dropped). KV-head-major, so the ``W G`` queries of KV head ``k`` are one contiguous group (the kernel's GQA
    grouping of ``[P, K W G, H]``)."""
    R, K, G, H = qg_RxKxGxH.shape
    q_PWxKxGxH = jnp.zeros((P * W, K, G, H), qg_RxKxGxH.dtype).at[flat_R].set(qg_RxKxGxH, mode="drop")
    return q_PWxKxGxH.reshape(P, W, K, G, H).transpose(0, 2, 1, 3, 4).reshape(P, K, W * G, H)


def _ungroup_prompt_outputs(o_PxKxWGxH: jax.Array, lse_PxKxWG: jax.Array, W: int) -> tuple[jax.Array, jax.Array]:
    """The inverse regrouping of :func:`_group_queries_by_prompt`: ``(o_PWxKxGxH, lse_PWxKxG)`` indexed by
    ``p W + w``."""
    P, K, WG, H = o_PxKxWGxH.shape
    G = WG // W
    o_PWxKxGxH = o_PxKxWGxH.reshape(P, K, W, G, H).transpose(0, 2, 1, 3, 4).reshape(P * W, K, G, H)
    lse_PWxKxG = lse_PxKxWG.reshape(P, K, W, G).transpose(0, 2, 1, 3).reshape(P * W, K, G)
    return o_PWxKxGxH, lse_PWxKxG


def default_prefix_block_h(queries_per_kv_head: int) -> int:
    """The prefix pass's queries per program: ``min(128, next power of two >= W G)``, at least 16 (the kernel's
    query tile is ``[block_h, H]``, a power of two >= 16 for Triton's dot). The kernel reads a prompt's prefix
    once per ``block_h`` queries of a KV head, i.e. ``ceil(W G / block_h)`` times per step (e.g. ``W G`` = 112:
    once with 128, 7 times with the per-row pass's 16)."""
    return min(128, max(16, 1 << (queries_per_kv_head - 1).bit_length()))


def _pallas_attention_lse(q_BxKxGxH: jax.Array, k_BxKxLxH: jax.Array, v_BxKxLxH: jax.Array, length_B: jax.Array, *,
                          block_size: int, block_h: int = 16, num_warps: int | None = None,
                          target_programs: int = 512, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Attention of row ``b``'s queries over slots ``0..length_B[b] - 1`` with its log-sum-exp, through the Pallas
    split-K kernel (``gqa(..., return_residuals=True)``); the counterpart of :func:`_ragged_attention_lse`.

    ``q_BxKxGxH``: unscaled queries in the cache dtype (the kernel multiplies the fp32 scores by
    ``1/sqrt(H)``); ``G`` queries per KV head, ``block_h`` (a power of two >= 16) of them per program, padded.
    The kernel returns the normalized output and, per query, ``m = max_j s_j`` and ``l = sum_j e^{s_j - m}``
    (natural base, over its splits), so::

        s_j = q . k_j / sqrt(H),   lse = m + log l,   o = sum_{j < length} e^{s_j - lse} v_j

    and a row with ``length = 0`` (every split skipped: ``l = 0``, ``m = finfo.min``, ``o = 0``) gets
    ``lse = -inf`` (weight 0 in :func:`merge_attention`). Grid: ``B x K x ceil(G / block_h) x splits``, splits
    ``ceil(target_programs / (B K ceil(G / block_h)))`` at most 16 (:func:`pallas_decode_attention`'s rule),
    blocks of at most :func:`pallas_block` slots (:func:`_pallas_tiling`: ``L`` a multiple of 16). Traced under
    ``default_matmul_precision("highest")``. Returns fp32 ``(o_BxKxGxH, lse_BxKxG)`` (``o`` was rounded to the
    cache dtype inside the kernel, as in :func:`pallas_decode_attention`).
    """
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_ops

    B, K, G, H = q_BxKxGxH.shape
    L = k_BxKxLxH.shape[2]
    if v_BxKxLxH.dtype != k_BxKxLxH.dtype or q_BxKxGxH.dtype != k_BxKxLxH.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q_BxKxGxH.dtype}, {k_BxKxLxH.dtype}, "
                         f"{v_BxKxLxH.dtype}")
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    head_splits = -(-G // block_h)
    k_splits = min(16, max(1, -(-target_programs // (B * K * head_splits))))
    splits, block = _pallas_tiling(L, pallas_block(block_size, H, k_BxKxLxH.dtype), k_splits)
    with jax.default_matmul_precision("highest"):
        o, (l, m) = pallas_ops.gqa(q_BxKxGxH.reshape(B, K * G, H), jnp.swapaxes(k_BxKxLxH, 1, 2),
                                   jnp.swapaxes(v_BxKxLxH, 1, 2), kv_seq_len=length_B, block_h=block_h,
                                   block_k=block, k_splits=splits, num_warps=num_warps, return_residuals=True,
                                   interpret=interpret)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.reshape(B, K, G, H).astype(jnp.float32), lse.reshape(B, K, G)


def pallas_block(block_size: int, head_dim: int, cache_dtype) -> int:
    """The Pallas kernel's largest K/V block: ``min(block_size, 128)`` slots, fewer where a ``[block, H]`` tile
    would exceed :data:`PALLAS_TILE_BYTES` (module docstring)."""
    return min(block_size, 128, PALLAS_TILE_BYTES // (head_dim * jnp.dtype(cache_dtype).itemsize))


def pallas_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                            block_size: int = 128, k_splits: int | None = None, interpret: bool = False,
                            target_programs: int = 512) -> jax.Array:
    """GPU decode attention through JAX's Pallas (Triton) split-K kernel, per-row length ``positions + 1``.

    The kernel takes ``[B, L, K, H]`` and swaps to heads-major internally; passing our ``[B, K, L, H]`` buffers
    swapped makes the two transposes cancel, so no copy of the cache is made. The grid is rows x KV heads x
    splits; ``k_splits`` (default: ``ceil(target_programs / (B K))``, at most 16) splits each row's slots only
    when rows are too few to fill the GPU: measured on an H200 (qwen2.5-0.5b cache, 2048 live slots), one split
    ran 256 rows in 75-77 us vs 82 us with 9 splits, and 1024 rows in 255-263 us vs 273 us.

    ``q`` is cast to the cache dtype, and the kernel is traced under ``default_matmul_precision("highest")``
    (IEEE fp32 dots for a float32 cache instead of TF32; 16-bit dots unchanged): module docstring. Head size and
    cache length must satisfy :func:`pallas_problem` (checked by :func:`resolve_impl`, not here).
    """
    from jax.experimental.pallas.ops.gpu import decode_attention as pallas_ops

    _check(q, k_cache)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    B, K, L = k_cache.shape[:3]
    if k_splits is None:
        k_splits = min(16, max(1, -(-target_programs // (B * K))))
    splits, block = _pallas_tiling(L, block_size, k_splits)
    live = positions < L
    lengths = jnp.where(live, positions + 1, 1)
    with jax.default_matmul_precision("highest"):
        out = pallas_ops.gqa(q[:, 0].astype(k_cache.dtype), jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2),
                             kv_seq_len=lengths, k_splits=splits, block_k=block, interpret=interpret)
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
    _check(q, k_cache)
    return windowed_decode_attention(q, k_cache, v_cache, positions)


def tpu_problem(head_dim: int, cache_dtype, block_size: int, backend: str, interpret: bool = False) -> str | None:
    """Why the TPU kernel (:mod:`treejax.sampling.tpu_attention`) cannot run this attention (a sentence), or
    ``None`` if it can (module docstring). ``interpret``: it will run in Pallas' TPU interpreter (any backend;
    KV blocks multiples of 8 instead of the 128 lanes)."""
    if backend != "tpu" and not interpret:
        return (f"the TPU decode kernel is a Pallas TPU (Mosaic) kernel, the backend is {backend!r} (off a TPU it "
                "runs only in Pallas' TPU interpreter: make_decode_attention(..., interpret=True))")
    if head_dim % tpu_lib.TPU_HEAD_MULTIPLE:
        return (f"head_dim {head_dim} is not a multiple of {tpu_lib.TPU_HEAD_MULTIPLE} (the lane dim of every K/V "
                "tile; other head sizes have not been tried)")
    if jnp.dtype(cache_dtype).name not in tpu_lib.TPU_CACHE_DTYPES:
        return f"cache dtype {jnp.dtype(cache_dtype).name} is not one of {tpu_lib.TPU_CACHE_DTYPES}"
    multiple = tpu_lib.block_multiple(interpret)
    if block_size % multiple:
        return (f"block_size {block_size} is not a multiple of {multiple} (the kernel's KV block, a divisor of the "
                f"cache length, is the lane dim of its score tile)")
    return None


def triton_decode_available() -> bool:
    """Whether this JAX still ships the Triton decode kernel (``jax.experimental.pallas.ops.gpu.decode_attention``,
    deprecated in jax 0.11 with Pallas' Triton backend)."""
    return importlib.util.find_spec("jax.experimental.pallas.ops.gpu.decode_attention") is not None


def pallas_problem(head_dim: int, cache_dtype, block_size: int, backend: str) -> str | None:
    """Why the Pallas kernel cannot run this attention (a sentence), or ``None`` if it can (module docstring)."""
    if backend != "gpu":
        return f"the Pallas decode kernel is a Triton (GPU) kernel, the backend is {backend!r}"
    if not triton_decode_available():
        return (f"this JAX ({jax.__version__}) no longer has the Triton decode kernel "
                "(jax.experimental.pallas.ops.gpu.decode_attention; attention='pallas_mgpu' is its Mosaic GPU successor)")
    if head_dim not in PALLAS_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {PALLAS_HEAD_DIMS} (Triton tiles are powers of two, dots >= 16)"
    if jnp.dtype(cache_dtype).name not in PALLAS_CACHE_DTYPES:
        return f"cache dtype {jnp.dtype(cache_dtype).name} is not one of {PALLAS_CACHE_DTYPES}"
    if block_size % 16:
        return f"block_size {block_size} is not a multiple of 16 (cache lengths are multiples of it)"
    return None


def mgpu_problem(head_dim: int, cache_dtype, block_size: int, backend: str, interpret: bool = False) -> str | None:
    """Why the Mosaic GPU kernel (:mod:`treejax.sampling.mgpu_attention`) cannot run this attention (a sentence), or
    ``None`` if it can (module docstring). ``interpret``: it will run in Mosaic GPU's interpret mode (any backend;
    float32 caches allowed there)."""
    if backend != "gpu" and not interpret:
        return (f"the Mosaic GPU decode kernel is a Pallas Mosaic GPU (Hopper) kernel, the backend is {backend!r} (off "
                "a GPU it runs only in Mosaic GPU's interpret mode: make_decode_attention(..., interpret=True))")
    if backend == "gpu" and not interpret and jax.default_backend() == "gpu":
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability is not None and float(capability) < 9.0:
            return (f"the Mosaic GPU decode kernel needs a Hopper GPU (compute capability 9.0: TMA and wgmma), this "
                    f"one is {capability}")
    if head_dim not in mgpu_lib.MGPU_HEAD_DIMS:
        return (f"head_dim {head_dim} is not one of {mgpu_lib.MGPU_HEAD_DIMS} (the swizzled SMEM tiles' width and the "
                "wgmma depth; larger heads would not fit SMEM with the fp32 output tile)")
    dtypes = mgpu_lib.MGPU_INTERPRET_CACHE_DTYPES if interpret else mgpu_lib.MGPU_CACHE_DTYPES
    if jnp.dtype(cache_dtype).name not in dtypes:
        return (f"cache dtype {jnp.dtype(cache_dtype).name} is not one of {dtypes}"
                + ("" if interpret else " (wgmma takes 16-bit operands; float32 runs in interpret mode only)"))
    if block_size % mgpu_lib.MGPU_BLOCK_MULTIPLE:
        return (f"block_size {block_size} is not a multiple of {mgpu_lib.MGPU_BLOCK_MULTIPLE} (the kernel's KV block, "
                f"one of {mgpu_lib.MGPU_BLOCKS}, must divide the cache length, allocated in multiples of block_size)")
    return None


def resolve_impl(name: str, *, head_dim: int, cache_dtype, block_size: int, backend: str | None = None,
                 interpret: bool = False) -> str:
    """``"auto"`` -> ``"pallas"`` on a GPU when :func:`pallas_problem` finds none and the cache is 16-bit,
    ``"pallas_tpu"`` on a TPU when :func:`tpu_problem` finds none and the cache is bfloat16, ``"ragged"``
    otherwise, ``"pallas_mgpu"`` on a GPU where the Triton kernel is gone from this JAX (module docstring); a kernel
    (``"pallas"``, ``"pallas_mgpu"``, ``"pallas_tpu"``; :func:`mgpu_problem` for the Mosaic GPU one) where it
    cannot run raises :class:`~treejax.errors.ConfigError` (a ``ValueError``; the CLIs print it as one line).

    ``backend``: ``jax.default_backend()`` if ``None`` (tests pass ``"gpu"`` / ``"tpu"`` to check those choices
    anywhere). ``interpret``: the TPU kernel will run in Pallas' TPU interpreter (allowed off a TPU, smaller KV
    blocks), the Mosaic GPU kernel in Mosaic GPU's interpret mode (allowed off a GPU, float32 caches too);
    ``"auto"`` never picks a kernel for an interpreter.
    """
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {name!r}")
    if name in ("ragged", "dense"):
        return name
    backend = jax.default_backend() if backend is None else backend
    if name == "pallas_tpu":
        problem = tpu_problem(head_dim, cache_dtype, block_size, backend, interpret)
    elif name == "pallas_mgpu":
        problem = mgpu_problem(head_dim, cache_dtype, block_size, backend, interpret)
    else:
        problem = pallas_problem(head_dim, cache_dtype, block_size, backend)
    if name in KERNEL_IMPLS:
        if problem is not None:
            raise ConfigError(f"attention={name!r} cannot be used: {problem}; fix: attention='auto' or 'ragged' "
                              "(RunConfig.decode_attention = 'auto' for treejax-train and treejax-eval)")
        return name
    if backend == "tpu":
        tpu_ok = tpu_problem(head_dim, cache_dtype, block_size, backend) is None
        return "pallas_tpu" if tpu_ok and jnp.dtype(cache_dtype).itemsize == 2 else "ragged"
    if jnp.dtype(cache_dtype).itemsize != 2:
        return "ragged"
    if problem is None:
        return "pallas"
    if backend == "gpu" and not triton_decode_available() and mgpu_problem(head_dim, cache_dtype, block_size,
                                                                          backend) is None:
        return "pallas_mgpu"  # the Triton kernel gone from this JAX: its Mosaic GPU successor
    return "ragged"


def shard_decode_attention(attention_fn, mesh, rules=None):
    """``attention_fn`` run per shard with ``jax.shard_map`` on ``mesh`` (module docstring).

    Specs come from the rules table at call time, from the arrays' shapes: rows by ``cache_batch``, KV heads by
    ``cache_kv_heads``; the query heads take the KV heads' mesh axes (GQA groups stay whole: query head ``h``
    reads KV head ``h // G``, and contiguous blocks of ``Q = K G`` heads line up with blocks of ``K``). A mesh
    axis that does not divide a dimension is dropped for it (replicated), as everywhere else.
    """
    rules = DEFAULT_RULES if rules is None else rules

    def sharded(q, k_cache, v_cache, positions):
        rows, heads = rows_and_heads(mesh, k_cache.shape[0], q.shape[2], k_cache.shape[1], rules,
                                     row_axis="cache_batch", head_axis="cache_kv_heads")
        cache_spec = P(rows, heads, None, None)
        q_spec = P(rows, None, heads, None)
        return jax.shard_map(attention_fn, mesh=mesh, in_specs=(q_spec, cache_spec, cache_spec, P(rows)),
                             out_specs=q_spec, check_vma=False)(q, k_cache, v_cache, positions)

    return sharded


def make_decode_attention(name: str = "auto", block_size: int = 256, *, head_dim: int, cache_dtype,
                          backend: str | None = None, interpret: bool = False, mesh=None, rules=None):
    """The ``attention_fn`` that :func:`resolve_impl` picks for this head size, cache dtype and block size.

    ``interpret``: run the kernel in Pallas' interpreter (tests off the GPU / TPU, with ``backend="gpu"`` /
    ``"tpu"``; the TPU kernel in Pallas' TPU interpreter, ``pltpu.InterpretParams``).
    ``interpret`` for ``"pallas_mgpu"``: Mosaic GPU's interpret mode (``InterpretGPUParams``).
    ``mesh`` / ``rules``: a sampler on a device mesh; a kernel (Pallas on GPU or TPU) is then run per shard
    (:func:`shard_decode_attention`); the XLA paths are partitioned by GSPMD as they are.
    """
    impl = resolve_impl(name, head_dim=head_dim, cache_dtype=cache_dtype, block_size=block_size, backend=backend,
                        interpret=interpret)
    if impl == "ragged":
        return functools.partial(ragged_decode_attention, block_size=block_size)
    if impl in KERNEL_IMPLS:
        if impl == "pallas":
            fn = functools.partial(pallas_decode_attention, block_size=pallas_block(block_size, head_dim, cache_dtype),
                                   interpret=interpret)
        elif impl == "pallas_mgpu":
            fn = functools.partial(mgpu_lib.mgpu_decode_attention, block_size=block_size, interpret=interpret)
        else:
            fn = functools.partial(tpu_lib.tpu_decode_attention, block_size=block_size, interpret=interpret)
        return fn if mesh is None or mesh.size == 1 else shard_decode_attention(fn, mesh, rules)
    return dense_decode_attention


def resolve_cascade_impl(name: str, per_row_impl: str, mesh=None) -> str:
    """The passes of :func:`cascade_decode_attention`: the per-row attention's kernel (``"pallas"``,
    ``"pallas_mgpu"`` or ``"pallas_tpu"``) where ``name`` is ``"auto"``, the per-row attention resolved to that kernel
    (:func:`resolve_impl`: backend, head size, dtype, block size all fit it) and no mesh of more than one device is
    given (module docstring: no per-shard wrapper), else ``"xla"``; ``name = "xla"`` forces the XLA passes (e.g.
    to compare them)."""
    if name not in CASCADE_IMPLS:
        raise ValueError(f"cascade must be one of {CASCADE_IMPLS}, got {name!r}")
    single = mesh is None or mesh.size == 1
    return per_row_impl if name == "auto" and per_row_impl in KERNEL_IMPLS and single else "xla"


def make_cascade_attention(impl: str, block_size: int = 256, *, interpret: bool = False,
                           prefix_block_h: int | None = None, prefix_num_warps: int | None = None):
    """:func:`cascade_decode_attention` with its static settings bound: ``impl`` ``"xla"`` | ``"pallas"`` |
    ``"pallas_mgpu"`` | ``"pallas_tpu"`` (:func:`resolve_cascade_impl`), ``block_size`` (the cache multiple; the
    Pallas passes cap their K/V block, :func:`pallas_block`; the TPU passes take
    :func:`treejax.sampling.tpu_attention.tpu_block`, the Mosaic GPU ones
    :func:`treejax.sampling.mgpu_attention.mgpu_block`), ``interpret`` (Pallas' interpreter, tests off the GPU /
    TPU), the prefix pass's ``prefix_block_h`` /
    ``prefix_num_warps`` (GPU Pallas only). The caller binds the cache's row/prompt fields."""
    if impl not in CASCADE_PASSES:
        raise ValueError(f"cascade impl must be one of {CASCADE_PASSES}, got {impl!r}")
    return functools.partial(cascade_decode_attention, impl=impl, block_size=block_size, interpret=interpret,
                             prefix_block_h=prefix_block_h, prefix_num_warps=prefix_num_warps)
