"""Layouts: how a step's rollouts become mini-batches, and how a batch's (leaf, token)-pair log-probs are computed.

A :class:`Layout` is the one seam between the rollout forest and the loss. Both layouts train the same pairs with
the same loss and gradient (``tests/rl/test_packing.py``); they differ in the rows the model runs on:

* :class:`Expanded`: one row per leaf, prompt + response (:func:`treejax.rl.batch.forest_to_batch`); a pair is a
  sequence position, ``[B, L]``; mini-batches are random groups of rows;
* :class:`Packed`: each prompt and each shared node segment once, with a tree attention mask
  (:mod:`treejax.rl.packing`); a pair is (leaf slot, response token), ``[R, Wr, T]``, read from the unique tokens
  through a gather map; mini-batches are random groups of prompts (whole trees).

The learner (:func:`treejax.rl.step.learn`) only calls the protocol:

    pool = layout.pool(rollouts, adv_PxWxT, adv_mask_PxWxT, eps_scale_PxW, token_eps_scale_PxWxT=None)
                                             every pair of the step, full layout
    plan = layout.plan(pool, units)          one mini-batch of ``units`` (rows or prompts) of ``range(pool.units)``
    batch = layout.assemble(pool, plan)      its :class:`~treejax.rl.batch.Batch`
    pool_x = layout.scatter(pool_x, plans, xs)  per-pair values of mini-batches back into the pool's layout
    logp, entropy = layout.pair_logprobs(params, batch.inputs, with_entropy=True)   [rows, *pairs]
    stats = layout.pair_stats(params, batch.inputs, with_entropy=True, top_k=5)      the shapers' trainer pass
    resp = layout.to_response(pool_x, prompt_lengths, T); layout.from_response(resp, prompt_lengths, pool_x)

and the update (:func:`treejax.rl.update.make_update_fn`) differentiates ``policy_loss . pair_logprobs``. A new
layout (e.g. a sequence-parallel one) implements these and ``describe`` (its plan sizes for the logs).

Log-probabilities (both layouts): ``logp = log pi(token | prefix)`` from the training forward in vocabulary chunks
(:func:`treejax.models.transformer.token_logprobs`); token ``i`` is scored from the hidden state of its predictor
(the previous position in a row; the parent's last token at a packed node's first token).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import transformer
from treejax.models.config import ModelConfig
from treejax.models.tree_flash import TreeFlashBlocks
from treejax.models.tree_splash import TreeSplashBlocks
from treejax.rl import packing as packing_lib
from treejax.rl.batch import (PAIR_KEYS, Batch, SequenceInputs, TreeInputs, expanded_batch, forest_to_batch,
                              response_to_sequence)


@dataclasses.dataclass
class Pool:
    """Every (leaf, token) pair of one step in a layout's full form, before mini-batching.

    ``batch``: the per-pair arrays (Expanded: the whole batch, every row; Packed: the leaf layout ``[P * W, T]``
    with ``inputs = None``); ``units``: how many things mini-batches split (rows / prompts); ``host``: the layout's
    host data for planning (Packed: the forest's arrays on this process)."""

    batch: Batch
    units: int
    host: Any = None


class Layout(Protocol):
    def pool(self, rollouts, adv_PxWxT: jax.Array, adv_mask_PxWxT: jax.Array, eps_scale_PxW: jax.Array,
             token_eps_scale_PxWxT: jax.Array | None = None) -> Pool:
        """Every pair of ``rollouts`` with the estimator's advantages, the per-leaf clip scale and, when given (an
        estimator's ``Advantages.clip_scale``), the per-token clip scale as the pairs' ``token_eps_scale`` (1 on
        pairs off the policy tokens; ``None``: the batch has no such array and the programs are the same as
        without it)."""

    def plan(self, pool: Pool, units: jax.Array) -> Any:
        """One mini-batch's plan: the units (rows or prompts) it holds."""

    def assemble(self, pool: Pool, plan: Any) -> Batch:
        """The mini-batch of ``plan``, per-pair arrays read from ``pool.batch``."""

    def scatter(self, pool_x: jax.Array, plans: list, xs: list) -> jax.Array:
        """Writes mini-batches' per-pair values ``xs`` (one per plan) into ``pool_x`` (the pool's layout)."""

    def pair_logprobs(self, params: Any, inputs: Any, *, with_entropy: bool = False, remat: bool | str = False):
        """``logp [rows, *pairs]`` (and the entropy of each pair's next-token distribution)."""

    def pair_stats(self, params: Any, inputs: Any, *, with_entropy: bool = False, top_k: int = 0,
                   with_hidden: bool = False) -> dict:
        """``{"logp", "entropy"?, "topk_logp"?, "hidden"?}`` per pair ``[rows, *pairs(, k | E)]`` from one forward,
        no gradient needed (the old-log-prob pass of the shapers, :mod:`treejax.rl.shaping`)."""

    def to_response(self, pool_x: jax.Array, prompt_lengths_P: jax.Array, response_length: int) -> jax.Array:
        """A pool per-pair array ``[P * W, X, ...]`` in the leaves' response layout ``[P * W, T, ...]`` (response
        token ``t`` of leaf ``p * W + w`` at ``[p * W + w, t]``; 0 where a layout has no such pair)."""

    def from_response(self, x: jax.Array, prompt_lengths_P: jax.Array, pool_x: jax.Array) -> jax.Array:
        """The inverse of :meth:`to_response` for per-pair values ``[P * W, T]`` (0 off the response), in
        ``pool_x``'s layout and dtype."""

    def describe(self, plans: list) -> dict[str, int]:
        """Host metrics of one epoch's plans (``packing/...``)."""


# ----------------------------------------------------------------------------------------------- forwards
def sequence_stats(params: Any, model_config: ModelConfig, tokens_BxL: jax.Array, positions_BxL: jax.Array,
                   segment_ids_BxL: jax.Array | None = None, *, chunk_size: int = 8192, with_entropy: bool = False,
                   top_k: int = 0, with_hidden: bool = False, remat: bool | str = False,
                   attention_impl: str = "xla") -> dict[str, jax.Array]:
    """Per-position statistics of ``tokens[b, t]`` under the training forward, aligned with ``tokens`` (0 at
    ``t = 0``): ``logp`` = ``log pi(tokens[b, t] | tokens[b, :t])``; with ``with_entropy`` ``entropy`` of that
    next-token distribution; with ``top_k > 0`` ``topk_logp [B, L, k]``, its ``k`` largest log-probs (no gradient,
    :func:`treejax.models.transformer.topk_logprobs`); with ``with_hidden`` ``hidden [B, L, E]``, the last layer's
    output (after the final norm) at token ``t``'s own position (the state that predicts ``tokens[b, t + 1]``).

    Runs the training forward once and scores each next token in vocabulary chunks.
    """
    hidden = transformer.forward(params, model_config, tokens_BxL, positions_BxL, segment_ids_BxL, remat=remat,
                                 attention_impl=attention_impl)
    next_BxL = jnp.roll(tokens_BxL, -1, axis=1)  # targets of hidden[:, t] are tokens[:, t + 1]
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # noqa: E731
    out = {k: shift(v) for k, v in _head_stats(params, model_config, hidden, next_BxL, chunk_size, with_entropy,
                                                top_k).items()}
    if with_hidden:
        out["hidden"] = jax.lax.stop_gradient(hidden)
    return out


def _head_stats(params, model_config, hidden, targets, chunk_size, with_entropy, top_k) -> dict[str, jax.Array]:
    out = transformer.token_logprobs(params, model_config, hidden, targets, chunk_size=chunk_size,
                                     with_entropy=with_entropy)
    stats = dict(zip(("logp", "entropy"), out)) if with_entropy else {"logp": out}
    if top_k:
        stats["topk_logp"] = transformer.topk_logprobs(params, model_config, hidden, top_k, chunk_size=chunk_size)
    return stats


def sequence_logprobs(params: Any, model_config: ModelConfig, tokens_BxL: jax.Array, positions_BxL: jax.Array,
                      segment_ids_BxL: jax.Array | None = None, *, chunk_size: int = 8192, with_entropy: bool = False,
                      remat: bool | str = False, attention_impl: str = "xla"):
    """``logp[b, t] = log pi(tokens[b, t] | tokens[b, :t])`` aligned with ``tokens`` (``logp[:, 0] = 0``), and with
    ``with_entropy`` the entropy of the distribution that produced ``tokens[b, t]`` (:func:`sequence_stats`)."""
    s = sequence_stats(params, model_config, tokens_BxL, positions_BxL, segment_ids_BxL, chunk_size=chunk_size,
                       with_entropy=with_entropy, remat=remat, attention_impl=attention_impl)
    return (s["logp"], s["entropy"]) if with_entropy else s["logp"]


def packed_stats(params: Any, model_config: ModelConfig, inputs: TreeInputs, *, chunk_size: int = 8192,
                 with_entropy: bool = False, top_k: int = 0, with_hidden: bool = False, remat: bool | str = False,
                 attention_impl: str = "xla", blocks=None) -> dict[str, jax.Array]:
    """Statistics of every unique token of packed rows, ``[R, L]`` (``topk_logp [R, L, k]``), computed once.

    ``hidden = forward_tree(tokens)``; token ``i`` is scored from the hidden state of its predictor
    ``prev[i]`` (the previous token of its node, or its parent's last token at a node's first token)::

        logp[r, i] = log_softmax(h[r, prev[r, i]] W)[tokens[r, i]],   H[r, i] = entropy of that distribution

    (values at tokens without a predecessor, ``prev = -1``, are meaningless and never gathered as trained pairs);
    ``entropy`` / ``topk_logp`` / ``hidden`` (at the token's own position) as in :func:`sequence_stats`.
    """
    hidden = transformer.forward_tree(params, model_config, inputs.tokens, inputs.positions, inputs.node_lo,
                                      inputs.node_hi, remat=remat, attention_impl=attention_impl, blocks=blocks)
    h_prev = jnp.take_along_axis(hidden, jnp.maximum(inputs.prev, 0)[:, :, None], axis=1)
    out = _head_stats(params, model_config, h_prev, inputs.tokens, chunk_size, with_entropy, top_k)
    if with_hidden:
        out["hidden"] = jax.lax.stop_gradient(hidden)
    return out


def packed_logprobs(params: Any, model_config: ModelConfig, inputs: TreeInputs, *, chunk_size: int = 8192,
                    with_entropy: bool = False, remat: bool | str = False, attention_impl: str = "xla",
                    blocks=None):
    """``logp [R, L]`` (and ``entropy``) of every unique token of packed rows (:func:`packed_stats`)."""
    s = packed_stats(params, model_config, inputs, chunk_size=chunk_size, with_entropy=with_entropy, remat=remat,
                     attention_impl=attention_impl, blocks=blocks)
    return (s["logp"], s["entropy"]) if with_entropy else s["logp"]


def gather_pairs(x_RxL: jax.Array, pair_index_RxWxT: jax.Array) -> jax.Array:
    """Per unique token ``[R, L, *rest]`` -> per (leaf slot, response token) pair ``[R, Wr, T, *rest]`` (the gather
    map of the packed batch; its transpose in the backward pass sums each pair's gradient into its unique token)."""
    R, Wr, T = pair_index_RxWxT.shape
    idx = pair_index_RxWxT.reshape((R, Wr * T) + (1,) * (x_RxL.ndim - 2))
    return jnp.take_along_axis(x_RxL, idx, axis=1).reshape((R, Wr, T) + x_RxL.shape[2:])


# ----------------------------------------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True, eq=False)
class Expanded:
    """One row per leaf (module docstring). ``attention_impl``: the training attention
    (:data:`treejax.models.transformer.TRAIN_ATTENTION_IMPLS`)."""

    model_config: ModelConfig
    pad_id: int = 0
    attention_impl: str = "auto"
    chunk_size: int = 8192

    def __post_init__(self):
        object.__setattr__(self, "_pool", jax.jit(self._pool_body))
        object.__setattr__(self, "_take", jax.jit(Batch.take_rows))

    def _pool_body(self, prompts, lens, forest, adv_tokens, adv_mask, eps_scale_PxW, token_eps_scale) -> Batch:
        return expanded_batch(forest_to_batch(prompts, lens, forest, adv_tokens, adv_mask, self.pad_id,
                                              eps_scale_PxW=eps_scale_PxW, token_eps_scale_PxWxT=token_eps_scale))

    def pool(self, rollouts, adv_PxWxT, adv_mask_PxWxT, eps_scale_PxW, token_eps_scale_PxWxT=None) -> Pool:
        batch = self._pool(jnp.asarray(rollouts.prompts_PxLp), jnp.asarray(rollouts.lengths_P), rollouts.forest,
                           adv_PxWxT, adv_mask_PxWxT, eps_scale_PxW, token_eps_scale_PxWxT)
        return Pool(batch, batch.num_rows)

    def plan(self, pool: Pool, units: jax.Array) -> jax.Array:
        return units

    def assemble(self, pool: Pool, plan: jax.Array) -> Batch:
        return self._take(pool.batch, plan)

    def scatter(self, pool_x: jax.Array, plans: list, xs: list) -> jax.Array:
        return pool_x.at[jnp.concatenate(plans)].set(jnp.concatenate(xs))

    def pair_logprobs(self, params, inputs: SequenceInputs, *, with_entropy: bool = False, remat: bool | str = False):
        return sequence_logprobs(params, self.model_config, inputs.tokens, inputs.positions, inputs.segment_ids,
                                 chunk_size=self.chunk_size, with_entropy=with_entropy, remat=remat,
                                 attention_impl=self.attention_impl)

    def pair_stats(self, params, inputs: SequenceInputs, *, with_entropy: bool = False, top_k: int = 0,
                   with_hidden: bool = False) -> dict:
        return sequence_stats(params, self.model_config, inputs.tokens, inputs.positions, inputs.segment_ids,
                              chunk_size=self.chunk_size, with_entropy=with_entropy, top_k=top_k,
                              with_hidden=with_hidden, attention_impl=self.attention_impl)

    def to_response(self, pool_x: jax.Array, prompt_lengths_P: jax.Array, response_length: int) -> jax.Array:
        return self._to_response(pool_x, jnp.asarray(prompt_lengths_P), response_length)

    def from_response(self, x: jax.Array, prompt_lengths_P: jax.Array, pool_x: jax.Array) -> jax.Array:
        return self._from_response(x, jnp.asarray(prompt_lengths_P), pool_x)

    @staticmethod
    @functools.partial(jax.jit, static_argnums=2)
    def _to_response(pool_x, lens_P, T):
        rows, L = pool_x.shape[:2]
        col = jnp.repeat(lens_P.astype(jnp.int32), rows // lens_P.shape[0])[:, None] + jnp.arange(T)[None, :]
        idx = jnp.clip(col, 0, L - 1).reshape((rows, T) + (1,) * (pool_x.ndim - 2))
        out = jnp.take_along_axis(pool_x, idx, axis=1)
        return jnp.where((col < L).reshape(idx.shape), out, jnp.zeros((), pool_x.dtype))

    @staticmethod
    @jax.jit
    def _from_response(x, lens_P, pool_x):
        P = lens_P.shape[0]
        seq = response_to_sequence(x.reshape((P, -1) + x.shape[1:]), lens_P, pool_x.shape[1])
        return seq.astype(pool_x.dtype)

    def describe(self, plans: list) -> dict[str, int]:
        return {}


@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
    """Tree-packed rows (module docstring; :mod:`treejax.rl.packing`). ``row_multiple``: the packed row count is a
    multiple of it (micro-batches x batch-sharded devices). With ``packing.sticky`` the layout is fixed at the first
    mini-batch from the config's bounds (host state, :class:`~treejax.rl.packing.LayoutFloor`,
    :func:`~treejax.rl.packing.startup_layout`) and later mini-batches are packed into it: the update compiles once
    (again only if a mini-batch needs more rows). ``blocks``: the Pallas tree kernel's tiles
    (``tree_flash.TreeFlashBlocks`` for ``"pallas"``, ``tree_splash.TreeSplashBlocks`` for ``"pallas_tpu"``,
    ``tree_flash_mgpu.TreeFlashMgpuBlocks`` for ``"pallas_mgpu"``;
    ``None``: the kernel's defaults, ``tree_flash.default_blocks`` of the head size / ``tree_splash.default_blocks``
    of the row length)."""

    model_config: ModelConfig
    packing: packing_lib.PackingConfig = packing_lib.PackingConfig()
    pad_id: int = 0
    row_multiple: int = 1
    chunk_size: int = 8192
    floor: packing_lib.LayoutFloor | None = None
    blocks: TreeFlashBlocks | TreeSplashBlocks | None = None

    def __post_init__(self):
        if self.floor is None and self.packing.sticky:
            object.__setattr__(self, "floor", packing_lib.LayoutFloor())
        object.__setattr__(self, "_pairs", jax.jit(packing_lib.forest_pairs))

    def pool(self, rollouts, adv_PxWxT, adv_mask_PxWxT, eps_scale_PxW, token_eps_scale_PxWxT=None) -> Pool:
        forest = rollouts.forest
        P, W, T = forest.tokens.shape
        pairs = self._pairs(forest, adv_PxWxT, adv_mask_PxWxT, token_eps_scale_PxWxT)
        host = packing_lib.host_forest(rollouts.prompts_PxLp, rollouts.lengths_P, forest, pairs["loss_mask"])
        batch = Batch(inputs=None, eps_scale=eps_scale_PxW.reshape(P * W), num_sequences=P * W,
                      sequence_length=rollouts.prompts_PxLp.shape[1] + T, **pairs)
        return Pool(batch, P, host)

    def plan(self, pool: Pool, units) -> packing_lib.PackingPlan:
        h = pool.host
        if self.floor is not None and self.floor.shape is None:  # the run's start-up layout, from the bounds
            P, W, T = h["tokens"].shape
            trees = len(np.asarray(units))
            self.floor.start(packing_lib.startup_layout(
                self.packing, prompt_width=h["prompts"].shape[1], num_leaves=W, response_length=T,
                num_nodes=h["node_parent"].shape[1],
                node_length=h["segment_length"] if h["fixed_segments"] else T, trees=trees,
                row_multiple=self.row_multiple), max_rows=-(-trees // self.row_multiple) * self.row_multiple)
        pl = packing_lib.plan_packing(h["prompts"], h["lengths"], h["path"], h["length"], h["tokens"],
                                      h["segment_length"], self.packing, prompts=np.asarray(units),
                                      trained_PxW=h["trained"], row_multiple=self.row_multiple, pad_id=self.pad_id,
                                      floor=None if self.floor is None else self.floor.shape,
                                      node_parent_PxN=h["node_parent"], node_depth_PxN=h["node_depth"],
                                      node_span_PxNx2=h["spans"], balance=self.floor is not None)
        if self.floor is not None:
            self.floor.grow(pl.shape)
        return pl

    def assemble(self, pool: Pool, plan: packing_lib.PackingPlan) -> Batch:
        b = pool.batch
        pairs = {k: getattr(b, k) for k in PAIR_KEYS if getattr(b, k) is not None}
        return packing_lib.packed_batch(plan, pairs, b.eps_scale)

    def scatter(self, pool_x: jax.Array, plans: list, xs: list) -> jax.Array:
        for plan, x in zip(plans, xs):
            pool_x = packing_lib.unpack_pairs(plan, x, pool_x.shape[0], out=pool_x)
        return pool_x

    def pair_logprobs(self, params, inputs: TreeInputs, *, with_entropy: bool = False, remat: bool | str = False):
        out = packed_logprobs(params, self.model_config, inputs, chunk_size=self.chunk_size,
                              with_entropy=with_entropy, remat=remat, attention_impl=self.packing.attention_impl,
                              blocks=self.blocks)
        if with_entropy:
            return gather_pairs(out[0], inputs.pair_index), gather_pairs(out[1], inputs.pair_index)
        return gather_pairs(out, inputs.pair_index)

    def pair_stats(self, params, inputs: TreeInputs, *, with_entropy: bool = False, top_k: int = 0,
                   with_hidden: bool = False) -> dict:
        out = packed_stats(params, self.model_config, inputs, chunk_size=self.chunk_size, with_entropy=with_entropy,
                           top_k=top_k, with_hidden=with_hidden, attention_impl=self.packing.attention_impl,
                           blocks=self.blocks)
        return {k: gather_pairs(v, inputs.pair_index) for k, v in out.items()}

    def to_response(self, pool_x: jax.Array, prompt_lengths_P: jax.Array, response_length: int) -> jax.Array:
        return pool_x  # the pool is already in the leaves' response layout

    def from_response(self, x: jax.Array, prompt_lengths_P: jax.Array, pool_x: jax.Array) -> jax.Array:
        return x.astype(pool_x.dtype)

    def describe(self, plans: list) -> dict[str, int]:
        """Real tokens in the packed rows, tokens the expanded rows would hold and packed row slots (padding
        included), summed over ``plans``; with sticky layouts the distinct layouts so far (one compile each)."""
        info = {"packing/unique_tokens": sum(pl.unique_tokens for pl in plans),
                "packing/expanded_tokens": sum(pl.expanded_tokens for pl in plans),
                "packing/row_tokens": sum(pl.shape[0] * pl.shape[1] for pl in plans)}
        if self.floor is not None:
            info["packing/layouts"] = len(self.floor.layouts)
            if self.floor.precompiled is not None:
                info["packing/precompiled"] = self.floor.precompiled
        return info


def make_layout(model_config: ModelConfig, packing: packing_lib.PackingConfig | None = None, *, pad_id: int = 0,
                attention_impl: str = "auto", row_multiple: int = 1, chunk_size: int = 8192) -> Expanded | Packed:
    """:class:`Packed` with ``packing`` (its own tree attention), else :class:`Expanded` with ``attention_impl``."""
    if packing is None:
        return Expanded(model_config, pad_id=pad_id, attention_impl=attention_impl, chunk_size=chunk_size)
    return Packed(model_config, packing, pad_id=pad_id, row_multiple=row_multiple, chunk_size=chunk_size)


__all__ = ["Layout", "Pool", "Expanded", "Packed", "make_layout", "sequence_logprobs", "sequence_stats",
           "packed_logprobs", "packed_stats", "gather_pairs"]
