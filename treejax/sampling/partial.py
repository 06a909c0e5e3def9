"""Partial rollouts (APRIL, arXiv 2509.18521): independent chains that stop once enough groups are complete, and
resume later from their stored partial responses.

A call decodes ``R = G * W`` rows, ``G`` groups of ``W`` rows (a group is one prompt's ``W`` independent
samples). Row ``r`` starts from its prompt followed by a *response prefix* of ``k_r`` tokens it decoded in an
earlier call (``k_r = 0``: a fresh sample), or is already done (``live_R[r] = False``: a slot whose response
ended earlier; it is not decoded). The loop decodes segments of ``S`` tokens, exactly as the tree rollout decodes
a chain (:func:`treejax.sampling.tree_stages.decode_segment`; the same stop tokens, length limit, n-gram
repetition check and answer predicate, :func:`~treejax.sampling.tree_stages.classify_paths`), and after each
segment stops as soon as ``min_complete`` groups have every row done (APRIL's "stop once N of the N' launched
requests are finished"). Rows still decoding then are *partial*: ``status_R = ALIVE``, their tokens and per-token
log-probs so far in the output, ready to be passed back as the prefix of a later call.

Resuming. The weights change between calls, so a prefix's KV is recomputed: the row's prompt and prefix are
prefilled together (``prompt + prefix[:k - 1]`` written, ``prefix[k - 1]`` pending at position ``len_p + k - 1``),
as APRIL resubmits the prompt with the partial response. Each stored token keeps the log-probs of the policy that
sampled it (the behaviour policy, a mix of versions inside one row); only the tokens decoded in this call are
written. Since every stop happens at a segment boundary and every row decodes whole segments, a live row's
prefix is a whole number of segments, so its segment boundaries stay aligned with the fresh rows'.

Randomness: token ``t`` of row ``r`` is drawn with ``decode.token_keys(key, r, 0, t)`` (``t`` counts from the
response start): with the same key and the same row index, a row stopped and resumed under the same weights
draws what it would have drawn uninterrupted (tested: identical tokens, log-probs within fp32 rounding of the
prefill-vs-decode numerics).

Only chains: a tree's partial state (pending branch points, resident leaves for the fallback) is not a set of
independent rows; ``make_partial_rollout`` refuses a :class:`TreeConfig` that branches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from treejax.forest import NodeStatus
from treejax.models.config import ModelConfig
from treejax.sampling import attention as attention_lib
from treejax.sampling import decode
from treejax.sampling.tree_config import TreeConfig
from treejax.sampling.tree_stages import RolloutInputs, classify_paths, decode_segment
from treejax.sampling.tree_state import Paths, Rows

_ALIVE = int(NodeStatus.ALIVE)


@struct.dataclass
class PartialOutput:
    """One partial-rollout call, ``R`` rows, ``T`` the response capacity.

    ``tokens_RxT`` / ``logprobs_RxT`` (policy at temperature 1) / ``sampling_logprobs_RxT``: each row's whole
    response so far, the given prefix included (0 past ``length_R``); ``status_R``: the row's
    :class:`~treejax.forest.NodeStatus` (``ALIVE``: partial, to be resumed); scalars ``decoded_tokens`` (sampled in
    this call), ``prefilled_tokens`` (prompt + prefix tokens through the prefill), ``segments`` (loop rounds),
    ``complete_groups`` (groups with every row done)."""

    tokens_RxT: jax.Array
    logprobs_RxT: jax.Array
    sampling_logprobs_RxT: jax.Array
    length_R: jax.Array
    status_R: jax.Array
    decoded_tokens: jax.Array
    prefilled_tokens: jax.Array
    segments: jax.Array
    complete_groups: jax.Array


def complete_groups(live_R: jax.Array, W: int) -> jax.Array:
    """int32: the groups of ``W`` consecutive rows none of which is live."""
    return jnp.sum(~jnp.any(live_R.reshape(-1, W), axis=-1)).astype(jnp.int32)


def _partial_core(params, prompts_RxLb, prompt_len_R, prefix_RxT, prefix_logp_RxT, prefix_slogp_RxT, prefix_len_R,
                  live_R, status_R, key, min_complete, *, model: decode.ModelFns, tc: TreeConfig,
                  stop_ids: tuple[int, ...]) -> PartialOutput:
    decode._count_trace("partial_rollout")
    R, Lb = prompts_RxLb.shape
    T, S, W = tc.response_capacity, tc.segment_length, tc.num_leaves
    # row r's prefill sequence: its prompt, then its response prefix
    j = jnp.arange(Lb + T)[None, :]
    from_prefix = j >= prompt_len_R[:, None]
    k_idx = jnp.clip(j - prompt_len_R[:, None], 0, T - 1)
    seq = jnp.where(from_prefix, jnp.take_along_axis(prefix_RxT, k_idx, axis=1),
                    jnp.pad(prompts_RxLb, ((0, 0), (0, T))))
    total = prompt_len_R + prefix_len_R
    L = attention_lib.round_cache_length(Lb + T, model.cache_multiple)
    cache = model.shard_cache(model.init_cache(R, L))
    params = model.prepare(params)
    cache, pending, position = decode.prefill_prompts(model, params, cache, seq.astype(jnp.int32), total,
                                                      jnp.arange(R, dtype=jnp.int32))
    t = jnp.arange(T)[None, :]
    keep = t < prefix_len_R[:, None]
    zeros = jnp.zeros((R, T), jnp.float32)
    paths = Paths(tokens_RxT=jnp.where(keep, prefix_RxT, 0), logp_RxT=jnp.where(keep, prefix_logp_RxT, 0.0),
                  slogp_RxT=jnp.where(keep, prefix_slogp_RxT, 0.0), entropy_RxT=zeros,
                  topk_RxTxK=jnp.zeros((R, T, 0), jnp.float32),
                  path_RxD1=jnp.full((R, tc.max_depth + 1), -1, jnp.int32).at[:, 0].set(0), length_R=prefix_len_R,
                  extra_RxTxC=jnp.zeros((R, T, 0), jnp.float32))
    rows = model.shard_rows(Rows(pending_R=pending, position_R=position, epoch_R=jnp.zeros((R,), jnp.int32),
                                 alive_R=live_R, depth_R=prefix_len_R // S, slots_R=jnp.ones((R,), jnp.int32),
                                 paths=paths))
    inputs = RolloutInputs(params=params, key=key, step=jnp.int32(0), prompt_token_P=pending,
                           prompt_position_P=position)
    status0 = jnp.where(live_R, _ALIVE, status_R)

    def cond(c):
        cache, rows, status, decoded, seg = c
        return jnp.any(rows.alive_R) & (complete_groups(rows.alive_R, W) < min_complete)

    def body(c):
        cache, rows, status, decoded, seg = c
        seg_start, alive = rows.paths.length_R, rows.alive_R
        cache, rows, eos, _, decoded = decode_segment(cache, rows, decoded, inputs, model=model, tc=tc,
                                                      stop_ids=stop_ids)
        rows = rows.replace(depth_R=rows.depth_R + alive.astype(jnp.int32))
        seg_status = classify_paths(rows, eos, seg_start, tc=tc)
        ended = alive & (seg_status != _ALIVE)
        return (cache, rows.replace(alive_R=alive & ~ended), jnp.where(ended, seg_status, status), decoded,
                seg + 1)

    _, rows, status, decoded, seg = lax.while_loop(cond, body, (cache, rows, status0, jnp.int32(0), jnp.int32(0)))
    p = rows.paths
    return PartialOutput(tokens_RxT=p.tokens_RxT, logprobs_RxT=p.logp_RxT, sampling_logprobs_RxT=p.slogp_RxT,
                         length_R=p.length_R, status_R=status, decoded_tokens=decoded,
                         prefilled_tokens=jnp.sum(jnp.where(live_R, total - 1, 0)).astype(jnp.int32), segments=seg,
                         complete_groups=complete_groups(rows.alive_R, W))


def check_chains(tc: TreeConfig) -> None:
    """Partial rollouts resume independent rows: the config must decode chains (``b = 1``, ``W`` initial paths,
    nothing that forks or prunes)."""
    init = tc.branch_factor if tc.init_divergence is None else tc.init_divergence
    bad = [why for cond, why in (
        (tc.branch_factor != 1, f"branch_factor={tc.branch_factor} (must be 1)"),
        (init != tc.num_leaves or tc.init_divergence_range is not None,
         f"init_divergence={tc.init_divergence} (must be num_leaves={tc.num_leaves})"),
        (tc.slots, "allocation='slots'"),
        (tc.rule.prunes or tc.rule.restarts, f"branching rule {tc.rule.rule_name!r} prunes or restarts paths"))
        if cond]
    if bad:
        raise ValueError("partial rollouts resume independent chains; this TreeConfig branches: " + "; ".join(bad)
                         + " (fix: TreeConfig.branch_factor = 1, TreeConfig.init_divergence = num_leaves)")


@functools.lru_cache(maxsize=16)
def make_partial_rollout(model: ModelConfig | decode.ModelFns, tree_config: TreeConfig):
    """Returns ``rollout(params, prompts [R, Lp], prompt_lengths [R], prefix [R, T], prefix_logp [R, T],
    prefix_slogp [R, T], prefix_lengths [R], live [R], status [R], key, min_complete) -> PartialOutput``
    (module docstring). ``R`` must be a multiple of ``tree_config.num_leaves`` (the group size ``W``); a row that
    is not live keeps its given ``status`` and prefix. ``min_complete``: stop once that many groups are complete
    (``R // W``: run every row to its end). Cached per ``(model, tree_config)``: a source built again (a resumed
    run, a test) reuses the compiled program."""
    check_chains(tree_config)
    if tree_config.prefix_cache == "shared":
        raise ValueError("partial rollouts prefill a different prompt + response prefix into every row, so there "
                         "is no prompt prefix to share: TreeConfig.prefix_cache='shared' is not supported here "
                         "(use 'per_row' or 'auto', which is per-row for partial rollouts)")
    fns = decode.as_model_fns(model)
    # rows stay in place (a resumed row keeps its index) and hold their own prefix
    tc = dataclasses.replace(tree_config, row_buckets=1, prefix_cache="per_row")
    stop_ids = decode.resolve_stop_ids(tc.stop_ids, model)
    core = jax.jit(functools.partial(_partial_core, model=fns, tc=tc, stop_ids=stop_ids),
                   compiler_options=decode.SAMPLER_COMPILER_OPTIONS)
    T, W = tc.response_capacity, tc.num_leaves

    def rollout(params, prompts, prompt_lengths, prefix, prefix_logp, prefix_slogp, prefix_lengths, live, status,
                key, min_complete):
        tokens, lens = decode.validate_prompts(prompts, prompt_lengths)
        R = tokens.shape[0]
        if R % W:
            raise ValueError(f"partial rollout: {R} rows are not whole groups of num_leaves={W}")
        k = np.asarray(prefix_lengths, np.int32)
        live = np.asarray(live, bool)
        arrays = [np.asarray(prefix), np.asarray(prefix_logp), np.asarray(prefix_slogp)]
        if any(a.shape != (R, T) for a in arrays) or k.shape != (R,) or live.shape != (R,):
            raise ValueError(f"partial rollout: prefixes must be [R={R}, T={T}] with lengths and live flags [R]")
        if np.any(k < 0) or np.any(k > tc.max_length) or np.any(live & (k % tc.segment_length != 0)):
            raise ValueError(f"partial rollout: prefix lengths must lie in [0, {tc.max_length}] and a live row's "
                             f"be a whole number of segments (S={tc.segment_length}), got {k.tolist()}")
        limit = tc.max_prompt_length
        if limit is not None and int(lens.max()) > limit:
            raise ValueError(f"prompt length {int(lens.max())} exceeds max_prompt_length={limit}")
        bucket = decode.bucket_length(tokens.shape[1] if limit is None else limit)
        return core(params, jnp.asarray(decode.pad_prompts(tokens[:, :bucket], bucket)), jnp.asarray(lens),
                    jnp.asarray(arrays[0], jnp.int32), jnp.asarray(arrays[1], jnp.float32),
                    jnp.asarray(arrays[2], jnp.float32), jnp.asarray(k), jnp.asarray(live),
                    jnp.asarray(np.asarray(status, np.int32)), key, jnp.asarray(min_complete, jnp.int32))

    rollout.core = core
    rollout.tree_config = tc
    rollout.model_fns = fns
    return rollout


__all__ = ["PartialOutput", "check_chains", "complete_groups", "make_partial_rollout"]
