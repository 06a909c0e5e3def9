"""The stages of one segment step of the tree rollout, each a pure function (see :mod:`treejax.sampling.tree`).

:func:`segment_step` runs, for every prompt at once:

1. :func:`open_nodes`        every live row opens a node at depth ``d + 1``;
2. :func:`decode_segment`    up to ``S`` tokens for every live row (on a compacted prefix of rows);
3. :func:`classify_paths`    stop token / repetition / length / depth -> a :class:`NodeStatus` per path;
4. :func:`path_stats`        the per-path statistics a branching rule sees, :func:`score_paths` (the rule's
                             path scorer, e.g. a PRM, if it reads one) and :func:`prune_paths` (the rule's
                             pruning, if it prunes);
5. :func:`store_leaves`      ended (and pruned) paths go to the leaf store;
6. :func:`branch_budget`     TreePO's budget transfer; the rule's :meth:`allocate` gives child counts (slot
                             trees: the rule's :meth:`slot_children`, and :func:`split_slots` splits each
                             path's own slots over its children);
7. :func:`assign_free_rows`  each extra child takes a free row of its prompt;
8. :func:`fall_back`         prompts with no live path and fewer than ``W`` leaves re-enter from a leaf;
9. :func:`fork`              rows (and KV rows) are copied from their sources, fallback rows reset to the cut.

Shapes: ``P`` prompts, ``W`` leaves and rows per prompt, ``R = P * W``, ``T`` tokens per path, ``D1 = D + 1``.
Every row is indexed ``p * W + w``; ``_PxW`` arrays are the same values reshaped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from treejax.forest import NodeStatus
from treejax.sampling import cache as cache_lib
from treejax.sampling import decode, kernels
from treejax.sampling.branching.base import BranchingRule, PathStats
from treejax.sampling.tree_state import Counters, Leaves, Nodes, Rows, TreeState, shard_state

if TYPE_CHECKING:
    from treejax.sampling.tree_config import TreeConfig

BRANCH_STREAM, FALLBACK_STREAM, INIT_STREAM = 0x7B1, 0x7B2, 0x7B3
_ALIVE = int(NodeStatus.ALIVE)


@struct.dataclass
class RolloutInputs:
    """The dynamic inputs every segment step reads: ``params`` (prepared), the rollout ``key``, the training
    ``step``, and each prompt's pending token and position after prefill (``prompt_token_P``,
    ``prompt_position_P``: where a fallback from the root restarts); ``probe``: the quality probe the rule's
    ``"probe"`` statistic reads (``None`` unless it asks; :mod:`treejax.sampling.token_stats`); ``scorer``: the
    rule's path scorer's weights, with the right-padded ``prompts_PxL`` and ``prompt_len_P`` it reads (``None``
    unless the rule reads path scores; :mod:`treejax.sampling.path_scores`)."""

    params: Any
    key: jax.Array
    step: jax.Array
    prompt_token_P: jax.Array
    prompt_position_P: jax.Array
    probe: Any = None
    scorer: Any = None
    prompts_PxL: Any = None
    prompt_len_P: Any = None


def bucket_sizes(R: int, buckets: int) -> tuple[int, ...]:
    """Static row counts the decode step may run on: ``R, R/2, ..., R/2^(buckets-1)`` (ascending, >= 1)."""
    return tuple(sorted({max(1, -(-R // (2 ** i))) for i in range(max(1, buckets))}))


def _row_prompt(R: int, W: int) -> jax.Array:
    return jnp.arange(R, dtype=jnp.int32) // W


def _row_slices(x_RxT: jax.Array, start_R: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, size))(x_RxT, start_R)


# ----------------------------------------------------------------------------------------------- 1. open nodes
def open_nodes(rows: Rows, nodes: Nodes) -> tuple[Rows, Nodes]:
    """Every live row opens a node at depth ``d + 1``: fresh ids ``next_P[p] + rank among the prompt's live
    rows``, parent = the row's node at depth ``d``; the row's path records the new id."""
    P, N = nodes.parent_PxN.shape
    R = rows.alive_R.shape[0]
    W = R // P
    alive, depth, path = rows.alive_R, rows.depth_R, rows.paths.path_RxD1
    alive_PxW = alive.reshape(P, W)
    new_id = (nodes.next_P[:, None] + kernels.rank_within(alive_PxW)).reshape(R)
    parent_id = jnp.take_along_axis(path, depth[:, None], axis=1)[:, 0]
    flat = jnp.where(alive, _row_prompt(R, W) * N + new_id, P * N)

    def put(x_PxN, v_R):
        return x_PxN.reshape(-1).at[flat].set(v_R, mode="drop").reshape(P, N)

    nodes = nodes.replace(parent_PxN=put(nodes.parent_PxN, parent_id), depth_PxN=put(nodes.depth_PxN, depth + 1),
                          status_PxN=put(nodes.status_PxN, _ALIVE),
                          next_P=nodes.next_P + jnp.sum(alive_PxW, axis=-1).astype(jnp.int32))
    at_new = (jnp.arange(path.shape[1])[None, :] == depth[:, None] + 1) & alive[:, None]
    path = jnp.where(at_new, new_id[:, None], path)
    return rows.replace(paths=rows.paths.replace(path_RxD1=path)), nodes


# ----------------------------------------------------------------------------------------------- 2. decode
@struct.dataclass
class DecodeCarry:
    """The token loop's carry: ``j`` tokens decoded in this segment, the cache, the rows being decoded, ``eos_R``
    (sampled a stop token in this segment), ``active_R`` (still decoding), ``decoded`` (token counter)."""

    j: jax.Array
    cache: Any
    rows: Rows
    eos_R: jax.Array
    active_R: jax.Array
    decoded: jax.Array


def _shard_carry(model: decode.ModelFns, c: DecodeCarry) -> DecodeCarry:
    return c.replace(rows=model.shard_rows(c.rows), eos_R=model.shard_rows(c.eos_R),
                     active_R=model.shard_rows(c.active_R))


def decode_token_step(c: DecodeCarry, row_ids: jax.Array, inputs: RolloutInputs, *, model: decode.ModelFns,
                      tc: TreeConfig, stop_ids: tuple[int, ...]) -> DecodeCarry:
    """One token for every active row: sample it with the row's key ``token_keys(key, row, epoch, t)``, append it
    (token, log-probs, statistics) at column ``length``; a stop token or the maximum length deactivates the row."""
    r, p = c.rows, c.rows.paths
    active = c.active_R
    local = jnp.arange(row_ids.shape[0])
    keys = decode.token_keys(inputs.key, row_ids, r.epoch_R, p.length_R)
    tok, lp, slp, ent, topk, extra, cache = decode.decode_token_stats(
        model, tc.strategy, inputs.params, c.cache, r.pending_R, r.position_R, active, keys, tc.needs_entropy,
        tc.rule.top_k, tc.rule.token_stats, inputs.probe)
    col = jnp.where(active, p.length_R, p.tokens_RxT.shape[1])
    stopped = active & decode.stop_mask(tok, stop_ids)
    length = p.length_R + active.astype(jnp.int32)

    def write(x, v):
        return x.at[local, col].set(v, mode="drop")

    p = p.replace(tokens_RxT=write(p.tokens_RxT, tok), logp_RxT=write(p.logp_RxT, lp),
                  slogp_RxT=write(p.slogp_RxT, slp), length_R=length,
                  entropy_RxT=write(p.entropy_RxT, ent) if tc.needs_entropy else p.entropy_RxT,
                  topk_RxTxK=write(p.topk_RxTxK, topk) if tc.rule.top_k else p.topk_RxTxK,
                  extra_RxTxC=write(p.extra_RxTxC, extra) if tc.rule.token_stats else p.extra_RxTxC)
    r = r.replace(pending_R=jnp.where(active, tok, r.pending_R), position_R=r.position_R + active.astype(jnp.int32),
                  paths=p)
    return _shard_carry(model, DecodeCarry(
        j=c.j + 1, cache=cache, rows=r, eos_R=c.eos_R | stopped,
        active_R=active & ~stopped & (length < tc.max_length), decoded=c.decoded + jnp.sum(active).astype(jnp.int32)))


def _decode_loop(c: DecodeCarry, row_ids, inputs, *, model, tc, stop_ids) -> DecodeCarry:
    def cond(c):
        return (c.j < tc.segment_length) & jnp.any(c.active_R)

    def body(c):
        return decode_token_step(c, row_ids, inputs, model=model, tc=tc, stop_ids=stop_ids)

    return lax.while_loop(cond, body, c)


def decode_segment(cache, rows: Rows, decoded, inputs: RolloutInputs, *, model: decode.ModelFns, tc: TreeConfig,
                   stop_ids: tuple[int, ...]):
    """Up to ``S`` tokens for every live row. Returns ``(cache, rows, eos_R, cache_order_R, decoded)``.

    With ``row_buckets > 1`` the live rows are packed first (stable) and the loop runs on the smallest bucket of
    rows holding them (weights are shared; KV reads and FLOPs follow the live paths). The returned rows are in
    logical order; the cache is permuted: its physical row ``i`` holds logical row ``cache_order_R[i]``.
    """
    R = rows.alive_R.shape[0]
    row_ids = jnp.arange(R, dtype=jnp.int32)
    c0 = DecodeCarry(j=jnp.int32(0), cache=None, rows=rows, eos_R=jnp.zeros((R,), bool), active_R=rows.alive_R,
                     decoded=decoded)
    kw = dict(model=model, tc=tc, stop_ids=stop_ids)
    sizes = bucket_sizes(R, tc.row_buckets)
    if len(sizes) == 1:
        c = _decode_loop(_shard_carry(model, c0.replace(cache=cache)), row_ids, inputs, **kw)
        return c.cache, c.rows, c.eos_R, row_ids, c.decoded
    perm = jnp.argsort(~rows.alive_R, stable=True).astype(jnp.int32)
    cache_p = model.shard_cache(cache_lib.fork_rows(cache, perm))

    def make_branch(nb):
        def branch(cache_p, c0):
            sel = perm[:nb]
            sub = c0.replace(rows=c0.rows.take(sel), eos_R=c0.eos_R[sel], active_R=c0.active_R[sel],
                             cache=model.shard_cache(cache_lib.map_rows(lambda x: lax.slice_in_dim(x, 0, nb, axis=0),
                                                                        cache_p)))
            out = _decode_loop(_shard_carry(model, sub), sel, inputs, **kw)
            merged = out.replace(rows=c0.rows.put(sel, out.rows), eos_R=c0.eos_R.at[sel].set(out.eos_R),
                                 active_R=c0.active_R.at[sel].set(out.active_R),
                                 cache=model.shard_cache(cache_lib.map_rows(
                                     lambda full, part: lax.dynamic_update_slice_in_dim(full, part, 0, 0),
                                     cache_p, out.cache)))
            return _shard_carry(model, merged)
        return branch

    which = jnp.sum(jnp.asarray(sizes[:-1]) < jnp.sum(rows.alive_R)).astype(jnp.int32)
    c = lax.switch(which, [make_branch(nb) for nb in sizes], cache_p, _shard_carry(model, c0))
    return c.cache, c.rows, c.eos_R, perm, c.decoded


# ----------------------------------------------------------------------------------------------- 3. classify
def classify_paths(rows: Rows, eos_R: jax.Array, segment_start_R: jax.Array, *, tc: TreeConfig) -> jax.Array:
    """int32[R]: the status of each row's path after its segment (TreePO code order, later rules win):
    length >= max or depth == D -> TRUNCATED; n-gram repetition -> REPETITION; (``finish_on_answer``: answer
    -> FINISHED); stop token -> FINISHED if the answer predicate holds, else EOS; otherwise ALIVE. Only rows
    that decoded (``alive``) are meaningful. ``rows.depth_R`` already counts this segment."""
    p = rows.paths
    R, S = p.length_R.shape[0], tc.segment_length
    answer = (jax.vmap(tc.answer_fn)(p.tokens_RxT, p.length_R) if tc.answer_fn is not None
              else jnp.zeros((R,), bool))
    eos = rows.alive_R & eos_R
    if tc.repetition_ngram > 0 and tc.repetition_scope == "segment":
        seg = _row_slices(jnp.pad(p.tokens_RxT, ((0, 0), (0, S))), segment_start_R, S)
        rep = kernels.ngram_repetition(seg, p.length_R - segment_start_R, tc.repetition_ngram, tc.repetition_count)
    elif tc.repetition_ngram > 0:
        rep = kernels.ngram_repetition(p.tokens_RxT, p.length_R, tc.repetition_ngram, tc.repetition_count)
    else:
        rep = jnp.zeros((R,), bool)
    status = jnp.full((R,), _ALIVE, jnp.int32)
    status = jnp.where((p.length_R >= tc.max_length) | (rows.depth_R >= tc.max_depth), int(NodeStatus.TRUNCATED),
                       status)
    status = jnp.where(rep, int(NodeStatus.REPETITION), status)
    if tc.finish_on_answer:
        status = jnp.where(answer, int(NodeStatus.FINISHED), status)
    return jnp.where(eos, jnp.where(answer, int(NodeStatus.FINISHED), int(NodeStatus.EOS)), status)


# ----------------------------------------------------------------------------------------------- 4. rule input
def path_stats(rows: Rows, status_R: jax.Array, segment_start_R: jax.Array, nodes: Nodes, counters: Counters,
               inputs: RolloutInputs, *, tc: TreeConfig) -> PathStats:
    """The :class:`PathStats` of this boundary (row arrays reshaped to ``[P, W, ...]``; no copies)."""
    P, W = nodes.next_P.shape[0], tc.num_leaves
    p = rows.paths
    ended = rows.alive_R & (status_R != _ALIVE)

    def pw(x):
        return x.reshape((P, W) + x.shape[1:])

    return PathStats(
        live_PxW=pw(rows.alive_R & ~ended), ended_PxW=pw(ended), status_PxW=pw(status_R), depth_PxW=pw(rows.depth_R),
        length_PxW=pw(p.length_R), segment_start_PxW=pw(segment_start_R), tokens_PxWxT=pw(p.tokens_RxT),
        logp_PxWxT=pw(p.logp_RxT), entropy_PxWxT=pw(p.entropy_RxT), topk_PxWxTxK=pw(p.topk_RxTxK),
        extra_PxWxTxC=pw(p.extra_RxTxC), path_PxWxD1=pw(p.path_RxD1), leaves_P=nodes.leaves_P, step=inputs.step,
        segment=counters.segment,
        key=jax.random.fold_in(jax.random.fold_in(inputs.key, BRANCH_STREAM), counters.segment),
        probe_ready=(jnp.asarray(inputs.probe["ready"], bool) if isinstance(inputs.probe, dict)
                     and "ready" in inputs.probe else jnp.asarray(inputs.probe is not None)),
        branch_factor=tc.branch_factor, segment_length=tc.segment_length, token_stat_names=tc.rule.token_stats)


def score_paths(stats: PathStats, rows: Rows, inputs: RolloutInputs, *, tc: TreeConfig) -> PathStats:
    """``stats`` with ``path_scores_PxW``: the rule's path scorer on every row (0 where no path is live)."""
    p = rows.paths
    score_R = tc.rule.path_scorer.score(inputs.scorer, inputs.prompts_PxL, inputs.prompt_len_P, p.tokens_RxT,
                                        p.length_R, rows.depth_R, tc.segment_length)
    return stats.replace(path_scores_PxW=jnp.where(stats.live_PxW, score_R.reshape(stats.live_PxW.shape), 0.0))


def prune_paths(stats: PathStats, rule: BranchingRule) -> PathStats:
    """Live paths the rule prunes end here with status ``PRUNED`` (they move from ``live`` to ``ended``)."""
    prune = rule.prune(stats) & stats.live_PxW
    return stats.replace(live_PxW=stats.live_PxW & ~prune, ended_PxW=stats.ended_PxW | prune,
                         status_PxW=jnp.where(prune, int(NodeStatus.PRUNED), stats.status_PxW))


# ----------------------------------------------------------------------------------------------- 5. leaves
def store_leaves(leaves: Leaves, nodes: Nodes, counters: Counters, rows: Rows, ended_R: jax.Array,
                 status_R: jax.Array) -> tuple[Leaves, Nodes, Counters, jax.Array]:
    """Ended paths go to the leaf store, each once per slot it holds (``rows.slots_R``; 1 under
    ``"transfer"``): the ended paths of a prompt, in row order, fill slots ``leaves_P, leaves_P + 1, ...`` (a
    path with ``n`` slots takes ``n`` consecutive ones). Their end node takes their status; ``stops`` counts the
    stored leaves. Returns ``(leaves, nodes, counters, finished_now_P)`` (``finished_now``: paths ended now)."""
    P, N = nodes.parent_PxN.shape
    R = ended_R.shape[0]
    W = R // P
    row_prompt = _row_prompt(R, W)
    ended_PxW = ended_R.reshape(P, W)
    mult_R = jnp.where(ended_R, rows.slots_R, 0)
    cum_PxW = jnp.cumsum(mult_R.reshape(P, W), axis=-1)  # inclusive: ended row i covers [cum - mult, cum)
    offset_PxW = jnp.arange(W, dtype=jnp.int32)[None, :] - nodes.leaves_P[:, None]  # slot j -> j - leaves_P
    takes = ((offset_PxW >= 0) & (offset_PxW < cum_PxW[:, -1:])).reshape(R)
    src_local = jax.vmap(lambda c, o: jnp.searchsorted(c, o, side="right"))(cum_PxW, jnp.maximum(offset_PxW, 0))
    src = row_prompt * W + jnp.minimum(src_local, W - 1).reshape(R).astype(jnp.int32)
    new = rows.paths.take(src)
    leaves = Leaves(paths=jax.tree.map(lambda old, x: jnp.where(takes.reshape((R,) + (1,) * (x.ndim - 1)), x, old),
                                       leaves.paths, new),
                    status_R=jnp.where(takes, status_R[src], leaves.status_R),
                    row_R=jnp.where(takes, src, leaves.row_R))
    finished_now = jnp.sum(ended_PxW, axis=-1).astype(jnp.int32)
    leaf_node = jnp.take_along_axis(rows.paths.path_RxD1, rows.depth_R[:, None], axis=1)[:, 0]
    flat = jnp.where(ended_R, row_prompt * N + leaf_node, P * N)
    nodes = nodes.replace(status_PxN=nodes.status_PxN.reshape(-1).at[flat].set(status_R, mode="drop").reshape(P, N),
                          leaves_P=nodes.leaves_P + cum_PxW[:, -1].astype(jnp.int32))
    stops = counters.stops_K.at[jnp.where(ended_R, status_R, len(NodeStatus))].add(mult_R, mode="drop")
    return leaves, nodes, counters.replace(stops_K=stops), finished_now


# ----------------------------------------------------------------------------------------------- 6-7. branches
def branch_budget(live_PxW: jax.Array, finished_now_P: jax.Array, leaves_P: jax.Array, *, tc: TreeConfig):
    """int32[P]: paths for the next segment, ``max(min(W - F, b A + b f), A)`` (``b f`` only with
    ``budget_transfer``); ``F`` leaves so far (this segment's included), ``A`` live paths, ``f`` ended now."""
    b = tc.branch_factor
    n_live = jnp.sum(live_PxW, axis=-1).astype(jnp.int32)
    cap = b * n_live + (b * finished_now_P if tc.budget_transfer else 0)
    return jnp.maximum(jnp.minimum(tc.num_leaves - leaves_P, cap), n_live)


def assign_free_rows(counts_PxW: jax.Array, live_PxW: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each live path keeps its row; its ``count - 1`` extra children take the prompt's free rows in order (the
    j-th free row goes to the path whose cumulative extra count first exceeds j). Returns ``(src_R, forked_R)``:
    the row each row copies from (itself if none) and whether it is a new fork."""
    src, forked, _ = _children_rows(counts_PxW, live_PxW)
    return src, forked


def _children_rows(counts_PxW: jax.Array, live_PxW: jax.Array):
    """:func:`assign_free_rows` plus ``child_R``: which child of its parent each row holds (0 = the parent's own
    row, 1.. = its forks in free-row order; 0 for rows that hold no path)."""
    P, W = live_PxW.shape
    rows_PxW = jnp.arange(P * W, dtype=jnp.int32).reshape(P, W)
    extra = jnp.maximum(counts_PxW - 1, 0)
    cum = jnp.cumsum(extra, axis=-1)  # inclusive
    free = ~live_PxW
    free_rank = kernels.rank_within(free)
    parent_local = jax.vmap(lambda cm, j: jnp.searchsorted(cm, j, side="right"))(cum, free_rank)
    takes = free & (free_rank < cum[:, -1:])
    first_extra = jnp.take_along_axis(cum - extra, jnp.minimum(parent_local, W - 1), axis=-1)
    child = jnp.where(takes, free_rank - first_extra + 1, 0)
    src = jnp.where(takes, (rows_PxW // W) * W + parent_local, rows_PxW).reshape(P * W)
    return src, takes.reshape(P * W), child.reshape(P * W).astype(jnp.int32)


def split_slots(slots_R: jax.Array, counts_R: jax.Array, src_R: jax.Array, child_R: jax.Array,
                holds_R: jax.Array) -> jax.Array:
    """int32[R]: a slot tree's slots per row after a boundary: a path with ``n`` slots and ``c`` children gives
    child ``i`` (0 = its own row) ``n // c + (i < n mod c)``; rows that hold no path get 0."""
    n, c = slots_R[src_R], jnp.maximum(counts_R[src_R], 1)
    return jnp.where(holds_R, n // c + (child_R < n % c).astype(jnp.int32), 0).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------- 8. fallback
@struct.dataclass
class Fallback:
    """Per prompt: ``need_P`` (no live path, < W leaves), ``has_leaf_P`` (a resident FINISHED/EOS leaf to
    re-enter from; else the root), ``leaf_P`` its slot, ``cut_P`` segments kept, ``base_row_P`` the row
    holding its KV; per row: ``rows_R`` rows that restart from it."""

    need_P: jax.Array
    has_leaf_P: jax.Array
    leaf_P: jax.Array
    cut_P: jax.Array
    base_row_P: jax.Array
    rows_R: jax.Array


def fall_back(leaves: Leaves, nodes: Nodes, n_live_P: jax.Array, key: jax.Array, segment: jax.Array, *,
              tc: TreeConfig) -> Fallback:
    """Depth-first fallback (official code): a prompt with no live path and fewer than ``W`` leaves picks a
    resident FINISHED/EOS leaf uniformly, cuts it at a random earlier boundary (``k ~ U{1..n_b}``, cut depth
    ``n_b - k``) and re-enters with ``min(b, W - F)`` rows: the leaf's row and the first other rows."""
    P, W = n_live_P.shape[0], tc.num_leaves
    leaves_P = nodes.leaves_P
    need = (n_live_P == 0) & (leaves_P < W) if tc.fallback and not tc.slots else jnp.zeros((P,), bool)
    k_pick, k_cut = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, FALLBACK_STREAM), segment))
    status = leaves.status_R
    resumable = (status == int(NodeStatus.FINISHED)) | (status == int(NodeStatus.EOS))
    cand = ((leaves.row_R >= 0) & resumable).reshape(P, W)
    cand = cand & (jnp.arange(W)[None, :] < leaves_P[:, None])
    pick = jnp.argmax(jnp.where(cand, jax.random.uniform(k_pick, (P, W)), -1.0), axis=-1)  # local leaf slot
    has_leaf = jnp.any(cand, axis=-1)
    leaf = jnp.arange(P) * W + pick
    leaf_depth = jnp.sum(leaves.paths.path_RxD1[leaf, 1:] >= 0, axis=-1)  # n_b
    k_draw = jax.random.randint(k_cut, (P,), 1, jnp.maximum(leaf_depth, 1) + 1)
    cut = jnp.where(has_leaf, leaf_depth - k_draw, 0)  # segments kept
    base_row = jnp.where(has_leaf, leaves.row_R[leaf], jnp.arange(P) * W)
    copies = jnp.minimum(tc.branch_factor, W - leaves_P)
    base_local = (base_row - jnp.arange(P) * W)[:, None]
    local = jnp.arange(W)[None, :]
    others_rank = kernels.rank_within(local != base_local)
    fb = need[:, None] & ((local == base_local) | ((local != base_local) & (others_rank < (copies - 1)[:, None])))
    return Fallback(need_P=need, has_leaf_P=has_leaf, leaf_P=leaf, cut_P=cut, base_row_P=base_row,
                    rows_R=fb.reshape(P * W))


# ----------------------------------------------------------------------------------------------- 9. fork
def restore_from_leaves(rows: Rows, leaves: Leaves, fb: Fallback, inputs: RolloutInputs, *, tc: TreeConfig) -> Rows:
    """Fallback rows restart from their prompt's leaf cut after ``cut`` segments (tokens and statistics up to
    ``cut * S``, path up to depth ``cut``; from the root: empty, pending = the prompt's last token). Their KV up to
    the cut is the base row's, so only the position moves back."""
    R, S = rows.alive_R.shape[0], tc.segment_length
    row_prompt = _row_prompt(R, tc.num_leaves)
    fbm = fb.rows_R
    cut = fb.cut_P[row_prompt]
    leaf = leaves.paths.take(fb.leaf_P[row_prompt])
    keep_t = jnp.arange(leaf.tokens_RxT.shape[1])[None, :] < (cut * S)[:, None]
    keep_d = jnp.arange(leaf.path_RxD1.shape[1])[None, :] <= cut[:, None]

    def per_token(row_x, leaf_x):
        extra = (1,) * (row_x.ndim - 2)
        kept = jnp.where(keep_t.reshape(keep_t.shape + extra), leaf_x, jnp.zeros((), leaf_x.dtype))
        return jnp.where(fbm.reshape((R, 1) + extra), kept, row_x)

    p = rows.paths
    root_path = jnp.where(fb.has_leaf_P[row_prompt][:, None], leaf.path_RxD1, 0)
    p = p.replace(tokens_RxT=per_token(p.tokens_RxT, leaf.tokens_RxT), logp_RxT=per_token(p.logp_RxT, leaf.logp_RxT),
                  slogp_RxT=per_token(p.slogp_RxT, leaf.slogp_RxT),
                  entropy_RxT=per_token(p.entropy_RxT, leaf.entropy_RxT),
                  topk_RxTxK=per_token(p.topk_RxTxK, leaf.topk_RxTxK),
                  extra_RxTxC=per_token(p.extra_RxTxC, leaf.extra_RxTxC),
                  path_RxD1=jnp.where(fbm[:, None], jnp.where(keep_d, root_path, -1), p.path_RxD1),
                  length_R=jnp.where(fbm, cut * S, p.length_R))
    prev_tok = jnp.take_along_axis(leaf.tokens_RxT, jnp.maximum(cut * S - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(cut > 0, prev_tok, inputs.prompt_token_P[row_prompt])
    return rows.replace(paths=p, depth_R=jnp.where(fbm, cut, rows.depth_R),
                        pending_R=jnp.where(fbm, pending, rows.pending_R),
                        position_R=jnp.where(fbm, inputs.prompt_position_P[row_prompt] + cut * S, rows.position_R))


def fork(cache, cache_order_R: jax.Array, rows: Rows, leaves: Leaves, src_R: jax.Array, forked_R: jax.Array,
         fb: Fallback, inputs: RolloutInputs, *, model: decode.ModelFns, tc: TreeConfig):
    """Row ``r`` takes row ``src_R[r]``'s state and KV (forks; fallback rows take their base row), fallback rows
    restart from their leaf, every reassigned row gets a new key epoch. ``cache`` is in the order
    ``cache_order_R`` (from :func:`decode_segment`): the permutation back and the forks are one gather.
    Returns ``(cache, rows)``; ``rows.alive_R`` is the new live set."""
    R = src_R.shape[0]
    new_alive = rows.alive_R | forked_R | fb.rows_R
    src = jnp.where(fb.rows_R, fb.base_row_P[_row_prompt(R, tc.num_leaves)], src_R)
    moved = rows.take(src).replace(epoch_R=rows.epoch_R + (forked_R | fb.rows_R).astype(jnp.int32), alive_R=new_alive)
    moved = restore_from_leaves(moved, leaves, fb, inputs, tc=tc)
    identity = jnp.arange(R, dtype=jnp.int32)
    if len(bucket_sizes(R, tc.row_buckets)) == 1:
        cache = model.shard_cache(cache_lib.fork_rows(cache, src, jnp.any(src != identity)))
    else:  # back to logical order, composed with the forks: one gather
        inverse = jnp.zeros((R,), jnp.int32).at[cache_order_R].set(identity)
        cache = model.shard_cache(cache_lib.fork_rows(cache, inverse[src]))
    # a shared-prefix cache: forks copied their parent's rank; in logical order row r is rank r mod W
    cache = cache_lib.renumber_rows(cache, identity % tc.num_leaves)
    return cache, moved


def restart_at_root(rows: Rows, root_R: jax.Array, inputs: RolloutInputs, *, tc: TreeConfig) -> Rows:
    """Rows ``root_R`` start a new path at the root: empty buffers, path = the root only, pending = the prompt's
    last token at its position. Their KV holds the prompt (every row of a prompt does: it was forked from one);
    only the position moves back, and the slots past it are overwritten as the new path decodes."""
    R = root_R.shape[0]
    row_prompt = _row_prompt(R, tc.num_leaves)

    def clear(x):
        m = root_R.reshape((R,) + (1,) * (x.ndim - 1))
        return jnp.where(m, jnp.zeros((), x.dtype), x)

    p = rows.paths
    root_path = jnp.where(jnp.arange(p.path_RxD1.shape[1])[None, :] == 0, 0, -1)
    p = jax.tree.map(clear, p).replace(path_RxD1=jnp.where(root_R[:, None], root_path, p.path_RxD1))
    return rows.replace(paths=p, depth_R=jnp.where(root_R, 0, rows.depth_R),
                        pending_R=jnp.where(root_R, inputs.prompt_token_P[row_prompt], rows.pending_R),
                        position_R=jnp.where(root_R, inputs.prompt_position_P[row_prompt], rows.position_R))


def release_rows(leaves: Leaves, alive_R: jax.Array) -> Leaves:
    """A leaf stays resident (a fallback candidate) only while no live path decodes in its row."""
    row = leaves.row_R
    return leaves.replace(row_R=jnp.where((row >= 0) & ~alive_R[jnp.maximum(row, 0)], row, -1))


# ----------------------------------------------------------------------------------------------- the step
def segment_step(state: TreeState, inputs: RolloutInputs, *, model: decode.ModelFns, tc: TreeConfig,
                 stop_ids: tuple[int, ...]) -> TreeState:
    """One segment for every prompt: stages 1-9 of the module docstring."""
    rule, counters, W = tc.rule, state.counters, tc.num_leaves
    rows, nodes = open_nodes(state.rows, state.nodes)
    seg_start, alive = rows.paths.length_R, rows.alive_R
    cache, rows, eos, cache_order, decoded = decode_segment(state.cache, rows, counters.decoded, inputs, model=model,
                                                            tc=tc, stop_ids=stop_ids)
    rows = rows.replace(depth_R=rows.depth_R + alive.astype(jnp.int32), alive_R=alive)
    status = classify_paths(rows, eos, seg_start, tc=tc)
    stats = path_stats(rows, status, seg_start, nodes, counters, inputs, tc=tc)
    if rule.needs_path_scores:
        stats = score_paths(stats, rows, inputs, tc=tc)
    if rule.prunes:
        stats = prune_paths(stats, rule)
        status = jnp.where(alive, stats.status_PxW.reshape(-1), status)
    ended = stats.ended_PxW.reshape(-1)
    leaves, nodes, counters, finished_now = store_leaves(state.leaves, nodes, counters, rows, ended, status)
    live = stats.live_PxW
    if tc.slots:  # a path splits its own slots; no transfer, no fallback
        slots_PxW = rows.slots_R.reshape(live.shape)
        counts = jnp.where(live, jnp.clip(rule.slot_children(stats, slots_PxW), 1, jnp.maximum(slots_PxW, 1)), 0)
    else:
        total = branch_budget(live, finished_now, nodes.leaves_P, tc=tc)
        counts = jnp.where(live, jnp.clip(rule.allocate(stats, total), 1, W), 0)
    src, forked, child = _children_rows(counts, live)
    root = jnp.zeros_like(forked)
    if rule.restarts and not tc.slots:  # the rule's root restarts: the prompt's first forked rows
        n_root = jnp.clip(rule.root_restarts(stats, counts), 0, None)
        forked_PxW = forked.reshape(live.shape)
        root = (forked_PxW & (kernels.rank_within(forked_PxW) < n_root[:, None])).reshape(-1)
    fb = fall_back(leaves, nodes, jnp.sum(live, axis=-1).astype(jnp.int32), inputs.key, counters.segment, tc=tc)
    cache, new_rows = fork(cache, cache_order, rows.replace(alive_R=live.reshape(-1)), leaves, src, forked, fb,
                           inputs, model=model, tc=tc)
    if rule.restarts and not tc.slots:
        new_rows = restart_at_root(new_rows, root, inputs, tc=tc)
    if tc.slots:
        new_rows = new_rows.replace(slots_R=split_slots(rows.slots_R, counts.reshape(-1), src, child,
                                                        new_rows.alive_R))
    rows = new_rows
    counters = counters.replace(
        segment=counters.segment + 1, decoded=decoded, forks=counters.forks + jnp.sum(forked).astype(jnp.int32),
        fallbacks=counters.fallbacks + jnp.sum(fb.need_P).astype(jnp.int32),
        from_root=counters.from_root + jnp.sum(fb.need_P & ~fb.has_leaf_P).astype(jnp.int32),
        root_restarts=counters.root_restarts + jnp.sum(root).astype(jnp.int32))
    return shard_state(model, TreeState(cache=cache, rows=rows, leaves=release_rows(leaves, rows.alive_R),
                                        nodes=nodes, counters=counters))
