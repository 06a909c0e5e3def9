"""Rollouts started from inside a leaf: Monte-Carlo continuations at cut points, forked from the leaf's own KV.

SPO-chain (:mod:`treejax.rl.advantages.spo_chain`) estimates the value of a response prefix by sampling ``K``
fresh continuations from it. Here that happens in the rollout's own jitted program, right after the tree is done,
while every leaf's KV is still in its cache row: a continuation from cut ``s`` of leaf ``l`` (keep the first ``s``
response tokens, sample token ``s`` onwards) is a copy of ``l``'s cache row with the position moved back to the
cut. The prompt and the kept prefix are never prefilled again, and the prefix KV is exactly the one the leaf
decoded with (the row protocol of :mod:`treejax.sampling.decode`: the pending token is the leaf's token ``s - 1``,
or the prompt's last token when ``s = 0``, fed at its own position; slots past it are overwritten).

Cut points (:func:`low_probability_cuts`, SPO-chain's rule): the response positions ``i`` whose sampled token had
``pi(y_i | prefix) < threshold`` (the policy at temperature 1, the forest's ``logprobs``), every ``interval``-th of
them in order (the 1st, the ``interval + 1``-th, ...), at most ``max_cuts`` per leaf. A cut at ``i`` keeps
``y_0 .. y_{i-1}`` and re-samples from position ``i`` on, so the continuations re-draw the low-probability token
itself.

Work: the ``R * B`` (leaf, cut) pairs that exist are packed first and decoded in rounds of ``rows_per_round``
rows (``K`` rows per pair), each round one gather of the leaves' cache rows into a work cache and one decode loop
that runs until every row stopped (a stop token, kept in the output, or the response capacity ``T``: a
continuation from cut ``s`` decodes at most ``T - s`` tokens). Rows of pairs that do not exist are never decoded.
Randomness: continuation ``k`` of pair ``j`` (``j = leaf * B + cut``) draws token ``t`` with
``token_keys(fold_in(key, CONTINUATION_STREAM), j * K + k, 0, t)``, whatever round it lands in.

The tree rollout runs this when it is given a :class:`ContinuationConfig` (``make_tree_rollout(...,
continuations=...)``); the result is :attr:`treejax.sampling.tree_state.RolloutInfo.continuations`. Only leaves
whose KV is still resident at the end have cuts (every leaf of independent chains, ``b = 1``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from treejax.sampling import cache as cache_lib
from treejax.sampling import decode
from treejax.sampling.strategies import Strategy

CONTINUATION_STREAM = 0x2C07  # fold_in constant of the continuations' token keys


@dataclasses.dataclass(frozen=True)
class ContinuationConfig:
    """Static settings of the continuations (hashable; part of the rollout's jit signature).

    ``threshold``: a response token is a cut candidate when its probability is below it (SPO: 0.9);
    ``interval``: keep every ``interval``-th candidate (SPO's "int5": 5); ``max_cuts`` ``B``: cuts per leaf at most
    (the first ``B``; static shapes); ``samples`` ``K``: continuations per cut (SPO: 9); ``rows_per_round``: rows
    decoded together (a multiple of ``K``; 0 = ``K * R``, every leaf's first cut in one round)."""

    threshold: float = 0.9
    interval: int = 5
    max_cuts: int = 8
    samples: int = 9
    rows_per_round: int = 0

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"ContinuationConfig.threshold must be in (0, 1], got {self.threshold}")
        for name in ("interval", "max_cuts", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"ContinuationConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.rows_per_round < 0 or self.rows_per_round % self.samples:
            raise ValueError(f"ContinuationConfig.rows_per_round must be 0 or a positive multiple of samples="
                             f"{self.samples}, got {self.rows_per_round}")

    def round_rows(self, leaf_rows: int) -> int:
        """Rows decoded per round: ``rows_per_round``, or ``K`` per leaf row."""
        return self.rows_per_round or self.samples * leaf_rows


@struct.dataclass
class Continuations:
    """``K`` continuations from each of ``B`` cuts of each of the ``P x W`` leaves.

    ``cut_PxWxB``: response tokens kept before the continuation (``-1``: no cut); ``tokens_PxWxBxKxT``: the
    continuation's tokens from the cut on (0 past its end); ``length_PxWxBxK``: their number (0 without a cut);
    ``stopped_PxWxBxK``: ended on a stop token (else at the response capacity); ``decoded_tokens``: their sum."""

    cut_PxWxB: jax.Array
    tokens_PxWxBxKxT: jax.Array
    length_PxWxBxK: jax.Array
    stopped_PxWxBxK: jax.Array
    decoded_tokens: jax.Array


def low_probability_cuts(logp_RxT: jax.Array, length_R: jax.Array, threshold: float, interval: int,
                         max_cuts: int) -> jax.Array:
    """int32[R, B]: SPO-chain's cut points (module docstring), ascending, ``-1`` past a leaf's last cut."""
    R, T = logp_RxT.shape
    low = (jnp.arange(T)[None, :] < length_R[:, None]) & (jnp.exp(logp_RxT) < threshold)
    rank = jnp.cumsum(low, axis=1) - 1  # 0-based rank of each candidate among its leaf's candidates
    keep = low & (rank % interval == 0) & (rank // interval < max_cuts)
    slot = jnp.where(keep, rank // interval, max_cuts)  # out of range: dropped
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (R, T))
    out = jnp.full((R, max_cuts), -1, jnp.int32)
    return out.at[jnp.arange(R)[:, None], slot].set(pos, mode="drop")


def continue_from_cuts(params, cache, *, model: decode.ModelFns, strategy: Strategy, stop_ids: tuple[int, ...],
                       key: jax.Array, leaf_row_R: jax.Array, tokens_RxT: jax.Array, cut_RxB: jax.Array,
                       prompt_token_R: jax.Array, prompt_position_R: jax.Array, samples: int,
                       rows_per_round: int):
    """``samples`` continuations from every cut of every leaf whose KV is in ``cache`` row ``leaf_row_R`` (``-1``:
    not resident, no continuations). Returns ``(tokens [R, B, K, T], length [R, B, K], stopped [R, B, K])``."""
    R, T = tokens_RxT.shape
    B, K, M = cut_RxB.shape[1], samples, rows_per_round
    n_pairs, per_round = R * B, M // K
    exists = ((cut_RxB >= 0) & (leaf_row_R >= 0)[:, None]).reshape(n_pairs)
    order = jnp.argsort(~exists, stable=True).astype(jnp.int32)  # pairs that exist first, in (leaf, cut) order
    n_exist = jnp.sum(exists).astype(jnp.int32)
    cut_flat = cut_RxB.reshape(n_pairs)
    base = jax.random.fold_in(key, CONTINUATION_STREAM)
    i = jnp.arange(M, dtype=jnp.int32)
    out = dict(tokens=jnp.zeros((n_pairs * K, T), jnp.int32), length=jnp.zeros((n_pairs * K,), jnp.int32),
               stopped=jnp.zeros((n_pairs * K,), bool))

    def one_round(carry):
        r, out = carry
        j = r * per_round + i // K
        live0 = j < n_exist
        pair = order[jnp.minimum(j, n_pairs - 1)]
        leaf, cut = pair // B, cut_flat[pair]
        cut = jnp.where(live0, cut, 0)
        src = jnp.where(live0, leaf_row_R[leaf], 0)
        work = model.shard_cache(cache_lib.per_row_rows(cache, src))  # a shared prefix: expanded per row
        prev = jnp.take_along_axis(tokens_RxT[leaf], jnp.maximum(cut - 1, 0)[:, None], axis=1)[:, 0]
        pending = jnp.where(cut > 0, prev, prompt_token_R[leaf])
        position = prompt_position_R[leaf] + cut
        room = T - cut  # tokens this continuation may decode
        row_id = pair * K + i % K

        def cond(s):
            return jnp.any(s["live"])

        def body(s):
            t = s["t"]
            keys = decode.token_keys(base, row_id, jnp.zeros_like(row_id), jnp.full((M,), t, jnp.int32))
            tok, _, _, _, s_cache = decode.decode_token(model, strategy, params, s["cache"], s["pending"],
                                                        s["position"], s["live"], keys, with_entropy=False)
            live = s["live"]
            tok = jnp.where(live, tok, 0)
            stop = live & decode.stop_mask(tok, stop_ids)
            n = s["n"] + live.astype(jnp.int32)
            col = jnp.where(live, t, T)  # dead rows write nowhere
            return dict(t=t + 1, cache=s_cache, pending=jnp.where(live, tok, s["pending"]),
                        position=s["position"] + live.astype(jnp.int32), n=n, stopped=s["stopped"] | stop,
                        live=live & ~stop & (n < room),
                        tokens=s["tokens"].at[i, col].set(tok, mode="drop"))

        s = lax.while_loop(cond, body, dict(t=jnp.int32(0), cache=work, pending=pending, position=position,
                                            n=jnp.zeros((M,), jnp.int32), stopped=jnp.zeros((M,), bool),
                                            live=live0 & (room > 0), tokens=jnp.zeros((M, T), jnp.int32)))
        dst = jnp.where(live0, row_id, n_pairs * K)  # rows of pairs that do not exist: dropped
        out = dict(tokens=out["tokens"].at[dst].set(s["tokens"], mode="drop"),
                   length=out["length"].at[dst].set(s["n"], mode="drop"),
                   stopped=out["stopped"].at[dst].set(s["stopped"], mode="drop"))
        return r + 1, out

    rounds = (n_exist + per_round - 1) // per_round
    _, out = lax.while_loop(lambda c: c[0] < rounds, one_round, (jnp.int32(0), out))
    return (out["tokens"].reshape(R, B, K, T), out["length"].reshape(R, B, K),
            out["stopped"].reshape(R, B, K))


def leaf_continuations(params, cache, leaves, prompt_token_P: jax.Array, prompt_position_P: jax.Array,
                       key: jax.Array, *, model: decode.ModelFns, strategy: Strategy, stop_ids: tuple[int, ...],
                       cc: ContinuationConfig, num_leaves: int) -> Continuations:
    """:class:`Continuations` of a finished tree's leaf store (``leaves``: :class:`~treejax.sampling.tree_state.
    Leaves`, slot ``p * W + w``) from ``cache``, in which each leaf's KV sits in ``leaves.row_R`` (``-1``: gone)."""
    p = leaves.paths
    R, T = p.tokens_RxT.shape
    P, W = R // num_leaves, num_leaves
    cut = low_probability_cuts(p.logp_RxT, p.length_R, cc.threshold, cc.interval, cc.max_cuts)
    cut = jnp.where((leaves.row_R >= 0)[:, None], cut, -1)
    prompt = jnp.arange(R, dtype=jnp.int32) // W
    tokens, length, stopped = continue_from_cuts(
        params, cache, model=model, strategy=strategy, stop_ids=stop_ids, key=key, leaf_row_R=leaves.row_R,
        tokens_RxT=p.tokens_RxT, cut_RxB=cut, prompt_token_R=prompt_token_P[prompt],
        prompt_position_R=prompt_position_P[prompt], samples=cc.samples, rows_per_round=cc.round_rows(R))
    B, K = cc.max_cuts, cc.samples
    return Continuations(cut_PxWxB=cut.reshape(P, W, B), tokens_PxWxBxKxT=tokens.reshape(P, W, B, K, T),
                         length_PxWxBxK=length.reshape(P, W, B, K), stopped_PxWxBxK=stopped.reshape(P, W, B, K),
                         decoded_tokens=jnp.sum(length).astype(jnp.int32))


__all__ = ["CONTINUATION_STREAM", "ContinuationConfig", "Continuations", "continue_from_cuts", "leaf_continuations",
           "low_probability_cuts"]
