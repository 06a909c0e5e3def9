"""Attention over tree-packed rows (``treejax.rl.packing``): every token sees its node's ancestors and, causally,
its own node.

Each token carries its node's preorder interval ``[node_lo, node_hi]`` (``node_hi``: the last preorder number in
the node's subtree). With the row laid out in preorder (ancestors before descendants)::

    mask[i, j] = (j <= i) & (node_lo[j] <= node_lo[i] <= node_hi[j])

Implementations (``attention_impl``):

* ``"xla"``: the dense mask ``[B, L, L]`` and fp32 scores, with :func:`treejax.models.dense_attention.attention`.
  Exact on every backend; memory ``O(L^2)`` per row and head, so meant for CPU/TPU tests and short rows.
* ``"pallas"``: a block-sparse flash-attention kernel (Pallas, Triton on GPU): queries in blocks, keys in
  blocks, the mask computed per tile from the two interval vectors, tiles without any visible key skipped, online
  softmax in fp32; forward and backward kernels (:mod:`treejax.models.tree_flash`). On a non-GPU backend it
  runs in Pallas' interpreter (slow; correctness tests only).
* ``"pallas_tpu"``: the same block-sparse flash attention as a Pallas TPU (Mosaic) kernel, the block tables
  passed by scalar prefetch (:mod:`treejax.models.tree_splash`); forward and backward kernels. On a non-TPU
  backend it runs in Pallas' generic interpreter (slow; correctness tests only).
* ``"pallas_mgpu"``: the same block-sparse flash attention as Pallas **Mosaic GPU** kernels for Hopper (wgmma,
  TMA copies in a software pipeline over the listed blocks; :mod:`treejax.models.tree_flash_mgpu`), the Triton
  lowering's successor in JAX; forward and backward kernels, head sizes that are multiples of 64, rows a
  multiple of 64 tokens. Off a GPU it runs in Mosaic GPU's interpret mode (slow; correctness tests only).
* ``"auto"``: on a GPU the faster of the two GPU kernels for the shape, as measured on an H200
  (``experiments/bench_tree_attention.py``, fwd+bwd, docs/performance.md): the Mosaic GPU kernel on a Hopper GPU
  (compute capability >= 9.0) for 16-bit inputs with 128-wide heads (2.30 against the Triton kernel's 2.43 ms,
  depth-4 tree, qwen2.5-1.5b's heads) or rows of at least :data:`MGPU_AUTO_MIN_ROW` tokens (TreePO's 14 x 512
  row of 98,304 tokens: 17.5 against 21.8 ms), the Triton kernel otherwise (64-wide heads on shorter rows: 1.70
  against 1.80 ms; GPUs before Hopper; float32). The choice is made per call from the query's shape and dtype
  (:func:`resolve_impl`), so one model picks one kernel for all its layers. Elsewhere ``"xla"``, a TPU included:
  the TPU kernel is asked for by name until it has been compiled by Mosaic and run on a chip (it has run only in
  the TPU interpreter; the sampler's TPU decode kernel, in the same state, is picked by its ``"auto"``:
  :mod:`treejax.sampling.attention`).

Sharding: the XLA path is partitioned by GSPMD like the rest of the update (rows over ``data x fsdp``, heads
over ``tensor``). GSPMD cannot split a Pallas call (it would gather every operand onto every device and run it
replicated), so under a context mesh (``jax.set_mesh``, which the training loop sets on multi-device meshes) the
kernels run in ``jax.shard_map``: each device attends its own rows (whole trees: a row never attends another) and
its own heads (rows by the logical ``batch`` axis, heads by ``heads`` where that divides both head counts).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from treejax.models import tree_flash, tree_flash_mgpu, tree_splash
from treejax.models.dense_attention import attention, causal_mask
from treejax.parallel.mesh import rows_and_heads

TREE_ATTENTION_IMPLS = ("xla", "pallas", "pallas_tpu", "pallas_mgpu", "auto")


def tree_mask(node_lo_BxL: jax.Array, node_hi_BxL: jax.Array) -> jax.Array:
    """Dense ``[B, L, L]`` attention mask of packed rows (True = attend):
    ``(j <= i) & (node_lo[j] <= node_lo[i] <= node_hi[j])``."""
    q = node_lo_BxL[:, :, None]
    return causal_mask(node_lo_BxL.shape[1])[None] & (node_lo_BxL[:, None, :] <= q) & (q <= node_hi_BxL[:, None, :])


#: ``auto`` takes the Mosaic GPU kernel on rows of at least this many tokens, whatever the head size (module
#: docstring): at 98,304 tokens it ran 1.25x the Triton kernel's speed; at 16,384 (depth-4 trees, 64-wide heads)
#: 0.94x.
MGPU_AUTO_MIN_ROW = 65_536
#: ... and at head sizes of at least this on shorter rows (1.06x at 128; 0.94x at 64).
MGPU_AUTO_MIN_HEAD_DIM = 128
#: The head sizes ``auto`` hands to the Mosaic GPU kernel (the ones measured and gradient-checked on the GPU).
MGPU_AUTO_HEAD_DIMS = (64, 128)


def _capability() -> float | None:
    """The first device's CUDA compute capability (``None`` where JAX does not report one)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return None if capability is None else float(capability)


def resolve_impl(attention_impl: str, backend: str | None = None, *, head_dim: int | None = None,
                 row_length: int | None = None, dtype=None, capability: float | None = None) -> str:
    """The implementation ``attention_impl`` runs on ``backend`` (default: :func:`jax.default_backend`).

    ``"auto"``: ``"xla"`` off a GPU; on a GPU ``"pallas_mgpu"`` where the Mosaic GPU kernel measured faster than
    the Triton one (module docstring):

        capability >= 9.0  and  dtype in (bfloat16, float16)  and  head_dim in MGPU_AUTO_HEAD_DIMS
        and  row_length % 64 == 0  and  (head_dim >= MGPU_AUTO_MIN_HEAD_DIM  or  row_length >= MGPU_AUTO_MIN_ROW)

    and ``"pallas"`` otherwise, or when the shape is not given (``head_dim`` / ``row_length`` / ``dtype`` is
    ``None``). ``capability``: the GPU's compute capability (default: the first device's; tests pass one). The TPU
    kernel (``"pallas_tpu"``, :mod:`treejax.models.tree_splash`) is tested in Pallas' TPU interpreter and lowers
    for TPU, but has not run on TPU hardware yet, so ``auto`` does not pick it there until it has; ask for it with
    ``PackingConfig.attention_impl = "pallas_tpu"``."""
    if attention_impl not in TREE_ATTENTION_IMPLS:
        raise ValueError(f"tree attention_impl must be one of {TREE_ATTENTION_IMPLS}, got {attention_impl!r}")
    if attention_impl != "auto":
        return attention_impl
    backend = backend or jax.default_backend()
    if backend != "gpu":
        return "xla"
    if head_dim is None or row_length is None or dtype is None:
        return "pallas"
    capability = _capability() if capability is None else capability
    mgpu = (capability is not None and capability >= 9.0 and jnp.dtype(dtype).itemsize == 2
            and jnp.issubdtype(dtype, jnp.floating) and head_dim in MGPU_AUTO_HEAD_DIMS
            and row_length % tree_flash_mgpu.MIN_TILE == 0
            and (head_dim >= MGPU_AUTO_MIN_HEAD_DIM or row_length >= MGPU_AUTO_MIN_ROW))
    return "pallas_mgpu" if mgpu else "pallas"


def make_tree_attention(node_lo_BxL: jax.Array, node_hi_BxL: jax.Array, attention_impl: str = "xla",
                        blocks: tree_flash.TreeFlashBlocks | tree_splash.TreeSplashBlocks
                        | tree_flash_mgpu.TreeFlashMgpuBlocks | None = None
                        ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``attend(q [B, L, Q, H], k [B, L, K, H], v [B, L, K, H]) -> [B, L, Q, H]`` for rows with these intervals.

    Whatever depends only on the intervals (the dense mask) is built once here, outside the layer loop.
    ``blocks``: the Pallas kernel's tiles: for ``"pallas"`` a :class:`~treejax.models.tree_flash.TreeFlashBlocks`
    (default: :func:`treejax.models.tree_flash.default_blocks` of the head size), for ``"pallas_tpu"`` a
    :class:`~treejax.models.tree_splash.TreeSplashBlocks` (default:
    :func:`treejax.models.tree_splash.default_blocks` of the row length), for ``"pallas_mgpu"`` a
    :class:`~treejax.models.tree_flash_mgpu.TreeFlashMgpuBlocks` (default:
    :func:`treejax.models.tree_flash_mgpu.default_blocks` of the head size and row length)."""
    impl = resolve_impl(attention_impl)
    if impl == "xla":
        mask = tree_mask(node_lo_BxL, node_hi_BxL)
        return lambda q, k, v: attention(q, k, v, mask)
    if attention_impl == "auto":  # a GPU: the kernel for the shape (resolve_impl), or the one the tiles are for
        if isinstance(blocks, (tree_flash_mgpu.TreeFlashMgpuBlocks, tree_flash.TreeFlashBlocks)):
            impl = "pallas_mgpu" if isinstance(blocks, tree_flash_mgpu.TreeFlashMgpuBlocks) else "pallas"
        elif blocks is None:
            def attend(q, k, v):
                chosen = resolve_impl("auto", head_dim=q.shape[-1], row_length=q.shape[1], dtype=q.dtype)
                _log_choice(chosen, q.shape[1], q.shape[-1], jnp.dtype(q.dtype).name)
                return _kernel_attention(chosen, node_lo_BxL, node_hi_BxL, None)(q, k, v)
            return attend
    return _kernel_attention(impl, node_lo_BxL, node_hi_BxL, blocks)


@functools.cache
def _log_choice(impl: str, row_length: int, head_dim: int, dtype: str) -> None:
    """One log line per process and shape: which kernel ``attention_impl='auto'`` chose, with its tiles."""
    tiles = {"pallas_mgpu": lambda: tree_flash_mgpu.default_blocks(head_dim, row_length).describe(row_length, head_dim),
             "pallas": lambda: str(tree_flash.default_blocks(head_dim, row_length))}.get(impl, lambda: "")()
    logging.getLogger("treejax.models.tree_attention").info(
        "tree attention auto -> %s on %d-token rows (head_dim %d, %s)%s", impl, row_length, head_dim, dtype,
        f": {tiles}" if tiles else "")


def _kernel_attention(impl, node_lo_BxL, node_hi_BxL, blocks):
    """``attend(q, k, v)`` of the Pallas kernel ``impl`` (``"pallas"``, ``"pallas_tpu"`` or ``"pallas_mgpu"``),
    under the context mesh's ``shard_map`` where there is one (module docstring)."""
    if impl == "pallas_tpu":
        if blocks is not None and not isinstance(blocks, tree_splash.TreeSplashBlocks):
            raise ValueError(f"tree attention 'pallas_tpu' takes tree_splash.TreeSplashBlocks tiles, got {blocks!r}; "
                             "pass TreeSplashBlocks or None (the TPU defaults)")
        interpret = "hlo" if jax.default_backend() != "tpu" else False  # the interpreter that runs under remat
        kernel = lambda q, k, v, lo, hi: tree_splash.tree_splash_attention(  # noqa: E731
            q, k, v, lo, hi, blocks, interpret)
    elif impl == "pallas_mgpu":
        if blocks is not None and not isinstance(blocks, tree_flash_mgpu.TreeFlashMgpuBlocks):
            raise ValueError(f"tree attention 'pallas_mgpu' takes tree_flash_mgpu.TreeFlashMgpuBlocks tiles, got "
                             f"{blocks!r}; pass TreeFlashMgpuBlocks or None (its defaults)")
        interpret = jax.default_backend() != "gpu"  # Mosaic GPU's interpret mode off a GPU
        kernel = lambda q, k, v, lo, hi: tree_flash_mgpu.tree_flash_attention(  # noqa: E731
            q, k, v, lo, hi, blocks or tree_flash_mgpu.default_blocks(q.shape[-1], q.shape[1]), interpret)
    else:
        if blocks is not None and not isinstance(blocks, tree_flash.TreeFlashBlocks):
            raise ValueError(f"tree attention 'pallas' takes tree_flash.TreeFlashBlocks tiles, got {blocks!r}; "
                             "pass TreeFlashBlocks or None (the GPU defaults)")
        interpret = jax.default_backend() != "gpu"
        kernel = lambda q, k, v, lo, hi: tree_flash.tree_flash_attention(  # noqa: E731
            q, k, v, lo, hi, blocks or tree_flash.default_blocks(q.shape[-1], q.shape[1]), interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        if impl == "pallas_tpu":
            return tree_splash.make_attention(node_lo_BxL, node_hi_BxL, blocks, interpret=interpret)
        if impl == "pallas_mgpu":
            return tree_flash_mgpu.make_attention(node_lo_BxL, node_hi_BxL, blocks, interpret=interpret)
        return tree_flash.make_attention(node_lo_BxL, node_hi_BxL, blocks, interpret=interpret)
    return _per_shard(node_lo_BxL, node_hi_BxL, mesh, kernel)


def _per_shard(node_lo_BxL, node_hi_BxL, mesh, kernel):
    """A Pallas tree attention ``kernel(q, k, v, lo, hi)`` inside ``jax.shard_map`` over rows and heads of the
    context ``mesh``."""
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)

    def attend(q, k, v):
        rows, heads = rows_and_heads(mesh, lo.shape[0], q.shape[2], k.shape[2])
        qkv, pos = P(rows, None, heads, None), P(rows, None)
        return jax.shard_map(kernel, in_specs=(qkv, qkv, qkv, pos, pos), out_specs=qkv, check_vma=False)(
            q, k, v, lo, hi)

    return attend
