"""Decoder-only transformer (Llama / Qwen2 / Qwen3) as pure functions of an explicit params pytree.

Per layer ``l`` (pre-norm residual block, HF ``LlamaDecoderLayer`` semantics):

    h   = x + Wo · Attn(RoPE(q(n1(x))), RoPE(k(n1(x))), v(n1(x)))        n1 = RMSNorm
    out = h + W_down (silu(W_gate n2(h)) ⊙ (W_up n2(h)))                  n2 = RMSNorm

``RMSNorm(x) = w ⊙ x / sqrt(mean(x²) + eps)`` computed in fp32. RoPE is the non-interleaved ("rotate half")
form with ``inv_freq_i = theta^(-2i/H)``. Attention is grouped-query: query head ``j`` reads KV head
``j // (Q / K)``; scores are ``q·k / sqrt(H)`` and the softmax runs in fp32 (:mod:`treejax.models.dense_attention`).
Qwen2 adds q/k/v biases; Qwen3 RMS-normalizes every query and key head over ``head_dim`` before RoPE.

Layers are stacked on a leading ``layers`` axis and run under ``lax.scan``. Parameters carry logical axis
names (:func:`param_logical_axes`) that ``treejax.parallel`` maps onto a device mesh.

KV cache layout (:func:`init_cache`): one ``[B, K, L, H]`` buffer per layer for keys and one for values; slot
``t`` of row ``b`` holds the key/value of the token at RoPE position ``t``, and a row attends to slots ``<= its
position``. Forking a branch is a plain row copy (``buf[dst] = buf[src]`` in every buffer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from treejax.models import lora, tree_attention
from treejax.models.config import ModelConfig
from treejax.models.dense_attention import attention, segment_mask, windowed_decode_attention
from treejax.parallel.mesh import rows_and_heads
from treejax.precision import apply_policy, current_matmul_precision, matmul_precision_scope

Params = dict


# ----------------------------------------------------------------------------------------------- parameters
def param_shapes(config: ModelConfig) -> dict:
    """Pytree of shapes, with the same structure as :func:`init_params`."""
    c = config
    Ly, E, F, V, Q, K, H = (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads,
                            c.num_kv_heads, c.head_dim)
    layers = {
        "attn_norm": (Ly, E), "wq": (Ly, E, Q, H), "wk": (Ly, E, K, H), "wv": (Ly, E, K, H), "wo": (Ly, Q, H, E),
        "mlp_norm": (Ly, E), "w_gate": (Ly, E, F), "w_up": (Ly, E, F), "w_down": (Ly, F, E),
    }
    if c.qkv_bias:
        layers.update(bq=(Ly, Q, H), bk=(Ly, K, H), bv=(Ly, K, H))
    if c.qk_norm:
        layers.update(q_norm=(Ly, H), k_norm=(Ly, H))
    shapes = {"embed": (V, E), "layers": layers, "final_norm": (E,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


_LOGICAL = {
    "embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab"),
    "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "heads", "head_dim"), "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"), "wo": ("layers", "heads", "head_dim", "embed"),
    "bq": ("layers", "heads", "head_dim"), "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"), "q_norm": ("layers", "head_dim"), "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"), "w_down": ("layers", "mlp", "embed"),
}

#: Logical axes of activations and of the KV cache (mapped to mesh axes by ``treejax.parallel``).
ACTIVATION_AXES = {
    "tokens": ("batch", "length"), "hidden": ("batch", "length", "embed"),
    "cache": ("cache_batch", "cache_kv_heads", "cache_length", "cache_head_dim"),  # each per-layer buffer
}


def param_logical_axes(config: ModelConfig) -> dict:
    """Pytree like the params whose leaves are tuples of logical axis names."""
    shapes = param_shapes(config)
    return jax.tree.map(lambda _, path: _LOGICAL[path], shapes, _leaf_names(shapes), is_leaf=_is_shape)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _leaf_names(shapes: dict) -> dict:
    return {k: (_leaf_names(v) if isinstance(v, dict) else k) for k, v in shapes.items()}


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random params: N(0, 0.02) for matrices, ones for norm weights, zeros for biases (HF's init)."""
    shapes = param_shapes(config)
    names = jax.tree.leaves(_leaf_names(shapes))
    flat, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(flat))
    leaves = []
    for name, shape, k in zip(names, flat, keys):
        if "norm" in name:
            leaf = jnp.ones(shape, config.params_dtype)
        elif name.startswith("b"):
            leaf = jnp.zeros(shape, config.params_dtype)
        else:
            leaf = (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(config.params_dtype)
        leaves.append(leaf)
    return jax.tree.unflatten(treedef, leaves)


# ----------------------------------------------------------------------------------------------- building blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last axis, in fp32; returns ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return (w * y).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half form) of ``x: [B, L, heads, H]`` at integer ``positions: [B, L]``."""
    H = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))  # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, L, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : H // 2], xf[..., H // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _project_qkv(config: ModelConfig, lp: dict, h: jax.Array, positions: jax.Array):
    dt = h.dtype
    if "wqkv" in lp:  # fused layout of fuse_projections: one matmul, then split
        Q, K = config.num_heads, config.num_kv_heads
        qkv = jnp.einsum("ble,ejh->bljh", h, lora.weight(lp["wqkv"], dt))
        if config.qkv_bias:
            qkv = qkv + lp["bqkv"].astype(dt)[None, None]
        q, k, v = qkv[:, :, :Q], qkv[:, :, Q:Q + K], qkv[:, :, Q + K:]
    else:
        q = lora.dense(lp, "wq", h, "ble,eqh->blqh")
        k = lora.dense(lp, "wk", h, "ble,ekh->blkh")
        v = lora.dense(lp, "wv", h, "ble,ekh->blkh")
        if config.qkv_bias:
            q = q + lp["bq"].astype(dt)[None, None]
            k = k + lp["bk"].astype(dt)[None, None]
            v = v + lp["bv"].astype(dt)[None, None]
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
    return rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta), v


def _mlp(lp: dict, h: jax.Array) -> jax.Array:
    dt = h.dtype
    if "w_gate_up" in lp:  # fused layout of fuse_projections: [E, 2, F]
        gate_up = jnp.einsum("ble,etf->bltf", h, lora.weight(lp["w_gate_up"], dt))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    else:
        gate = lora.dense(lp, "w_gate", h, "ble,ef->blf")
        up = lora.dense(lp, "w_up", h, "ble,ef->blf")
    return lora.dense(lp, "w_down", _swiglu(gate, up), "blf,fe->ble")


@jax.checkpoint
def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``. Checkpointed: its backward recomputes the elementwise ops from ``gate`` and ``up``
    instead of saving ``sigmoid(gate)`` and ``silu(gate)`` too; under the layer scan every saved ``[B, L, F]``
    tensor is stacked over all layers (SmolLM2-135M, 16 x 384 tokens in fp32: 1.13 GB each)."""
    return jax.nn.silu(gate) * up


def _block(config: ModelConfig, lp: dict, x: jax.Array, positions: jax.Array, attend_fn):
    """One decoder layer; ``attend_fn(q, k, v) -> (attn_out, aux)`` decides where keys/values come from."""
    h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
    q, k, v = _project_qkv(config, lp, h, positions)
    attn, aux = attend_fn(q, k, v)
    x = x + lora.dense(lp, "wo", attn, "blqh,qhe->ble")
    x = x + _mlp(lp, rms_norm(x, lp["mlp_norm"], config.rms_norm_eps))
    return x, aux


def embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(config.activation_dtype)


def _check_tokens(tokens: jax.Array, positions: jax.Array):
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens and positions must both be [B, L]; got {tokens.shape} and {positions.shape}")


# ----------------------------------------------------------------------------------------------- training forward
TRAIN_ATTENTION_IMPLS = ("xla", "cudnn", "auto")


def same_attention_sharding(q: jax.Array, k: jax.Array, v: jax.Array):
    """``q [B, L, Q, H]``, ``k, v [B, L, K, H]`` constrained to one sharding under a context mesh
    (``jax.set_mesh``; the training loop sets it on multi-device meshes): rows by the logical ``batch`` axis,
    heads by ``heads`` where that mesh axis divides both ``Q`` and ``K``, the rest replicated.

    cuDNN's fused attention is split over a mesh by a custom partitioner that refuses operands with different
    shardings ("Query, key and value should have same sharding"); with ZeRO-3 (``fsdp``) weights GSPMD may give
    the q and k/v projections different output shardings, as it did on 2 GPUs. Without a context mesh (one device,
    or a caller that manages shardings itself) the arrays are returned unchanged."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return q, k, v
    rows, heads = rows_and_heads(mesh, q.shape[0], q.shape[2], k.shape[2])
    spec = PartitionSpec(rows, None, heads, None)
    return tuple(jax.lax.with_sharding_constraint(x, spec) for x in (q, k, v))


@apply_policy
def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            segment_ids: jax.Array | None = None, remat: bool | str = False,
            attention_impl: str = "xla") -> jax.Array:
    """Full-sequence forward for training and scoring; returns the final-normed hidden states ``[B, L, E]``.

    ``segment_ids: [B, L]`` int (0 = padding): token ``i`` attends to token ``j`` iff ``j <= i`` (index order),
    ``seg[j] == seg[i] != 0``. This covers right/left padding and packed sequences. ``positions`` are the
    RoPE positions (restart at 0 for each packed sequence).

    ``attention_impl``: ``"xla"`` (the masked :func:`attention`; materialises ``[L, L]`` scores) or
    ``"cudnn"`` (``jax.nn.dot_product_attention``'s fused flash kernel, GPU, bf16/fp16): causal with per-row
    key lengths ``sum(segment_ids != 0)``, so it is only valid for **right-padded, unpacked** rows (what
    ``treejax.rl.batch.forest_to_batch`` builds); ``"auto"`` picks cudnn on GPU with a 16-bit compute dtype.
    On an H200 (qwen2.5-0.5b, 64 x 2048 tokens) the XLA path's fp32 score tensors made the update step
    memory-bound at 7% MFU.

    ``remat`` (per-layer rematerialisation, :data:`REMAT_POLICIES`): ``False``/``"none"`` keeps every activation
    the backward pass needs; ``True``/``"full"`` keeps only each layer's input and recomputes the layer in the
    backward pass (one extra forward); ``"dots"`` also keeps the outputs of the projection matmuls (q/k/v, o,
    gate/up, down: ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``), so the backward pass recomputes
    only norms, RoPE, activations and attention.
    """
    _check_tokens(tokens, positions)
    if attention_impl not in TRAIN_ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {TRAIN_ATTENTION_IMPLS}, got {attention_impl!r}")
    if attention_impl == "auto":
        attention_impl = ("cudnn" if jax.default_backend() == "gpu"
                          and config.compute_dtype in ("bfloat16", "float16") else "xla")
    if segment_ids is None:
        segment_ids = jnp.ones_like(tokens)
    if attention_impl == "cudnn":
        kv_lengths = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)

        def attend(q, k, v):
            q, k, v = same_attention_sharding(q, k, v)
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=kv_lengths,
                                               key_value_seq_lengths=kv_lengths, implementation="cudnn")
            return out.astype(q.dtype), None
    else:
        mask = segment_mask(segment_ids)

        def attend(q, k, v):
            return attention(q, k, v, mask), None

    return _run_layers(params, config, tokens, positions, attend, remat)


def _run_layers(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, attend,
                remat: bool | str) -> jax.Array:
    """Embedding, the ``lax.scan`` over layers (with ``remat``) and the final norm, for a given ``attend``."""

    def layer(x, lp):
        return _block(config, lp, x, positions, attend)[0], None

    policy = remat_policy(remat)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    x, _ = lax.scan(layer, embed(params, config, tokens), params["layers"])
    return rms_norm(x, params["final_norm"], config.rms_norm_eps)


@apply_policy
def forward_tree(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                 node_lo: jax.Array, node_hi: jax.Array, remat: bool | str = False,
                 attention_impl: str = "xla", blocks=None) -> jax.Array:
    """Forward of tree-packed rows (``treejax.rl.packing``); returns the final-normed hidden states ``[B, L, E]``.

    ``tokens, positions, node_lo, node_hi: [B, L]``. Token ``i`` attends to token ``j`` iff ``j <= i`` and
    ``node_lo[j] <= node_lo[i] <= node_hi[j]`` (``j``'s node is an ancestor-or-self of ``i``'s node in preorder
    interval form); ``positions`` are the RoPE positions by depth. Every token's hidden state equals the one it
    has in each expanded (one row per leaf) sequence through it, up to float summation order.

    ``attention_impl`` (:data:`treejax.models.tree_attention.TREE_ATTENTION_IMPLS`): ``"xla"`` materialises the
    dense ``[L, L]`` mask and scores (exact on every backend; memory ``O(L^2)`` per row and head), ``"pallas"``
    runs the block-sparse flash kernel (GPU; ``interpret`` mode elsewhere, for tests), ``"pallas_tpu"`` its TPU
    (Mosaic) form (``treejax.models.tree_splash``; the TPU interpreter elsewhere), ``"pallas_mgpu"`` its Mosaic GPU
    form (``treejax.models.tree_flash_mgpu``; Mosaic GPU's interpret mode off a GPU), ``"auto"`` picks pallas_mgpu or
    pallas on a GPU, whichever ran faster for the shape (``tree_attention.resolve_impl``), and xla elsewhere
    (pallas_tpu is asked for by name until it has run on TPU hardware); ``blocks`` the Pallas kernel's tiles (``pallas``:
    ``tree_flash.TreeFlashBlocks``, default ``tree_flash.default_blocks(head_dim, row_length)``; ``pallas_tpu``:
    ``tree_splash.TreeSplashBlocks``, default ``tree_splash.default_blocks(row_length)``; ``pallas_mgpu``:
    ``tree_flash_mgpu.TreeFlashMgpuBlocks``). ``remat`` as in
    :func:`forward`.
    """
    _check_tokens(tokens, positions)
    if node_lo.shape != tokens.shape or node_hi.shape != tokens.shape:
        raise ValueError(f"node_lo / node_hi must be [B, L] like tokens {tokens.shape}; got {node_lo.shape}, "
                         f"{node_hi.shape}")
    attend_fn = tree_attention.make_tree_attention(node_lo, node_hi, attention_impl, blocks)

    def attend(q, k, v):
        return attend_fn(q, k, v), None

    return _run_layers(params, config, tokens, positions, attend, remat)


REMAT_POLICIES = ("none", "full", "dots")


def remat_policy(remat: bool | str):
    """The ``jax.checkpoint`` policy of a :func:`forward` ``remat`` setting (``None``: no rematerialisation)."""
    name = {False: "none", True: "full"}.get(remat, remat) if isinstance(remat, bool) else remat
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat must be a bool or one of {REMAT_POLICIES}, got {remat!r}")
    return {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[name]


# ----------------------------------------------------------------------------------------------- output head
def _head(params: Params, config: ModelConfig) -> jax.Array:
    """The ``[E, V]`` output projection (the transposed embedding when tied)."""
    return params["embed"].T if config.tie_word_embeddings else params["lm_head"]


@apply_policy
def logits(params: Params, config: ModelConfig, hidden: jax.Array, mask_padded_vocab: bool = True) -> jax.Array:
    """fp32 logits ``[..., V]``; ids ``>= true_vocab_size`` get -inf when ``mask_padded_vocab``."""
    w = _head(params, config)
    out = jnp.einsum("...e,ev->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    if mask_padded_vocab and config.sampling_vocab_size < config.vocab_size:
        valid = jnp.arange(config.vocab_size) < config.sampling_vocab_size
        out = jnp.where(valid.reshape((1,) * (out.ndim - 1) + (-1,)), out, -jnp.inf)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunk_stats(h, w_c, valid_C, local, inv_temp: float, precision: str | None):
    """Statistics of one vocabulary chunk ``z = (h w_c) * inv_temp`` (fp32; ``-inf`` where ``~valid_C``):

        lse_c = log sum_v e^{z_v},   t_c = z_{target} (0 if the target is not in the chunk),
        zs_c  = sum_v p_v z_v  with  p = softmax_chunk(z).

    Backward (custom, so no autodiff graph over ``[N, C]`` fp32 tensors is kept or replayed): ``z`` is
    recomputed and, with ``d lse_c / dz = p``, ``d t_c / dz = onehot(target)``, ``d zs_c / dz_v = p_v (1 + z_v -
    zs_c)``::

        dz = inv_temp * (p * (g_lse + g_zs * (1 + z - zs_c)) + g_t * onehot)

    is formed in one elementwise pass and cast to ``h``'s dtype, so both backward matmuls (``dz w_c^T`` and
    ``h^T dz``) run in the compute dtype (bf16 GEMMs), not as fp32/TF32 GEMMs on an fp32 cotangent (measured on
    an H200: the fp32 head GEMMs were 17% of a qwen2.5-0.5b update step).

    ``precision``: the matmul precision of the caller (:func:`~treejax.precision.current_matmul_precision`); the
    backward's matmuls run at it too, also when the gradient is taken outside the entry point's precision policy
    (:func:`~treejax.precision.matmul_precision_scope`).
    """
    return _chunk_stats_fwd(h, w_c, valid_C, local, inv_temp, precision)[0]


def _chunk_logits(h, w_c, valid_C, inv_temp):
    z = jnp.einsum("...e,ev->...v", h, w_c.astype(h.dtype), preferred_element_type=jnp.float32) * inv_temp
    return jnp.where(valid_C.reshape((1,) * (z.ndim - 1) + (-1,)), z, -jnp.inf)


def _chunk_stats_fwd(h, w_c, valid_C, local, inv_temp, precision):
    with matmul_precision_scope(precision):
        z = _chunk_logits(h, w_c, valid_C, inv_temp)
    C = z.shape[-1]
    m = jnp.max(z, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(z - m_safe[..., None])
    s = jnp.sum(e, axis=-1)
    zs = jnp.where(s > 0, jnp.sum(jnp.where(e > 0, e * z, 0.0), axis=-1) / jnp.where(s > 0, s, 1.0), 0.0)
    lse = m_safe + jnp.log(s)  # -inf for a chunk without valid ids
    inside = (local >= 0) & (local < C)
    t = jnp.where(inside, jnp.take_along_axis(z, jnp.clip(local, 0, C - 1)[..., None], axis=-1)[..., 0], 0.0)
    return (lse, t, zs), (h, w_c, valid_C, local, lse, zs)


def _chunk_stats_bwd(inv_temp, precision, res, g):
    with matmul_precision_scope(precision):
        return _chunk_stats_grads(inv_temp, res, g)


def _chunk_stats_grads(inv_temp, res, g):
    h, w_c, valid_C, local, lse, zs = res
    g_lse, g_t, g_zs = g
    z = _chunk_logits(h, w_c, valid_C, inv_temp)
    C = z.shape[-1]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.where(jnp.isfinite(z), jnp.exp(z - lse_safe[..., None]), 0.0)
    z0 = jnp.where(jnp.isfinite(z), z, 0.0)
    onehot = (jnp.arange(C).reshape((1,) * local.ndim + (C,)) == local[..., None]).astype(jnp.float32)
    dz = p * (g_lse[..., None] + g_zs[..., None] * (1.0 + z0 - zs[..., None])) + g_t[..., None] * onehot
    dz = (dz * inv_temp).astype(h.dtype)
    # Outputs in the compute dtype (fp32 accumulation inside the GEMM), as autodiff of ``w_c.astype(h.dtype)``
    # would give; XLA:CPU has no bf16 x bf16 -> fp32 dot for every shape.
    dh = jnp.einsum("...v,ev->...e", dz, w_c.astype(h.dtype))
    n = dz.ndim - 1
    dw = jnp.tensordot(h, dz, axes=(tuple(range(n)), tuple(range(n)))).astype(w_c.dtype)
    return dh, dw, None, None


_chunk_stats.defvjp(_chunk_stats_fwd, _chunk_stats_bwd)


@apply_policy
def token_logprobs(params: Params, config: ModelConfig, hidden: jax.Array, targets: jax.Array,
                   chunk_size: int = 8192, with_entropy: bool = False, temperature: float = 1.0):
    """``log softmax(h W / temperature)[target]`` for every position, computed in vocabulary chunks.

    A ``lax.scan`` over chunks of ``chunk_size`` columns computes per-chunk statistics (:func:`_chunk_stats`:
    chunk log-sum-exp ``lse_c``, the target's logit, the chunk's mean logit ``zs_c``) whose backward pass
    recomputes the chunk's logits, so ``[B, L, V]`` fp32 logits never exist at once, in the forward or the
    backward pass. The chunks combine exactly:

        lse = logsumexp_c lse_c,   log p(target) = z_target - lse,
        H   = lse - sum_v p_v z_v = lse - sum_c e^{lse_c - lse} zs_c      (with ``with_entropy``).

    Padded-vocabulary ids (``>= true_vocab_size``) carry no mass.
    """
    w = _head(params, config)
    E, V = w.shape
    chunk = min(chunk_size, V)
    num_chunks = -(-V // chunk)
    pad = num_chunks * chunk - V
    w = jnp.pad(w, ((0, 0), (0, pad))).reshape(E, num_chunks, chunk).transpose(1, 0, 2)
    h = hidden
    starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    valid = (starts[:, None] + jnp.arange(chunk)[None, :]) < config.sampling_vocab_size  # [n, C]
    inv_temp = 1.0 / float(temperature)
    precision = current_matmul_precision()  # the policy's (apply_policy), also for the custom backward

    def body(_, xs):
        w_c, valid_C, start = xs
        return None, _chunk_stats(h, w_c, valid_C, targets - start, inv_temp, precision)

    _, (lse_c, t_c, zs_c) = lax.scan(body, None, (w, valid, starts))  # each [n, *targets.shape]
    lse = jax.nn.logsumexp(lse_c, axis=0)
    logp = jnp.sum(t_c, axis=0) - lse
    if with_entropy:
        weight = jnp.exp(lse_c - lse[None])
        return logp, lse - jnp.sum(jnp.where(weight > 0, weight * zs_c, 0.0), axis=0)
    return logp


@apply_policy
def topk_logprobs(params: Params, config: ModelConfig, hidden: jax.Array, k: int, chunk_size: int = 8192) -> jax.Array:
    """``[..., k]`` the ``k`` largest next-token log-probabilities at every position, in descending order (no
    gradient: a statistic of the distribution, e.g. DeepConf / ECHO's top-k confidence ``-mean_j logp_(j)``).

    One ``lax.scan`` over vocabulary chunks keeps a running top-``k`` of the logits and the running log-sum-exp::

        topk    = top_k(concat(topk, top_k(z_c, k)), k),   lse = logaddexp(lse, lse_c),   logp_(j) = topk_j - lse

    so the ``[..., V]`` logits never exist at once. Padded-vocabulary ids carry no mass (``-inf``).
    """
    w = jax.lax.stop_gradient(_head(params, config))
    h = jax.lax.stop_gradient(hidden)
    E, V = w.shape
    if not 1 <= k <= config.sampling_vocab_size:
        raise ValueError(f"topk_logprobs: k must be in [1, {config.sampling_vocab_size}], got {k}")
    chunk = max(min(chunk_size, V), k)
    num_chunks = -(-V // chunk)
    pad = num_chunks * chunk - V
    w = jnp.pad(w, ((0, 0), (0, pad))).reshape(E, num_chunks, chunk).transpose(1, 0, 2)
    starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    valid = (starts[:, None] + jnp.arange(chunk)[None, :]) < config.sampling_vocab_size

    def body(carry, xs):
        top, lse = carry
        w_c, valid_C = xs
        z = _chunk_logits(h, w_c, valid_C, 1.0)
        top = jax.lax.top_k(jnp.concatenate([top, jax.lax.top_k(z, k)[0]], axis=-1), k)[0]
        return (top, jnp.logaddexp(lse, jax.nn.logsumexp(z, axis=-1))), None

    init = (jnp.full(h.shape[:-1] + (k,), -jnp.inf, jnp.float32), jnp.full(h.shape[:-1], -jnp.inf, jnp.float32))
    (top, lse), _ = lax.scan(body, init, (w, valid))
    return top - lse[..., None]


# ----------------------------------------------------------------------------------------------- KV cache
def init_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16) -> dict:
    """Zeroed KV cache: ``{"k": (k_0, ..., k_{layers-1}), "v": (...)}``, one ``[B, K, L, H]`` buffer per layer
    (logical axes ``ACTIVATION_AXES["cache"]``; the row axis is 0 in every leaf).

    One buffer per layer (not a stacked ``[layers, ...]`` array) lets XLA update each layer's cache in place and
    read it without a copy; heads-major ``[B, K, L, H]`` makes each (row, KV head) a contiguous ``[L, H]``
    stream for decode attention. Measured on an H200 (qwen2.5-0.5b shape, 256 rows, 2k cache): a stacked cache
    under ``lax.scan`` ran a decode step in 20.5 ms, per-layer buffers in 4.4 ms (XLA attention) and 3.3 ms
    (Pallas ragged attention).
    """
    shape = (batch, config.num_kv_heads, length, config.head_dim)
    return {"k": tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
            "v": tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))}


def cache_length(cache: dict) -> int:
    return cache["k"][0].shape[2]


def _layer_params(params: Params, layer: int) -> dict:
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return layers[layer]
    return jax.tree.map(lambda a: a[layer], layers)


def unstack_layers(params: Params) -> Params:
    """Params whose ``layers`` is a tuple of per-layer dicts (decode/prefill accept both forms).

    Inside a jitted decode loop, slicing layer ``l`` out of the stacked ``[layers, ...]`` weights at every step
    costs a copy of the weights per step (measured on an H200, qwen2.5-0.5b, 256 rows: 1.87 -> 1.31 ms per step
    without attention); unstacking once before the loop removes it.
    """
    stacked = params["layers"]
    if isinstance(stacked, (list, tuple)):
        return params
    n = jax.tree.leaves(stacked)[0].shape[0]
    return dict(params, layers=tuple(jax.tree.map(lambda a, l=l: a[l], stacked) for l in range(n)))


def _fusable(lp: dict, names: tuple[str, ...]) -> bool:
    """Whether projections ``names`` of a layer can be concatenated: plain arrays without LoRA adapters (an
    unmerged adapter or a quantized base weight keeps its own matmul)."""
    adapters = lp.get("lora", {})
    return not any(n in adapters or isinstance(lp[n], lora.QArray) for n in names)


def fuse_projections(params: Params) -> Params:
    """Decode layout: :func:`unstack_layers`, then per layer ``wq|wk|wv -> wqkv [E, Q + 2K, H]`` (and
    ``bq|bk|bv -> bqkv``) and ``w_gate|w_up -> w_gate_up [E, 2, F]``.

    A decode step is a chain of small kernels (rows x hidden activations); one matmul instead of three (and two)
    per layer removes 3 kernel launches per layer. The result is the same function (each output column is the
    same dot product). Built once per sampler call, inside its jit (a copy of the projection weights for the
    rollout's duration).
    """
    params = unstack_layers(params)
    fused = []
    for lp in params["layers"]:
        lp = dict(lp)
        if "wq" in lp and _fusable(lp, ("wq", "wk", "wv")):
            lp["wqkv"] = jnp.concatenate([lp.pop("wq"), lp.pop("wk"), lp.pop("wv")], axis=1)
            if "bq" in lp:
                lp["bqkv"] = jnp.concatenate([lp.pop("bq"), lp.pop("bk"), lp.pop("bv")], axis=0)
        if "w_gate" in lp and _fusable(lp, ("w_gate", "w_up")):
            lp["w_gate_up"] = jnp.stack([lp.pop("w_gate"), lp.pop("w_up")], axis=1)
        fused.append(lp)
    return dict(params, layers=tuple(fused))


@apply_policy
def prefill(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            segment_ids: jax.Array, cache: dict, rows: jax.Array | None = None):
    """Runs a padded prompt batch and writes its keys/values into the cache at slots ``positions``.

    ``tokens, positions, segment_ids: [Bp, Lp]`` (``segment_ids`` 0 on padding, whose cache slots are not
    written). ``rows: [Bp]`` are the cache rows that receive the prompts (default ``0..Bp-1``). Returns
    ``(hidden [Bp, Lp, E], cache)``; pick ``hidden[b, length_b - 1]`` for the next-token distribution.
    Layers are unrolled (each writes its own cache buffer in place).
    """
    _check_tokens(tokens, positions)
    rows = jnp.arange(tokens.shape[0]) if rows is None else rows
    mask = segment_mask(segment_ids)
    # Padding tokens are written out of bounds and dropped.
    slots = jnp.where(segment_ids != 0, positions, cache_length(cache))
    return _chunk_layers(params, config, tokens, positions, slots, cache, rows,
                         lambda q, k, v, ck, cv: attention(q, k, v, mask))


def _chunk_layers(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                  cache: dict, rows: jax.Array, attend_with):
    """The layers over a chunk of tokens whose keys/values go to cache ``slots`` of ``rows`` (a slot ``>= L``:
    dropped); ``attend_with(q, k, v, k_cache, v_cache)`` is the layer's attention, given the chunk's projections
    and the layer's cache after the write. Returns ``(hidden after the final norm, cache)``."""
    x = embed(params, config, tokens)
    ks, vs = [], []
    for layer in range(config.num_layers):
        ck, cv = cache["k"][layer], cache["v"][layer]

        def attend(q, k, v, ck=ck, cv=cv):
            # ck[rows, :, slots] is [B, C, K, H]: the advanced indices come first.
            ck2 = ck.at[rows[:, None], :, slots].set(k.astype(ck.dtype), mode="drop")
            cv2 = cv.at[rows[:, None], :, slots].set(v.astype(cv.dtype), mode="drop")
            return attend_with(q, k, v, ck2, cv2), (ck2, cv2)

        x, (ck, cv) = _block(config, _layer_params(params, layer), x, positions, attend)
        ks.append(ck)
        vs.append(cv)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), {"k": tuple(ks), "v": tuple(vs)}


@apply_policy
def extend(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
           cache: dict, rows: jax.Array | None = None):
    """Appends a chunk of tokens to cache rows that already hold a prefix: a prefill over the existing cache.

    ``tokens, positions, valid: [B, C]`` (``valid`` False on padding, whose slots are not written); ``rows: [B]`` the
    cache rows (default ``0..B-1``). Each chunk token's key/value is written at slot ``positions[b, c]``, and it
    attends to every slot ``<= positions[b, c]`` of its row: the prefix already cached and the chunk's earlier
    tokens (the caller guarantees the slots below a chunk hold that row's prefix). Returns ``(hidden [B, C, E],
    cache)``: the hidden state after the final norm at each chunk token (the next-token distribution after the last
    valid one). Multi-turn rollouts append an environment's observation this way instead of re-prefilling the
    conversation (:func:`treejax.sampling.decode.append_tokens`).
    """
    _check_tokens(tokens, positions)
    rows = jnp.arange(tokens.shape[0]) if rows is None else rows
    L = cache_length(cache)
    slots = jnp.where(valid, positions, L)
    visible = jnp.arange(L)[None, None, :] <= positions[:, :, None]  # [B, C, L]

    def over_cache(q, k, v, ck, cv):
        kr = jnp.swapaxes(ck[rows], 1, 2).astype(q.dtype)  # [B, L, K, H]
        vr = jnp.swapaxes(cv[rows], 1, 2).astype(q.dtype)
        return attention(q, kr, vr, visible)

    return _chunk_layers(params, config, tokens, positions, slots, cache, rows, over_cache)


@functools.partial(jax.named_call, name="decode_step")
@apply_policy
def decode_step(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: dict,
                attend_len: int | None = None, attention_fn=None):
    """One decoding step for every cache row: ``tokens, positions: [B]``.

    Writes the new key/value at slot ``positions[b]`` (a position ``>= L`` drops the write: dead rows) and
    attends over slots ``0..positions[b]``. With the default attention only the first ``attend_len`` (static)
    slots are read; callers guarantee ``positions < attend_len``. Returns ``(hidden [B, E], cache)``.

    ``attention_fn(q [B, 1, Q, H], k_cache [B, K, L, H], v_cache [B, K, L, H], positions [B]) -> [B, 1, Q, H]``
    replaces the windowed masked attention (e.g. ``treejax.sampling.attention``'s ragged kernels, whose cost
    follows the longest live row); it receives the layer's whole cache after this step's write.
    """
    B = tokens.shape[0]
    b_idx = jnp.arange(B)
    if attention_fn is None:
        attention_fn = functools.partial(windowed_decode_attention, window=attend_len)
    x = embed(params, config, tokens[:, None])
    ks, vs = [], []
    for layer in range(config.num_layers):
        ck, cv = cache["k"][layer], cache["v"][layer]

        def attend(q, k, v, ck=ck, cv=cv):
            ck2 = ck.at[b_idx, :, positions].set(k[:, 0].astype(ck.dtype), mode="drop")
            cv2 = cv.at[b_idx, :, positions].set(v[:, 0].astype(cv.dtype), mode="drop")
            return attention_fn(q, ck2, cv2, positions), (ck2, cv2)

        x, (ck, cv) = _block(config, _layer_params(params, layer), x, positions[:, None], attend)
        ks.append(ck)
        vs.append(cv)
    return rms_norm(x[:, 0], params["final_norm"], config.rms_norm_eps), {"k": tuple(ks), "v": tuple(vs)}


@functools.partial(jax.named_call, name="decode_step_shared")
@apply_policy
def decode_step_shared(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: dict,
                       prefix: dict, base_R: jax.Array, attention_fn):
    """One decoding step over a shared-prefix cache (``treejax.sampling.cache.SharedPrefixCache``).

    ``cache``: the per-row suffix buffers ``{"k", "v"}`` (``[R, K, Ls, H]`` per layer); ``prefix``: the
    per-prompt buffers ``{"k", "v"}`` (``[P, K, Lpre, H]``), read only; ``base_R``: the prefix length ``n_p`` of
    each row's prompt. The token at RoPE position ``positions[r]`` writes its key/value at suffix slot
    ``j_r = positions[r] - base_R[r]`` (``j_r >= Ls`` drops the write: dead rows), then
    ``attention_fn(q [R, 1, Q, H], k_suf, v_suf, j_R, k_pre, v_pre) -> [R, 1, Q, H]`` attends over the row's
    prompt prefix and suffix slots ``0..j_r`` (e.g. ``treejax.sampling.attention.cascade_decode_attention``).
    Everything else is :func:`decode_step`. Returns ``(hidden [R, E], suffix cache)``.
    """
    B = tokens.shape[0]
    b_idx = jnp.arange(B)
    slots = positions - base_R
    x = embed(params, config, tokens[:, None])
    ks, vs = [], []
    for layer in range(config.num_layers):
        ck, cv = cache["k"][layer], cache["v"][layer]
        pk, pv = prefix["k"][layer], prefix["v"][layer]

        def attend(q, k, v, ck=ck, cv=cv, pk=pk, pv=pv):
            ck2 = ck.at[b_idx, :, slots].set(k[:, 0].astype(ck.dtype), mode="drop")
            cv2 = cv.at[b_idx, :, slots].set(v[:, 0].astype(cv.dtype), mode="drop")
            return attention_fn(q, ck2, cv2, slots, pk, pv), (ck2, cv2)

        x, (ck, cv) = _block(config, _layer_params(params, layer), x, positions[:, None], attend)
        ks.append(ck)
        vs.append(cv)
    return rms_norm(x[:, 0], params["final_norm"], config.rms_norm_eps), {"k": tuple(ks), "v": tuple(vs)}
