"""From a rollout forest to the update step's batch of full sequences.

Leaf ``w`` of prompt ``p`` becomes row ``b = p * W + w``: the prompt's ``n_p`` tokens followed by the leaf's
``m_pw`` response tokens, right-padded to ``L = Lp + T``::

    tokens[b, j]      = prompt[p, j]             for j < n_p
                      = response[p, w, j - n_p]  for n_p <= j < n_p + m_pw,   pad elsewhere
    positions[b, j]   = j,   segment_ids[b, j] = 1 on the n_p + m_pw real tokens, 0 on padding

Per-token response arrays (``[P, W, T]`` in the forest's layout: advantages, sampler log-probs, loss masks) are
moved to the same sequence positions, so ``batch[k][b, n_p + t]`` is response token ``t``'s value
(:func:`response_to_sequence`). The update step scores ``tokens[b, j]`` from the hidden state at ``j - 1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treejax.forest import Forest


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
                    pad_id: int = 0, eps_scale_PxW: jax.Array | None = None) -> dict[str, jax.Array]:
    """The update batch (``treejax.rl.update`` layout) for all ``P * W`` leaves of ``forest``.

    ``old_logp`` and ``sampler_logp`` both hold the sampler's log-probs of the policy at temperature 1. They are
    NOT the trainer's log pi_old: the sampler runs other kernels, a bf16 KV cache and bf16 weights on
    accelerators (on SmolLM2 the two differ by up to ~0.03 nats). ``treejax.rl.step`` replaces ``old_logp`` by
    the trainer's own forward (default) and keeps ``sampler_logp`` for truncated importance sampling; a caller
    that trains on this batch directly uses the sampler's values as pi_old. ``loss_mask`` defaults to the
    forest's; ``eps_scale_PxW`` (optional) becomes the per-sequence clip-range multiplier ``eps_scale``.
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
    valid = forest.segment_index >= 0
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
    return out
