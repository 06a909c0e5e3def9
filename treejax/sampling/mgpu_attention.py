"""Decode attention over the per-row KV cache ``[B, K, L, H]`` as a Pallas **Mosaic GPU** kernel (Hopper: TMA, wgmma).

The successor of the sampler's Triton path (``attention="pallas"``: JAX's ``jax.experimental.pallas.ops.gpu.
decode_attention``, deprecated in jax 0.11 with Pallas' Triton backend) for ``attention="pallas_mgpu"``. The same
function as :mod:`treejax.sampling.tpu_attention` (its GPU counterpart, modelled on it) and
:func:`treejax.sampling.attention._ragged_attention_lse`::

    s_j = q . k_j / sqrt(H)   (j < length_b),   lse = log sum_j e^{s_j},   o = sum_j e^{s_j - lse} v_j

with ``o = 0``, ``lse = -inf`` for a row of length 0, fp32 statistics, so the shared-prefix cascade
(:func:`treejax.sampling.attention.cascade_decode_attention`) can merge its prefix and suffix passes.

**Structure.** One program (a CTA of one warpgroup; ``plgpu.kernel`` grid ``(K, query tiles, B)``) per (row
``b``, KV head ``k``, tile of ``block_q`` of that KV head's queries): the query tile is copied GMEM -> SMEM by TMA;
a software pipeline (``plgpu.emit_pipeline``, ``max_concurrent_steps`` SMEM buffers) walks the row's KV blocks of
``block_k`` slots over a *dynamic* grid of ``ceil(length_b / block_k)`` steps (``length_b`` a scalar read from
GMEM): step ``t`` TMA-loads key and value block ``t`` of ``k_cache[b, k]`` (the cache read in place) while earlier
steps compute, so **blocks past a row's last live block are neither loaded nor computed** and a dead row (length 0)
loads nothing. ``s = q k^T`` and ``o += p v`` are wgmma's into fp32 accumulators; the online softmax is base 2
(``s`` scaled by ``log2 e / sqrt(H)``) with slots ``>= length_b`` masked in every block (only the last block has
any; the mask is a compare per score, noise next to the block's HBM read); ``lse = m ln 2 + ln l`` (natural base).
The output tile (fp32) and ``lse`` leave through SMEM by TMA.

**Queries per program: padding, not grouping.** A Hopper wgmma has ``M = 64`` rows per warpgroup, and the ``G =
Q / K`` query heads of a KV head are few (7 for qwen2.5-0.5b, 6 for 1.5b), so the query tile is padded: the ``G``
queries of (row, KV head) are zero-padded to ``block_q`` (64; queries are ``[B, K, G, H]``, the pad a small XLA
copy of the queries, not of the cache), and the padded rows' outputs are sliced off. Grouping other rows or KV
heads into the 64 rows instead would not save a byte: each (row, KV head) has its own keys and values, and decode
is memory-bound, so what matters is that each row's live KV is read once per KV head and dead blocks are skipped,
not tensor-core utilisation (``G / 64`` of the wgmma rows do useful work; the math is far below the HBM time).
The cascade's prefix pass groups a prompt's ``W G`` queries of a KV head (e.g. 16 x 7 = 112) into one program:
``block_q = 64 ceil(min(W G, 128) / 64)`` (128: two 64-row wgmma groups in one warpgroup), so the prefix is read
``ceil(W G / block_q)`` times per step (once up to 128 queries), as :func:`treejax.sampling.attention.
default_prefix_block_h` does for the Triton passes.

**Constraints** (:func:`mgpu_problem`; the kernel checks them too): head size 64 or 128 (``H`` the swizzled SMEM
tiles' width and the wgmma ``K`` / ``N``; 256 would not fit the SMEM budget below with an fp32 output tile); cache
bfloat16 or float16 when compiled (wgmma takes 16-bit operands; float32 runs only in interpret mode, where the
tests run it); cache lengths multiples of 64 (``block_k`` is 128 or 64, a divisor of the cache length and at most
``block_size``; the sampler allocates caches in multiples of ``block_size``, so ``block_size % 64 == 0``); any
number of query heads per KV head and of KV heads. SMEM per program at ``H = 128``, 2 buffers, ``block_k = 128``:
K/V 128 KiB + query tile 16 KiB + fp32 output tile 32 KiB (``block_q = 128`` takes ``block_k = 64``:
64 + 32 + 64 KiB), under the H100/H200's 227 KiB. No split of a row's slots over programs (Triton's ``k_splits``):
with few rows (``B K`` programs below the 132 SMs) the GPU is underfilled; the sampler decodes 64-1024 rows.

Status: tested in Mosaic GPU's interpret mode on CPU (``InterpretGPUParams``: TMA, wgmma, barriers and the pipeline
simulated) against the dense reference, on jax 0.10.2 and 0.11.2, and lowered through Pallas' Mosaic GPU lowering
for the ``cuda`` platform on a CPU (``tests/sampling/test_mgpu_attention.py``); compiled and run on an NVIDIA H200
(jax 0.11.2; the ``gpu``-marked tests: per-row and cascade against the Triton kernel and the dense path in bf16,
and the model's decode step). Timed there (``experiments/bench_sampler.py --attention pallas pallas_mgpu ragged
--kernel-table``) it ran at 0.76-0.90x of the Triton kernel alone (64-1,024 rows, 2,048 slots, qwen2.5-0.5b's
heads; 0.73 of the HBM peak at 1,024 rows against Triton's 0.81) and 0.93-1.00x of its decode step, so
``attention="auto"`` keeps the Triton kernel while JAX ships it and takes this one once it is gone. Interpret mode differs from the GPU
program where :func:`treejax.models.tree_flash_mgpu._mma` says (no layout casts; the register operand ``p`` of the
``p v`` wgmma staged through SMEM; accumulation by adding a fresh product). On a device mesh the sampler runs it
per shard (``shard_decode_attention``, as the other kernels); that path is **untested**: in interpret mode under
``jax.shard_map`` on 2 fake CPU devices it fails with 2 KV heads ("Barrier remains allocated", jax 0.10.2 and 0.11.2;
one KV head passes, and the tree kernel passes under ``shard_map``), not yet understood.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from treejax.models import tree_flash_mgpu as tfm
from treejax.sampling.tpu_attention import grouped_decode_query

#: Head sizes, cache dtypes (compiled; interpret mode also takes float32), the KV blocks and the query tiles.
MGPU_HEAD_DIMS = (64, 128)
MGPU_CACHE_DTYPES = ("bfloat16", "float16")
MGPU_INTERPRET_CACHE_DTYPES = ("bfloat16", "float16", "float32")
MGPU_BLOCKS = (128, 64)  #: ``block_k`` candidates, largest first (a divisor of the cache length)
MGPU_BLOCK_MULTIPLE = 64  #: cache lengths (and the sampler's ``block_size``) must be multiples of this
MAX_BLOCK_Q = 128  #: the most queries in one program (two 64-row wgmma groups of one warpgroup)
SMEM_BYTES = 227 * 1024  #: the H100 / H200 per-block shared-memory limit
MAX_CONCURRENT_STEPS = 2  #: TMA buffers of the KV pipeline
_LN2 = math.log(2.0)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # masked score: finite, so m stays finite without inf - inf


def mgpu_block_q(queries_per_kv_head: int) -> int:
    """Queries per program for ``queries_per_kv_head`` queries of one KV head: ``64 ceil(min(n, 128) / 64)``
    (64 for the per-row pass, ``G <= 64``; up to 128 for the cascade's prefix pass); module docstring."""
    n = min(max(queries_per_kv_head, 1), MAX_BLOCK_Q)
    return -(-n // 64) * 64


def smem_bytes(block_q: int, block_k: int, head_dim: int, itemsize: int, stages: int = MAX_CONCURRENT_STEPS) -> int:
    """SMEM of one program: ``stages`` K and V buffers, the query tile, the fp32 output tile, ``lse``."""
    return 2 * stages * block_k * head_dim * itemsize + block_q * head_dim * (itemsize + 4) + 4 * block_q


def mgpu_block(L: int, block_size: int, head_dim: int, cache_dtype, block_q: int = 64) -> int:
    """The kernel's KV block for a cache of ``L`` slots: the largest of :data:`MGPU_BLOCKS` that divides ``L``, is at
    most ``block_size``, keeps the ``[block_q, block_k]`` score tile at 64 x 128 fp32 values per warpgroup (64
    registers a thread) and fits :data:`SMEM_BYTES` (counted for a 16-bit cache: float32 runs only in interpret
    mode, which has no SMEM limit, and takes the same blocks); ``ValueError`` (naming the fix) if none does."""
    itemsize = min(jnp.dtype(cache_dtype).itemsize, 2)
    for b in MGPU_BLOCKS:
        if b <= block_size and L % b == 0 and block_q * b <= 64 * 128 and \
                smem_bytes(block_q, b, head_dim, itemsize) <= SMEM_BYTES:
            return b
    raise ValueError(f"Mosaic GPU decode attention: cache length {L} has no KV block in {MGPU_BLOCKS} that divides "
                     f"it and is at most block_size={block_size}; allocate caches in multiples of "
                     f"{MGPU_BLOCK_MULTIPLE} (the sampler's block_size)")


def _interpret_arg(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: ``True`` -> Mosaic GPU's interpret mode (CPU), ``False`` ->
    compiled; an ``InterpretGPUParams`` is passed through (e.g. with its race detector)."""
    if interpret is True:
        return tfm.interpret_params()
    return interpret or None


def _check(q_BxKxGxH, k_BxKxLxH, v_BxKxLxH, length_B, compiled: bool):
    """``ValueError`` (one line) for inputs the kernel cannot run."""
    if q_BxKxGxH.ndim != 4 or k_BxKxLxH.ndim != 4 or k_BxKxLxH.shape != v_BxKxLxH.shape:
        raise ValueError(f"Mosaic GPU decode attention: q {q_BxKxGxH.shape} must be [B, K, G, H] and k "
                         f"{k_BxKxLxH.shape}, v {v_BxKxLxH.shape} one shape [B, K, L, H]")
    B, K, _, H = q_BxKxGxH.shape
    if k_BxKxLxH.shape[:2] != (B, K) or k_BxKxLxH.shape[3] != H:
        raise ValueError(f"Mosaic GPU decode attention: q {q_BxKxGxH.shape} and k {k_BxKxLxH.shape} must share B, K "
                         "and H")
    if length_B.shape != (B,):
        raise ValueError(f"Mosaic GPU decode attention: lengths {length_B.shape} must be [B] = ({B},)")
    if not (q_BxKxGxH.dtype == k_BxKxLxH.dtype == v_BxKxLxH.dtype):
        raise ValueError(f"Mosaic GPU decode attention: q, k and v must share a dtype, got {q_BxKxGxH.dtype}, "
                         f"{k_BxKxLxH.dtype}, {v_BxKxLxH.dtype}; cast q to the cache dtype")
    if H not in MGPU_HEAD_DIMS:
        raise ValueError(f"Mosaic GPU decode attention: head_dim {H} is not one of {MGPU_HEAD_DIMS}")
    allowed = MGPU_CACHE_DTYPES if compiled else MGPU_INTERPRET_CACHE_DTYPES
    if k_BxKxLxH.dtype.name not in allowed:
        raise ValueError(f"Mosaic GPU decode attention: cache dtype {k_BxKxLxH.dtype.name} is not one of {allowed}"
                         + (" (wgmma takes 16-bit operands; float32 runs in interpret mode only)" if compiled else ""))


def _decode_kernel(plgpu, q_ref, k_ref, v_ref, len_ref, o_ref, lse_ref, q_smem, o_smem, lse_smem, bars, *, bq: int,
                   bk: int, head_dim: int, dtype, scale: float, max_concurrent_steps: int, compiled: bool):
    """Program (KV head, query tile, row) of :func:`mgpu_attention_lse` (module docstring): the query tile by TMA,
    the pipeline over the row's ``ceil(length / bk)`` live KV blocks with the online softmax (base 2), the fp32
    output tile and ``lse`` out by TMA."""
    H = head_dim
    lay = tfm._Lay(plgpu, compiled)
    qkv_t = tfm._smem_transforms(dtype, H)
    b, h, i = lax.axis_index("rows"), lax.axis_index("kv_heads"), lax.axis_index("q_tiles")
    rows = pl.ds(i * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, bars.at[0])
    length = len_ref[b]
    steps = lax.div(length + (bk - 1), jnp.int32(bk))  # the row's live blocks: 0 for a dead row
    plgpu.barrier_wait(bars.at[0])

    def body(idx, k_smem, v_smem, carry):
        acc, m_i, l_i = carry
        start = idx[0] * bk
        s = tfm._mma(plgpu, None, q_smem, k_smem, compiled, (bq, bk), b_transposed=True) * scale
        valid = lay.iota((bq, bk), 1) + start < length
        s = jnp.where(valid, s, _MASK)
        m_next = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_next)
        p = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
        l_next = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = tfm._mma(plgpu, acc, p.astype(dtype), v_smem, compiled, a_in_regs=True)
        return acc, m_next, l_next

    carry = (lay.full((bq, H), 0, lay.wgmma), lay.full((bq,), -jnp.inf, lay.row()), lay.full((bq,), 0, lay.row()))
    kv_spec = plgpu.BlockSpec((bk, H), lambda t: (t, 0), transforms=qkv_t)
    acc, m_i, l_i = plgpu.emit_pipeline(
        body, grid=(steps,), in_specs=[kv_spec, kv_spec], max_concurrent_steps=max_concurrent_steps,
        init_carry=carry,
    )(k_ref.at[b, h], v_ref.at[b, h])
    nonempty = l_i > 0
    safe_l = jnp.where(nonempty, l_i, 1.0)
    o_smem[...] = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
    lse_smem[...] = jnp.where(nonempty, m_i * _LN2 + jnp.log(safe_l), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def mgpu_attention_lse(q_BxKxGxH: jax.Array, k_BxKxLxH: jax.Array, v_BxKxLxH: jax.Array, length_B: jax.Array, *,
                       block_k: int, block_q: int | None = None, max_concurrent_steps: int = MAX_CONCURRENT_STEPS,
                       interpret=False) -> tuple[jax.Array, jax.Array]:
    """Attention of row ``b``'s ``G`` queries per KV head over slots ``0..length_B[b] - 1``, with its log-sum-exp
    (module docstring)::

        s_j = q . k_j / sqrt(H),   lse = log sum_{j < length} e^{s_j},   o = sum_{j < length} e^{s_j - lse} v_j

    ``q_BxKxGxH``: unscaled queries in the cache dtype (the kernel scales the fp32 scores); lengths are clipped to
    ``[0, L]``; a row of length 0 loads no KV block and gets ``o = 0``, ``lse = -inf`` (weight 0 in
    :func:`treejax.sampling.attention.merge_attention`). ``block_k`` must divide ``L`` (:func:`mgpu_block` picks
    one); ``block_q`` (default :func:`mgpu_block_q` of ``G``) is a multiple of 64 up to 128: the ``G`` queries are
    zero-padded to a multiple of it. ``interpret=True``: Mosaic GPU's interpret mode (any backend). Returns fp32
    ``(o_BxKxGxH, lse_BxKxG)``.
    """
    plgpu = tfm._plgpu()
    compiled = not interpret
    _check(q_BxKxGxH, k_BxKxLxH, v_BxKxLxH, length_B, compiled)
    B, K, G, H = q_BxKxGxH.shape
    L = k_BxKxLxH.shape[2]
    dtype = k_BxKxLxH.dtype
    bq = mgpu_block_q(G) if block_q is None else block_q
    if bq % 64 or not 64 <= bq <= MAX_BLOCK_Q:
        raise ValueError(f"Mosaic GPU decode attention: block_q={bq} must be 64 or 128 (64-row wgmma groups)")
    if block_k not in MGPU_BLOCKS or L % block_k:
        raise ValueError(f"Mosaic GPU decode attention: block_k={block_k} must be one of {MGPU_BLOCKS} and divide the "
                         f"cache length {L}; mgpu_attention.mgpu_block({L}, block_size, H, dtype) picks one")
    if max_concurrent_steps < 1:
        raise ValueError("Mosaic GPU decode attention: max_concurrent_steps must be >= 1")
    bk = block_k
    q_tiles = -(-G // bq)
    Gp = q_tiles * bq
    q_pad = jnp.pad(q_BxKxGxH, ((0, 0), (0, 0), (0, Gp - G), (0, 0))) if Gp != G else q_BxKxGxH
    length_B = jnp.clip(length_B.astype(jnp.int32), 0, L)
    scale = math.log2(math.e) / math.sqrt(H)
    qkv_t = tfm._smem_transforms(dtype, H)
    out_t = tfm._smem_transforms(jnp.float32, H)

    kernel = functools.partial(_decode_kernel, plgpu, bq=bq, bk=bk, head_dim=H, dtype=dtype, scale=scale,
                               max_concurrent_steps=max_concurrent_steps, compiled=compiled)
    o, lse = plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct((B, K, Gp, H), jnp.float32), jax.ShapeDtypeStruct((B, K, Gp), jnp.float32)],
        scratch_types=[plgpu.SMEM((bq, H), dtype, transforms=qkv_t), plgpu.SMEM((bq, H), jnp.float32, transforms=out_t),
                       plgpu.SMEM((bq,), jnp.float32), plgpu.Barrier(num_barriers=1)],
        grid=(K, q_tiles, B),
        grid_names=("kv_heads", "q_tiles", "rows"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_arg(interpret),
    )(q_pad, k_BxKxLxH, v_BxKxLxH, length_B)
    return o[:, :, :G], lse[:, :, :G]


def mgpu_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, *,
                          block_size: int = 256, interpret=False) -> jax.Array:
    """The sampler's per-row decode attention hook (``q [B, 1, Q, H]``, caches ``[B, K, L, H]``, ``positions
    [B]`` -> ``[B, 1, Q, H]`` in ``q``'s dtype) through :func:`mgpu_attention_lse`: row ``b`` attends to slots
    ``0..positions[b]``; a dead row (``positions[b] >= L``) loads no KV block and gets 0. ``q`` is cast to the cache
    dtype; the KV block is :func:`mgpu_block` of ``L`` and ``block_size``."""
    q_BxKxGxH, length_B = grouped_decode_query(q, k_cache, positions, "Mosaic GPU")
    B, _, Q, H = q.shape
    K, L = k_cache.shape[1], k_cache.shape[2]
    block_q = mgpu_block_q(Q // K)
    o, _ = mgpu_attention_lse(q_BxKxGxH, k_cache, v_cache, length_B,
                              block_k=mgpu_block(L, block_size, H, k_cache.dtype, block_q), block_q=block_q,
                              interpret=interpret)
    return o.reshape(B, 1, Q, H).astype(q.dtype)

