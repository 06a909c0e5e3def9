"""The learner's one batch type, and the expanded rows built from a rollout forest.

:class:`Batch` is what every update, old-log-prob pass and loss reads, whichever layout built it
(:mod:`treejax.rl.layouts`). Its per-pair arrays are in **pair layout** ``[rows, *pairs]`` (row axis first, so
micro-batches and data sharding split rows), one entry per (leaf, token) pair the loss may train on::

    loss_mask     float  1.0 where the pair is trained (already narrowed to pairs with a predecessor token)
    advantages    float  the pair's advantage
    old_logp      float  log pi_old of the pair's token (the PPO ratio's denominator)
    sampler_logp  float  optional: the sampler's log-prob (truncated importance sampling)
    ref_logp      float  optional: the frozen reference policy's log-prob (KL term)
    eps_scale     float  optional ``[rows, *pairs[:-1]]``: per-sequence clip-range multiplier
    token_eps_scale  float  optional: per-pair clip-range multiplier (an estimator's ``Advantages.clip_scale``),
                  on top of ``eps_scale``; 1 on pairs it does not cover (prompt, padding, observations)

and the aggregation terms ``num_sequences`` (the expanded batch's row count: Dr.GRPO's ``B``, filler leaves
included) and ``sequence_length`` (``Lp + T``: Dr.GRPO's default ``T_max``). ``inputs`` is the layout's own pytree:
:class:`SequenceInputs` for expanded rows (pairs = sequence positions ``[B, L]``), :class:`TreeInputs` for
tree-packed rows (pairs = leaf slots x response tokens ``[R, Wr, T]``).

Expanded rows (:func:`forest_to_batch`): leaf ``w`` of prompt ``p`` becomes row ``b = p * W + w``: the prompt's
``n_p`` tokens followed by the leaf's ``m_pw`` response tokens, right-padded to ``L = Lp + T``::

    tokens[b, j]      = prompt[p, j]             for j < n_p
                      = response[p, w, j - n_p]  for n_p <= j < n_p + m_pw,   pad elsewhere
    positions[b, j]   = j,   segment_ids[b, j] = 1 on the n_p + m_pw real tokens, 0 on padding

Per-token response arrays (``[P, W, T]`` in the forest's layout: advantages, sampler log-probs, loss masks) are
moved to the same sequence positions, so ``batch[k][b, n_p + t]`` is response token ``t``'s value
(:func:`response_to_sequence`). The update scores ``tokens[b, j]`` from the hidden state at ``j - 1``, so position
``j`` is trained only if ``loss_mask[b, j] > 0`` and ``j - 1`` lies in the same nonzero segment
(:func:`trainable_mask`, applied by :func:`expanded_batch`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from treejax.forest import Forest

PAIR_KEYS = ("loss_mask", "advantages", "old_logp", "sampler_logp", "ref_logp", "token_eps_scale")
REQUIRED_KEYS = ("tokens", "positions", "loss_mask", "old_logp", "advantages")
OPTIONAL_KEYS = ("segment_ids", "ref_logp", "sampler_logp", "eps_scale", "token_eps_scale")
PAIR_FILL = {"token_eps_scale": 1.0}  # value of a per-pair array where a layout has no pair (default 0)


@struct.dataclass
class SequenceInputs:
    """Expanded rows ``[B, L]``: ``tokens``, RoPE ``positions`` and ``segment_ids`` (0 = padding; equal nonzero ids
    attend causally to each other; ``None``: one segment per row)."""

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array | None = None


@struct.dataclass
class TreeInputs:
    """Tree-packed rows (:mod:`treejax.rl.packing`): per token ``[R, L]`` ``tokens``, ``positions``, ``node_lo`` /
    ``node_hi`` (the tree mask's preorder intervals), ``prev`` (the predictor's row index); the gather map
    ``pair_index [R, Wr, T]`` (row index of each pair's token) and ``leaf_id [R, Wr]`` (``p * W + w``; -1 empty)."""

    tokens: jax.Array
    positions: jax.Array
    node_lo: jax.Array
    node_hi: jax.Array
    prev: jax.Array
    pair_index: jax.Array
    leaf_id: jax.Array


@struct.dataclass
class Batch:
    """One batch of (leaf, token) pairs for the loss (module docstring)."""

    inputs: Any
    loss_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    sampler_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    eps_scale: jax.Array | None = None
    token_eps_scale: jax.Array | None = None
    num_sequences: int = struct.field(pytree_node=False, default=0)
    sequence_length: int = struct.field(pytree_node=False, default=0)

    @property
    def num_rows(self) -> int:
        return self.loss_mask.shape[0]

    def flat(self, name: str) -> jax.Array | None:
        """A per-pair array as ``[pairs, T]`` rows for the loss (``eps_scale`` as ``[pairs]``); ``None`` if absent."""
        v = getattr(self, name)
        if v is None:
            return None
        return v.reshape(-1) if name == "eps_scale" else v.reshape((-1, v.shape[-1]))

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first mis-shaped field."""
        shape = tuple(self.loss_mask.shape)
        for k in PAIR_KEYS[1:]:
            v = getattr(self, k)
            if v is not None and tuple(v.shape) != shape:
                raise ValueError(f"batch: {k} has shape {tuple(v.shape)}, expected {shape} (like loss_mask)")
        if self.eps_scale is not None and tuple(self.eps_scale.shape) != shape[:-1]:
            raise ValueError(f"batch: eps_scale has shape {tuple(self.eps_scale.shape)}, expected {shape[:-1]}")
        for path, v in jax.tree_util.tree_leaves_with_path(self.inputs):
            if v.shape[:1] != shape[:1]:
                raise ValueError(f"batch: inputs{jax.tree_util.keystr(path)} has {v.shape[0]} rows, the pairs "
                                 f"{shape[0]}")
        if self.num_sequences < 1 or self.sequence_length < 1:
            raise ValueError("batch: num_sequences and sequence_length must be set (>= 1)")

    def take_rows(self, idx: jax.Array) -> "Batch":
        """Rows ``idx`` of an expanded batch (every row one sequence): a mini-batch."""
        out = jax.tree.map(lambda v: jnp.take(v, idx, axis=0), self)
        return out.replace(num_sequences=int(idx.shape[0]))


def trainable_mask(batch: dict[str, jax.Array]) -> jax.Array:
    """``loss_mask`` restricted to positions whose previous token is in the same nonzero segment."""
    mask = batch["loss_mask"].astype(jnp.float32)
    seg = batch.get("segment_ids")
    if seg is None:
        seg = jnp.ones_like(batch["tokens"])
    prev_seg = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    return mask * ((seg == prev_seg) & (seg != 0)).astype(jnp.float32)


def validate_batch(batch: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the first missing, unknown or mis-shaped entry of an expanded dict batch."""
    for k in REQUIRED_KEYS:
        if k not in batch:
            raise ValueError(f"update batch is missing {k!r}; required keys: {REQUIRED_KEYS}")
    unknown = set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"update batch has unknown keys {sorted(unknown)}; allowed: {REQUIRED_KEYS + OPTIONAL_KEYS}")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 2:
        raise ValueError(f"batch['tokens'] must be [B, L], got {shape}")
    for k, v in batch.items():
        want = shape[:1] if k == "eps_scale" else shape
        if tuple(v.shape) != want:
            raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}, expected {want}")


def expanded_batch(batch: dict[str, jax.Array]) -> Batch:
    """The :class:`Batch` of an expanded dict batch (keys as :func:`forest_to_batch` returns them:
    ``tokens``, ``positions``, ``loss_mask``, ``old_logp``, ``advantages`` and optionally ``segment_ids``,
    ``sampler_logp``, ``ref_logp``, ``eps_scale``, ``token_eps_scale``); the loss mask is narrowed by :func:`trainable_mask`."""
    validate_batch(batch)
    B, L = batch["tokens"].shape
    return Batch(inputs=SequenceInputs(batch["tokens"], batch["positions"], batch.get("segment_ids")),
                 loss_mask=trainable_mask(batch), advantages=batch["advantages"], old_logp=batch["old_logp"],
                 sampler_logp=batch.get("sampler_logp"), ref_logp=batch.get("ref_logp"),
                 eps_scale=batch.get("eps_scale"), token_eps_scale=batch.get("token_eps_scale"), num_sequences=int(B), sequence_length=int(L))


def response_to_sequence(x_PxWxT: jax.Array, prompt_lengths_P: jax.Array, seq_len: int, fill=0) -> jax.Array:
    """Moves a per-response-token array into sequence layout ``[P * W, seq_len]`` (``fill`` off the response)."""
    P, W, T = x_PxWxT.shape
    j = jnp.arange(seq_len)[None, None, :]
    r = j - prompt_lengths_P[:, None, None]  # response index of sequence position j
    inside = (r >= 0) & (r < T)
    gathered = jnp.take_along_axis(x_PxWxT, jnp.clip(r, 0, T - 1) * jnp.ones((1, W, 1), jnp.int32), axis=2)
    out = jnp.where(inside, gathered, jnp.asarray(fill, x_PxWxT.dtype))
    return out.reshape(P * W, seq_len)


def forest_to_batch(prompt_tokens_PxLp: jax.Array, prompt_lengths_P: jax.Array, forest: Forest,
                    advantages_PxWxT: jax.Array, loss_mask_PxWxT: jax.Array | None = None,
                    pad_id: int = 0, eps_scale_PxW: jax.Array | None = None,
                    token_eps_scale_PxWxT: jax.Array | None = None) -> dict[str, jax.Array]:
    """The update batch (``treejax.rl.update`` layout) for all ``P * W`` leaves of ``forest``.

    ``old_logp`` and ``sampler_logp`` both hold the sampler's log-probs of the policy at temperature 1. They are
    NOT the trainer's log pi_old: the sampler runs other kernels, a bf16 KV cache and bf16 weights on
    accelerators (on SmolLM2 the two differ by up to ~0.03 nats). ``treejax.rl.step`` replaces ``old_logp`` by
    the trainer's own forward (default) and keeps ``sampler_logp`` for truncated importance sampling; a caller
    that trains on this batch directly uses the sampler's values as pi_old. ``loss_mask`` defaults to the
    forest's; ``eps_scale_PxW`` (optional) becomes the per-sequence clip-range multiplier ``eps_scale``;
    ``token_eps_scale_PxWxT`` (optional, an estimator's ``Advantages.clip_scale``) the per-token one
    ``token_eps_scale``, moved to the sequence positions like the advantages (1 on the prompt, padding and
    observation tokens).

    Turn forests (:func:`treejax.forest.forest_from_spans`): each row holds every response token of its leaf,
    the environment's observation tokens included (they are context for the tokens after them), at position
    ``n_p + t``; the loss mask is 0 on them (``Forest.policy_mask``), whatever ``loss_mask_PxWxT`` says.
    """
    P, Lp = prompt_tokens_PxLp.shape
    W, T = forest.num_leaves, forest.max_response_length
    L = Lp + T
    lens = prompt_lengths_P.astype(jnp.int32)
    j = jnp.arange(L)[None, :]
    prompt_part = jnp.pad(prompt_tokens_PxLp, ((0, 0), (0, T)), constant_values=pad_id)  # [P, L]
    prompt_part = jnp.repeat(prompt_part, W, axis=0)
    lens_B = jnp.repeat(lens, W)
    resp = response_to_sequence(forest.tokens, lens, L, fill=pad_id)
    total_B = lens_B + forest.leaf_length.reshape(P * W)
    tokens = jnp.where(j < lens_B[:, None], prompt_part, resp)
    real = j < total_B[:, None]
    tokens = jnp.where(real, tokens, pad_id).astype(jnp.int32)
    mask = forest.loss_mask if loss_mask_PxWxT is None else loss_mask_PxWxT
    valid = forest.policy_tokens() > 0  # observation tokens (policy_mask 0) are inputs, never in the loss
    sampler_logp = response_to_sequence(forest.logprobs, lens, L)
    out = {
        "tokens": tokens,
        "positions": jnp.broadcast_to(j, tokens.shape).astype(jnp.int32),
        "segment_ids": real.astype(jnp.int32),
        "loss_mask": response_to_sequence(jnp.where(valid, mask, 0.0).astype(jnp.float32), lens, L),
        "old_logp": sampler_logp,
        "sampler_logp": sampler_logp,
        "advantages": response_to_sequence(advantages_PxWxT.astype(jnp.float32), lens, L),
    }
    if eps_scale_PxW is not None:
        out["eps_scale"] = eps_scale_PxW.reshape(P * W).astype(jnp.float32)
    if token_eps_scale_PxWxT is not None:
        scale = jnp.where(valid, jnp.asarray(token_eps_scale_PxWxT, jnp.float32), 1.0)
        out["token_eps_scale"] = response_to_sequence(scale, lens, L, fill=1.0)
    return out
