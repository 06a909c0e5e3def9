"""Segment-wise tree rollouts (TreePO, arXiv 2508.17445, Algorithm 1) as ONE jitted program.

Layout. ``P`` prompts x ``W`` leaves live in ``R = P * W`` cache rows; prompt ``p`` owns rows ``p*W .. p*W+W-1``.
The cache has ``L = bucket(Lp) + D * S`` slots (rounded to the attention block). Each prompt is prefilled ONCE
(into its first row) and its KV copied into all its rows; every later branch is a cache-row copy (never a
re-prefill). At most ``W`` paths of a prompt are ever live, because live paths + leaves <= W (see budget).
With ``TreeConfig.prefix_cache = "shared"`` the prompt's KV is instead kept once per prompt (``[P, K,
round(bucket(Lp)), H]`` per layer) and the rows hold only their suffix (``round(D * S + 1)`` slots): no copy, and
a decode step reads each prompt's KV once for all its rows (:mod:`treejax.sampling.cache`,
:func:`treejax.sampling.attention.cascade_decode_attention`); forks copy suffix rows only.

Loop (``lax.while_loop`` over segments, ``lax.while_loop`` over the <= S tokens of a segment):

1. every live row opens a new node at depth ``d + 1`` (fresh id; parent = its node at depth ``d``);
2. decode up to ``S`` tokens for all live rows (stop tokens end a row inside the segment; so does the
   maximum response length);
3. per path, after the segment (TreePO code order): stop token -> ``FINISHED`` if the answer predicate holds
   on the response, else ``EOS``; optional ``finish_on_answer``: predicate alone -> ``FINISHED``;
   n-gram repetition (``kernels.ngram_repetition`` on the last segment, or on the whole response) ->
   ``REPETITION``; response length >= ``max_response_length`` or depth == ``D`` -> ``TRUNCATED``; else live.
   Ended paths are written to the leaf store (tokens, log-probs, path, status);
4. the branching rule (``TreeConfig.branching``, :mod:`treejax.sampling.branching`) sees per-path statistics
   (:class:`~treejax.sampling.branching.PathStats`) and may prune live paths: they end as ``PRUNED`` leaves;
5. branch-budget transfer (official code): with ``F`` leaves so far, ``A`` live paths and ``f`` paths that
   ended (or were pruned) in this segment,
       ``total = max(min(W - F, b * A + b * f), A)``
   (``budget_transfer=False``: ``max(min(W - F, b * A), A)``), split over the live paths by the rule, each >= 1
   (TreePO's: :class:`~treejax.sampling.branching.FixedAverage` -- ``total // A`` each, the remainder one each
   to the first paths, or all to the last path as the official code does;
   :class:`~treejax.sampling.branching.LogProbWeighted` -- weights ``softmax(sign * (x - min x) / T)`` of the
   mean log-prob ``x`` of the last segment / whole response, ``T`` fixed or scheduled by the training step,
   largest remainder; and EntropyGuided, LATR, ECHO); a path with ``c`` children keeps decoding in its own row
   and forks ``c - 1`` copies into free rows;
   Slot trees (``TreeConfig.allocation = "slots"``, unbiased by construction) replace 5 and 6: each row holds
   ``slots`` of the prompt's ``W`` leaf slots (``W`` split over the ``k`` root paths), a live path with ``n``
   slots gets ``rule.slot_children`` (default ``min(b, n)``) children that split its own slots as evenly as
   possible, a path that ends is stored once per slot it holds, and nothing falls back (at most ``D`` rounds);
6. depth-first fallback: a prompt with no live path and fewer than ``W`` leaves re-enters the tree from a
   random FINISHED/EOS leaf whose KV is still resident in one of the prompt's rows, cut at a random earlier
   segment boundary (``k ~ U{1..n_b}``, cut depth ``n_b - k``; official code), with ``min(b, W - F)`` copies;
   from the root when there is no such leaf. Shared prefix nodes keep their ids; new nodes get fresh ids.

Differences from the official code (documented choices):
  * the official fallback draws from *all* finished/EOS leaves and resubmits text to vLLM; here a leaf is a
    candidate only while its KV is resident in a row (every leaf that ended in the prompt's last round is),
    because re-prefilling would break "never re-prefill". The cut itself only resets the row's position.
  * "More Init Divergence" (random initial branch count in ``[m, n]`` per prompt) works here (it never switches
    on in the released script), and the first fallback does not crash.
  * repetition: the official code looks for a 32-character substring occurring >= 8 times in the segment text;
    here an ``n``-gram of token ids occurring >= ``count`` times (configurable).

Code layout: the loop carry is a typed :class:`~treejax.sampling.tree_state.TreeState` (rows, leaves, nodes,
counters, cache); one segment is :func:`~treejax.sampling.tree_stages.segment_step`, a chain of pure stage
functions (open nodes, decode a segment, classify paths, path statistics and pruning, store leaves, budget and
child counts, assign free rows, fall back, fork), each testable alone. ``tests/sampling/test_tree_refactor.py``
checks that this reproduces the dict-state rollout before it bit for bit.

Keys: token ``t`` of row ``r`` is drawn with ``decode.token_keys(key, r, epoch_r, t)``; a row's epoch grows
each time the row is given to a new path (fork or fallback), so no two paths share draws and a tree that never
branches (``b = 1``, ``init_divergence = W``, no early stop) reproduces ``decode.generate`` on ``W`` copies of
each prompt exactly. Branching / fallback randomness uses other streams of ``key``.

Sharding: ``make_tree_rollout(model, tree_config, mesh=mesh)`` (or fns from ``decode.make_model_fns(config,
mesh=mesh)``) runs the rollout on a device mesh. The KV cache is constrained to its logical axes
(``cache.CACHE_LOGICAL_AXES`` through the rules table; default: rows over ``data x fsdp``, KV heads over
``tensor``) at creation, after prefill and the prompt broadcast, after every decode step (the loop carry), and
after every row gather (the live-rows-first permutation, the row-bucket slice and merge, forks and fallbacks).
The per-row state (pending tokens, positions, response and leaf buffers) is sharded over rows the same way, so
the decode step runs data-parallel over rows and tensor-parallel over heads against params placed by
``transformer.param_logical_axes``. Dimensions the mesh does not divide (a row bucket smaller than
``data x fsdp``, fewer KV heads than ``tensor``) are replicated on that mesh axis. Row gathers across shards
(forks, the row-bucket permutation) are left to XLA's SPMD partitioner (communication over the row axis).
Without a mesh nothing is constrained and the compiled program is the unsharded one.

Counters (returned next to the forest): ``decoded_tokens`` (sampled tokens = unique tree tokens),
``prefilled_tokens`` (``sum(len_p - 1)``: tokens through the prefill pass; each row's first decode step feeds the
prompt's last token), ``forks`` (rows created by copying a parent at a branch point), ``fallbacks`` (fallback
events), ``fallback_from_root``, ``segments`` (loop iterations), ``stops`` (leaves per :class:`NodeStatus`,
``pruned`` included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from treejax.forest import Forest, path_mass
from treejax.models.config import ModelConfig
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules
from treejax.sampling import attention as attention_lib
from treejax.sampling import cache as cache_lib
from treejax.sampling import decode, path_scores
from treejax.sampling import probe as probe_lib
from treejax.sampling.continuation import ContinuationConfig, leaf_continuations
from treejax.sampling.tree_config import TreeConfig, independent_config
from treejax.sampling.tree_stages import INIT_STREAM, RolloutInputs, segment_step
from treejax.sampling.tree_state import Counters, Leaves, Nodes, Paths, RolloutInfo, Rows, TreeState, shard_state

__all__ = ["TreeConfig", "independent_config", "make_independent_rollout", "make_tree_rollout"]


# ----------------------------------------------------------------------------------------------- the rollout
def initial_divergence(key: jax.Array, P: int, tc: TreeConfig) -> jax.Array:
    """int32[P]: initial paths per prompt: ``init_divergence`` (default b), or uniform in
    ``init_divergence_range=(m, n)`` per prompt ("More Init Divergence")."""
    if tc.init_divergence_range is not None:
        m, n = tc.init_divergence_range
        return jax.random.randint(jax.random.fold_in(key, INIT_STREAM), (P,), m, n + 1, dtype=jnp.int32)
    return jnp.full((P,), tc.branch_factor if tc.init_divergence is None else tc.init_divergence, jnp.int32)


def initial_slots(n_init_P: jax.Array, W: int, slots: bool) -> jax.Array:
    """int32[P, W]: leaf slots of each row's path at the root. Slot trees: prompt ``p``'s ``k = n_init_P[p]``
    root paths share its ``W`` slots, ``W // k`` each and one more for the first ``W mod k``; 0 on the other
    rows. ``"transfer"``: 1 on every row (each path ends in one leaf)."""
    w = jnp.arange(W)[None, :]
    if not slots:
        return jnp.ones((n_init_P.shape[0], W), jnp.int32)
    k = n_init_P[:, None]
    return jnp.where(w < k, W // k + (w < W % k).astype(jnp.int32), 0).astype(jnp.int32)


def initial_state(cache, prompt_token_P: jax.Array, prompt_position_P: jax.Array, n_init_P: jax.Array, *,
                  tc: TreeConfig) -> TreeState:
    """The carry before the first segment: prompt ``p``'s first ``n_init_P[p]`` rows live at the root, every row
    pending on the prompt's last token, empty leaf store, only the root node."""
    P, W, D, T = n_init_P.shape[0], tc.num_leaves, tc.max_depth, tc.response_capacity
    R, K, C = P * W, tc.rule.top_k, len(tc.rule.token_stats)
    row_prompt = jnp.arange(R, dtype=jnp.int32) // W
    alive_PxW = jnp.arange(W)[None, :] < n_init_P[:, None]
    rows = Rows(pending_R=prompt_token_P[row_prompt], position_R=prompt_position_P[row_prompt],
                epoch_R=jnp.zeros((R,), jnp.int32), alive_R=alive_PxW.reshape(R), depth_R=jnp.zeros((R,), jnp.int32),
                slots_R=initial_slots(n_init_P, W, tc.slots).reshape(R), paths=Paths.empty(R, T, D, K, root=True, C=C))
    leaves = Leaves(paths=Paths.empty(R, T, D, K, root=False, C=C), status_R=jnp.zeros((R,), jnp.int32),
                    row_R=jnp.full((R,), -1, jnp.int32))
    return TreeState(cache=cache, rows=rows, leaves=leaves, nodes=Nodes.root(P, tc.num_nodes),
                     counters=Counters.zeros())


def forest_and_info(s: TreeState, lengths: jax.Array, n_init_P: jax.Array, *, tc: TreeConfig):
    """The :class:`Forest` of the leaf store and the :class:`RolloutInfo` (module docstring)."""
    P, W, D, T, S = n_init_P.shape[0], tc.num_leaves, tc.max_depth, tc.response_capacity, tc.segment_length
    lp = s.leaves.paths
    t = jnp.arange(T)
    llen = lp.length_R.reshape(P, W)
    valid = t[None, None, :] < llen[:, :, None]
    forest = Forest(
        node_parent=s.nodes.parent_PxN, node_depth=s.nodes.depth_PxN, node_status=s.nodes.status_PxN,
        leaf_path=lp.path_RxD1.reshape(P, W, D + 1), leaf_status=s.leaves.status_R.reshape(P, W), leaf_length=llen,
        tokens=jnp.where(valid, lp.tokens_RxT.reshape(P, W, T), 0),
        logprobs=jnp.where(valid, lp.logp_RxT.reshape(P, W, T), 0.0),
        segment_index=jnp.where(valid, (t // S)[None, None, :], -1).astype(jnp.int32),
        loss_mask=valid.astype(jnp.float32), segment_length=S,
        leaf_weight=(jnp.where(lp.path_RxD1[:, 0].reshape(P, W) >= 0, 1.0, 0.0) if tc.slots
                     else W * path_mass(s.nodes.parent_PxN, lp.path_RxD1.reshape(P, W, D + 1))))
    c = s.counters
    info = RolloutInfo(
        decoded_tokens=c.decoded, prefilled_tokens=jnp.sum(lengths - 1).astype(jnp.int32), forks=c.forks,
        fallbacks=c.fallbacks, fallback_from_root=c.from_root, segments=c.segment, stops_K=c.stops_K,
        complete=jnp.all(s.nodes.leaves_P == W), root_restarts=c.root_restarts, num_nodes_P=s.nodes.next_P,
        init_divergence_P=n_init_P,
        sampling_logprobs_PxWxT=jnp.where(valid, lp.slogp_RxT.reshape(P, W, T), 0.0),
        entropy_PxWxT=jnp.where(valid, lp.entropy_RxT.reshape(P, W, T), 0.0))
    return forest, info


def _rollout_core(params, prompts, lengths, key, step, *, model: decode.ModelFns, tc: TreeConfig,
                  stop_ids: tuple[int, ...], cc: ContinuationConfig | None = None):
    """Prefill once per prompt, copy each prompt's KV into its rows (``prefix_cache`` per-row; shared: the prompt
    KV stays in the per-prompt prefix and rows start with an empty suffix), then ``segment_step`` until every
    prompt has W leaves (or ``max_segments``); with ``cc``, then the leaves' continuations from the final cache."""
    decode._count_trace("tree_rollout")
    P, Lb = prompts.shape
    W = tc.num_leaves
    shared = tc.resolved_prefix_cache(Lb, model.init_shared_cache is not None, model.attention,
                                      model.cascade_attention) == "shared"
    params, probes = probe_lib.detach(params)  # a stateful shaper's probe travels with the weights
    params, scorer = path_scores.detach(params)  # so do the rule's path scorer's weights (a PRM in the loop)
    probe = _rule_probe(tc, probes)
    if tc.rule.needs_path_scores and scorer is None:
        raise ValueError(f"branching rule {tc.rule.rule_name!r} reads path scores, but the rollout's params carry "
                         "no scorer weights: call it through treejax.sampling.path_scores.with_scorer(rollout, weights)")
    params = model.prepare(params)  # e.g. unstack the layers once, outside the decode loops
    if shared:  # prompt KV once per prompt, rows hold their suffix (pending prompt token + response) only
        Lpre = attention_lib.round_cache_length(Lb, model.cache_multiple)
        Ls = attention_lib.round_cache_length(tc.response_capacity + 1, model.cache_multiple)
        cache = model.shard_cache(model.init_shared_cache(P, W, Lpre, Ls))
        cache, last_tok_P, last_pos_P = decode.prefill_prompts(model, params, cache, prompts, lengths,
                                                               jnp.arange(P, dtype=jnp.int32))
    else:
        L = attention_lib.round_cache_length(Lb + tc.response_capacity, model.cache_multiple)
        row_prompt = jnp.arange(P * W, dtype=jnp.int32) // W
        cache = model.shard_cache(model.init_cache(P * W, L))
        cache, last_tok_P, last_pos_P = decode.prefill_prompts(model, params, cache, prompts, lengths,
                                                               jnp.arange(P, dtype=jnp.int32) * W)
        cache = model.shard_cache(cache_lib.broadcast_prompt_rows(cache, row_prompt * W))
    n_init = initial_divergence(key, P, tc)
    state = shard_state(model, initial_state(cache, last_tok_P, last_pos_P, n_init, tc=tc))
    inputs = RolloutInputs(params=params, key=key, step=step, prompt_token_P=last_tok_P, prompt_position_P=last_pos_P,
                           probe=probe, **(dict(scorer=scorer, prompts_PxL=prompts, prompt_len_P=lengths)
                                           if tc.rule.needs_path_scores else {}))

    def cond(s):
        return jnp.any(s.nodes.leaves_P < W) & (s.counters.segment < tc.max_segments)

    s = lax.while_loop(cond, functools.partial(segment_step, inputs=inputs, model=model, tc=tc, stop_ids=stop_ids),
                       state)
    forest, info = forest_and_info(s, lengths, n_init, tc=tc)
    if cc is not None:  # the cache is in logical row order after the last segment's fork
        cont = leaf_continuations(params, s.cache, s.leaves, last_tok_P, last_pos_P, key, model=model,
                                  strategy=tc.strategy, stop_ids=stop_ids, cc=cc, num_leaves=W)
        info = info.replace(continuations=cont, continuation_tokens=cont.decoded_tokens,
                            decoded_tokens=info.decoded_tokens + cont.decoded_tokens)
    return forest, info


def _rule_probe(tc: TreeConfig, probes: dict):
    """The probe the rule reads (``rule.probe_name``), or ``None``; a rule that needs one and got none is an error."""
    name = getattr(tc.rule, "probe_name", None)
    if "probe" not in tc.rule.token_stats:
        return None
    if name not in probes:
        raise ValueError(f"branching rule {tc.rule.rule_name!r} reads the probe of shaper {name!r}, which the "
                         f"rollout did not get (probes: {sorted(probes)}): add that shaper to RunConfig.shapers "
                         "(e.g. [@QualityHead()])")
    return probes[name]


def _jitted_core(fns, tc: TreeConfig, stop_ids, continuations):
    """The jitted rollout program of one (model fns, tree config, stop ids, continuations), shared by every
    :func:`make_tree_rollout` of the same arguments in this process (:func:`_cached_core`), so that a rollout
    built again (a run resumed in-process, a second run, a test) reuses its traces instead of tracing and
    compiling the same program anew; unhashable arguments (a rule holding an array) get their own."""
    try:
        return _cached_core(fns, tc, stop_ids, continuations)
    except TypeError:  # unhashable: not cached
        return _new_core(fns, tc, stop_ids, continuations)


def _new_core(fns, tc, stop_ids, continuations):
    return jax.jit(functools.partial(_rollout_core, model=fns, tc=tc, stop_ids=stop_ids, cc=continuations),
                   compiler_options=decode.SAMPLER_COMPILER_OPTIONS)


_cached_core = functools.lru_cache(maxsize=32)(_new_core)


def make_tree_rollout(model: ModelConfig | decode.ModelFns, tree_config: TreeConfig, mesh=None,
                      rules: Rules = DEFAULT_RULES, continuations: ContinuationConfig | None = None):
    """Returns ``rollout(params, prompt_tokens [P, Lp], prompt_lengths [P], key, step=0) -> (Forest, info)``.
    ``params`` may carry the shapers' probes (:mod:`treejax.sampling.probe`) for a rule that reads one.

    ``model`` is a :class:`ModelConfig` (the treejax transformer with ragged attention) or any
    :class:`decode.ModelFns`. ``mesh`` (a ``jax.sharding.Mesh``, e.g. ``treejax.parallel.mesh.make_mesh``) with
    ``rules``: run sharded (module docstring); ``params`` should then be placed by ``transformer.
    param_logical_axes`` (``logical_to_sharding(..., mesh, shapes=params)``). Prompts are right-padded; the padded width is bucketed (powers of two) so a new
    prompt length recompiles only when it crosses a bucket. ``step`` (the training step) drives the branching
    rule's temperature schedule. ``info`` holds the counters (see module docstring), ``sampling_logprobs`` and
    ``entropy`` ``[P, W, T]``, and ``complete`` (every prompt has W leaves). ``continuations``
    (:class:`~treejax.sampling.continuation.ContinuationConfig`): after the tree, decode Monte-Carlo continuations
    from cut points inside the leaves, forked from their resident KV (SPO-chain; ``info.continuations``).
    """
    fns = decode.as_model_fns(model, mesh, rules)
    tc = tree_config
    if tc.rule.needs_path_scores and tc.rule.path_scorer is None:
        raise ValueError(f"branching rule {tc.rule.rule_name!r} reads path scores but has no path scorer: bind one "
                         "(treejax.sampling.path_scores.bind_rule, done by the run when ETS.scorer is set)")
    tc.resolved_prefix_cache(0, fns.init_shared_cache is not None)  # "shared" on fns without it: raise now
    stop_ids = decode.resolve_stop_ids(tc.stop_ids, model)
    core = _jitted_core(fns, tc, stop_ids, continuations)

    def rollout(params, prompt_tokens, prompt_lengths, key, step=0):
        tokens, lens = decode.validate_prompts(prompt_tokens, prompt_lengths)
        limit = tc.max_prompt_length
        if limit is not None and int(lens.max()) > limit:
            bad = np.nonzero(lens > limit)[0].tolist()
            raise ValueError(f"prompt(s) {bad} of length {lens[bad].tolist()} exceed max_prompt_length={limit}: "
                             f"the cache holds {limit} prompt + {tc.response_capacity} response slots")
        bucket = decode.bucket_length(tokens.shape[1] if limit is None else limit)
        tokens = tokens[:, :bucket]  # only trims padding: every length is <= bucket here
        return core(params, jnp.asarray(decode.pad_prompts(tokens, bucket)), jnp.asarray(lens), key,
                    jnp.asarray(step, jnp.int32))

    rollout.core = core
    rollout.tree_config = tc
    rollout.model_fns = fns
    rollout.continuations = continuations
    return rollout


def make_independent_rollout(model: ModelConfig | decode.ModelFns, num_samples: int, max_new_tokens: int,
                             segment_length: int | None = None, mesh=None, rules: Rules = DEFAULT_RULES, **kw):
    """GRPO baseline through the same API: ``num_samples`` independent samples per prompt, each prompt prefilled
    once, returned as a :class:`Forest` of chains (one leaf per chain)."""
    return make_tree_rollout(model, independent_config(num_samples, max_new_tokens, segment_length, **kw),
                             mesh=mesh, rules=rules)
