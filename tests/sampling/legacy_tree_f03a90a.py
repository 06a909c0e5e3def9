# Frozen copy of treejax/sampling/tree.py at f03a90a (before issue 13), the oracle of tests/sampling/test_tree_refactor.py:
# the refactored rollout must reproduce it bit for bit. Not part of the package; delete with that test once the
# refactor has settled.
"""Segment-wise tree rollouts (TreePO, arXiv 2508.17445, Algorithm 1) as ONE jitted program.

Layout. ``P`` prompts x ``W`` leaves live in ``R = P * W`` cache rows; prompt ``p`` owns rows ``p*W .. p*W+W-1``.
The cache has ``L = bucket(Lp) + D * S`` slots (rounded to the attention block). Each prompt is prefilled ONCE
(into its first row) and its KV copied into all its rows; every later branch is a cache-row copy (never a
re-prefill). At most ``W`` paths of a prompt are ever live, because live paths + leaves <= W (see budget).

Loop (``lax.while_loop`` over segments, ``lax.while_loop`` over the <= S tokens of a segment):

1. every live row opens a new node at depth ``d + 1`` (fresh id; parent = its node at depth ``d``);
2. decode up to ``S`` tokens for all live rows (stop tokens end a row inside the segment; so does the
   maximum response length);
3. per path, after the segment (TreePO code order): stop token -> ``FINISHED`` if the answer predicate holds
   on the response, else ``EOS``; optional ``finish_on_answer``: predicate alone -> ``FINISHED``;
   n-gram repetition (``kernels.ngram_repetition`` on the last segment, or on the whole response) ->
   ``REPETITION``; response length >= ``max_response_length`` or depth == ``D`` -> ``TRUNCATED``; else live.
   Ended paths are written to the leaf store (tokens, log-probs, path, status);
4. branch-budget transfer (official code): with ``F`` leaves so far, ``A`` live paths and ``f`` paths that
   ended in this segment,
       ``total = max(min(W - F, b * A + b * f), A)``
   (``budget_transfer=False``: ``max(min(W - F, b * A), A)``), split over the live paths, each >= 1:
     * ``fixed_average``          largest remainder with equal weights (``total // A`` each, the remainder one
                                   each to the first paths);
     * ``fixed_average_official`` the official code's split: ``total // A`` each, the whole remainder to the last
                                   live path;
     * ``logprob_segment`` / ``logprob_path`` weights ``softmax(sign * (x - min x) / T)`` with ``x`` the mean
       log-prob of the path's last segment / whole response, temperature ``T`` fixed or scheduled by the
       training step (``kernels.temperature_schedule``), integer split by largest remainder
       (``kernels.allocate_budget``);
   a path with ``c`` children keeps decoding in its own row and forks ``c - 1`` copies into free rows;
5. depth-first fallback: a prompt with no live path and fewer than ``W`` leaves re-enters the tree from a
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
events), ``fallback_from_root``, ``segments`` (loop iterations), ``stops`` (leaves per :class:`NodeStatus`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from treejax.forest import Forest, NodeStatus
from treejax.models.config import ModelConfig
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules
from treejax.sampling import attention as attention_lib
from treejax.sampling import cache as cache_lib
from treejax.sampling import decode, kernels
from treejax.sampling.strategies import Strategy, Temperature

DIVERGENCE_POLICIES = ("fixed_average", "fixed_average_official", "logprob_segment", "logprob_path")
_BRANCH_STREAM, _FALLBACK_STREAM, _INIT_STREAM = 0x7B1, 0x7B2, 0x7B3


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static settings of a tree rollout (hashable; part of the jit signature).

    ``num_leaves`` W, ``max_depth`` D, ``segment_length`` S, ``branch_factor`` b; ``init_divergence`` initial
    branches per prompt (default b) or ``init_divergence_range=(m, n)`` for a random count in ``[m, n]`` per
    prompt; ``max_response_length`` (default ``D * S``); ``stop_ids`` (default: the model's EOS ids);
    ``answer_fn(tokens_T, length) -> bool`` optional jittable predicate (e.g. ``predicates.BoxedAnswer``);
    ``repetition_ngram``/``repetition_count`` (0 disables) and ``repetition_scope`` ("segment" | "response");
    ``divergence`` one of :data:`DIVERGENCE_POLICIES`, ``divergence_sign`` (+1 favours confident paths),
    ``divergence_temperature`` or ``divergence_schedule=(start, end, num_steps)`` over the training step;
    ``max_prompt_length``: prompts longer than this are rejected (the cache is sized from it when given).
    ``row_buckets``: the decode step runs on the smallest of ``R, R/2, ..., R/2^(row_buckets-1)`` rows that
    holds every live path (live rows are packed first at each segment start; 1 = always all ``R`` rows). A tree
    has few live paths near the root, so this is where its saving in decode cost comes from.
    """

    num_leaves: int = 16
    max_depth: int = 4
    segment_length: int = 64
    branch_factor: int = 2
    init_divergence: int | None = None
    init_divergence_range: tuple[int, int] | None = None
    max_response_length: int | None = None
    strategy: Strategy = Temperature(1.0)
    stop_ids: tuple[int, ...] | None = None
    answer_fn: Callable | None = None
    finish_on_answer: bool = False
    repetition_ngram: int = 0
    repetition_count: int = 0
    repetition_scope: str = "segment"
    divergence: str = "fixed_average"
    divergence_sign: float = 1.0
    divergence_temperature: float = 2.0
    divergence_schedule: tuple[float, float, int] | None = None
    budget_transfer: bool = True
    fallback: bool = True
    max_prompt_length: int | None = None
    with_entropy: bool = False
    row_buckets: int = 4

    def __post_init__(self):
        W, b = self.num_leaves, self.branch_factor
        if W < 1:
            raise ValueError(f"TreeConfig.num_leaves (W) must be >= 1, got {W}")
        if self.segment_length <= 0:
            raise ValueError(f"TreeConfig.segment_length (S) must be > 0, got {self.segment_length}")
        if self.max_depth <= 0:
            raise ValueError(f"TreeConfig.max_depth (D) must be > 0, got {self.max_depth}")
        if b < 1:
            raise ValueError(f"TreeConfig.branch_factor (b) must be >= 1, got {b}")
        if W < b:
            raise ValueError(f"TreeConfig.num_leaves (W={W}) must be >= branch_factor (b={b})")
        if self.init_divergence is not None and not 1 <= self.init_divergence <= W:
            raise ValueError(f"TreeConfig.init_divergence must be in [1, W={W}], got {self.init_divergence}")
        if self.init_divergence_range is not None:
            m, n = self.init_divergence_range
            if not 1 <= m <= n <= W:
                raise ValueError(f"TreeConfig.init_divergence_range must satisfy 1 <= m <= n <= W={W}, got {(m, n)}")
        if self.max_response_length is not None and not 0 < self.max_response_length <= self.max_depth * self.segment_length:
            raise ValueError(f"TreeConfig.max_response_length must be in (0, D*S={self.max_depth * self.segment_length}]"
                             f", got {self.max_response_length}")
        if self.divergence not in DIVERGENCE_POLICIES:
            raise ValueError(f"unknown divergence policy {self.divergence!r}; valid: {DIVERGENCE_POLICIES}")
        if self.repetition_scope not in ("segment", "response"):
            raise ValueError(f"repetition_scope must be 'segment' or 'response', got {self.repetition_scope!r}")
        if (self.repetition_ngram > 0) != (self.repetition_count > 0):
            raise ValueError("set both repetition_ngram and repetition_count (> 0) or neither")
        if self.row_buckets < 1:
            raise ValueError(f"row_buckets must be >= 1, got {self.row_buckets}")
        if self.max_prompt_length is not None and self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {self.max_prompt_length}")

    @property
    def response_capacity(self) -> int:
        """T = D * S: per-leaf token capacity."""
        return self.max_depth * self.segment_length

    @property
    def max_length(self) -> int:
        return self.response_capacity if self.max_response_length is None else self.max_response_length

    @property
    def num_nodes(self) -> int:
        """Node capacity per prompt: every node lies on some leaf's path, so ``N <= 1 + W * D``."""
        return 1 + self.num_leaves * self.max_depth

    @property
    def max_segments(self) -> int:
        """Loop bound: each round of a prompt ends >= 1 leaf within D segments, so W * D iterations suffice."""
        return self.num_leaves * self.max_depth


def independent_config(num_samples: int, max_new_tokens: int, segment_length: int | None = None, **kw) -> TreeConfig:
    """The GRPO baseline as a tree: ``num_samples`` chains per prompt (``b = 1``, init divergence W, no fallback
    needed since every chain ends in exactly one leaf). ``max_new_tokens`` is rounded up to whole segments."""
    S = segment_length or max_new_tokens
    D = -(-max_new_tokens // S)
    return TreeConfig(num_leaves=num_samples, max_depth=D, segment_length=S, branch_factor=1,
                      init_divergence=num_samples, max_response_length=max_new_tokens, **kw)


# ----------------------------------------------------------------------------------------------- small helpers
def _rank_within(mask_PxW: jax.Array) -> jax.Array:
    """Exclusive rank of each True entry among the True entries of its prompt row."""
    m = mask_PxW.astype(jnp.int32)
    return jnp.cumsum(m, axis=-1) - m


def _row_slices(x_RxT: jax.Array, start_R: jax.Array, size: int) -> jax.Array:
    return jax.vmap(lambda row, s: lax.dynamic_slice_in_dim(row, s, size))(x_RxT, start_R)


def _bucket_sizes(R: int, buckets: int) -> tuple[int, ...]:
    """Static row counts the decode step may run on: ``R, R/2, ..., R/2^(buckets-1)`` (ascending, >= 1)."""
    return tuple(sorted({max(1, -(-R // (2 ** i))) for i in range(max(1, buckets))}))


def _official_average(live_PxW, total_P):
    n = jnp.sum(live_PxW, axis=-1)
    base = jnp.where(n > 0, total_P // jnp.maximum(n, 1), 0)
    rem = jnp.where(n > 0, total_P - base * n, 0)
    rank = _rank_within(live_PxW)
    last = live_PxW & (rank == (n - 1)[:, None])
    return jnp.where(live_PxW, base[:, None] + jnp.where(last, rem[:, None], 0), 0).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------- the rollout
def _rollout_core(params, prompts, lengths, key, step, *, model: decode.ModelFns, tc: TreeConfig,
                  stop_ids: tuple[int, ...]):
    decode._count_trace("tree_rollout")
    P, Lb = prompts.shape
    W, D, S, b = tc.num_leaves, tc.max_depth, tc.segment_length, tc.branch_factor
    T, N, R = tc.response_capacity, tc.num_nodes, prompts.shape[0] * tc.num_leaves
    max_len = tc.max_length
    L = attention_lib.round_cache_length(Lb + T, model.cache_multiple)
    i32 = jnp.int32
    rows = jnp.arange(R, dtype=i32)
    row_prompt = rows // W

    # ---- prefill once per prompt, then copy each prompt's KV into all of its rows
    cache = model.shard_cache(model.init_cache(R, L))
    params = model.prepare(params)  # e.g. unstack the layers once, outside the decode loops
    cache, last_tok_P, last_pos_P = decode.prefill_prompts(model, params, cache, prompts, lengths,
                                                           jnp.arange(P, dtype=i32) * W)
    cache = model.shard_cache(cache_lib.broadcast_prompt_rows(cache, row_prompt * W))

    # ---- initial divergence
    if tc.init_divergence_range is not None:
        m, n = tc.init_divergence_range
        n_init = jax.random.randint(jax.random.fold_in(key, _INIT_STREAM), (P,), m, n + 1, dtype=i32)
    else:
        n_init = jnp.full((P,), b if tc.init_divergence is None else tc.init_divergence, i32)
    alive0 = (jnp.arange(W)[None, :] < n_init[:, None]).reshape(R)
    path0 = jnp.full((R, D + 1), -1, i32).at[:, 0].set(0)
    node_parent = jnp.full((P, N), -1, i32)
    node_depth = jnp.full((P, N), -1, i32).at[:, 0].set(0)
    node_status = jnp.zeros((P, N), i32).at[:, 0].set(int(NodeStatus.ALIVE))
    f32 = jnp.zeros((R, T), jnp.float32)
    state = dict(
        it=i32(0), cache=cache, pending=last_tok_P[row_prompt], position=last_pos_P[row_prompt],
        epoch=jnp.zeros((R,), i32), alive=alive0, depth=jnp.zeros((R,), i32), rlen=jnp.zeros((R,), i32),
        rtok=jnp.zeros((R, T), i32), rlogp=f32, rslogp=f32, rent=f32, rpath=path0,
        ltok=jnp.zeros((R, T), i32), llogp=f32, lslogp=f32, lent=f32, lpath=jnp.full((R, D + 1), -1, i32),
        lstatus=jnp.zeros((R,), i32), llen=jnp.zeros((R,), i32), lrow=jnp.full((R,), -1, i32),
        nleaves=jnp.zeros((P,), i32), node_parent=node_parent, node_depth=node_depth, node_status=node_status,
        next_node=jnp.ones((P,), i32), decoded=i32(0), forks=i32(0), fallbacks=i32(0), from_root=i32(0),
        stops=jnp.zeros((len(NodeStatus),), i32),
    )
    # per-row state (leading axis R) sharded like the cache rows on a mesh (identity without one)
    state_row_keys = ("pending", "position", "epoch", "alive", "depth", "rlen", "rtok", "rlogp", "rslogp", "rent",
                      "rpath", "ltok", "llogp", "lslogp", "lent", "lpath", "lstatus", "llen", "lrow")

    def shard_state(s):
        return dict(s, **model.shard_rows({k: s[k] for k in state_row_keys}))

    state = shard_state(state)
    if tc.divergence_schedule is not None:
        start, end, nsteps = tc.divergence_schedule
        div_temp = kernels.temperature_schedule(step, int(nsteps), float(start), float(end))
    else:
        div_temp = jnp.float32(tc.divergence_temperature)

    def cond(s):
        return jnp.any(s["nleaves"] < W) & (s["it"] < tc.max_segments)

    def segment(s):
        it = s["it"]
        alive, depth = s["alive"], s["depth"]
        # 1. new nodes for live rows
        alive_PxW = alive.reshape(P, W)
        new_id = (s["next_node"][:, None] + _rank_within(alive_PxW)).reshape(R)
        parent_id = jnp.take_along_axis(s["rpath"], depth[:, None], axis=1)[:, 0]
        flat = jnp.where(alive, row_prompt * N + new_id, P * N)
        node_parent = s["node_parent"].reshape(-1).at[flat].set(parent_id, mode="drop").reshape(P, N)
        node_depth = s["node_depth"].reshape(-1).at[flat].set(depth + 1, mode="drop").reshape(P, N)
        node_status = s["node_status"].reshape(-1).at[flat].set(int(NodeStatus.ALIVE), mode="drop").reshape(P, N)
        next_node = s["next_node"] + jnp.sum(alive_PxW, axis=-1).astype(i32)
        rpath = jnp.where((jnp.arange(D + 1)[None, :] == depth[:, None] + 1) & alive[:, None], new_id[:, None],
                          s["rpath"])
        seg_start = s["rlen"]

        # 2. decode up to S tokens (on a compacted prefix of rows when row buckets are enabled)
        row_keys = ("pending", "position", "rlen", "rtok", "rlogp", "rslogp", "rent", "eos", "active")

        def shard_carry(c):  # the decode carry's per-row arrays sharded like the cache rows (on a mesh)
            return dict(c, **model.shard_rows({k: c[k] for k in row_keys}))

        def tok_cond(c):
            return (c["j"] < S) & jnp.any(c["active"])

        def make_tok_body(row_ids, epochs):
            local = jnp.arange(row_ids.shape[0])

            def tok_body(c):
                active = c["active"]
                keys = decode.token_keys(key, row_ids, epochs, c["rlen"])
                tok, lp, slp, ent, cache = decode.decode_token(model, tc.strategy, params, c["cache"],
                                                               c["pending"], c["position"], active, keys,
                                                               tc.with_entropy)
                col = jnp.where(active, c["rlen"], T)
                stopped = active & decode.stop_mask(tok, stop_ids)
                rlen = c["rlen"] + active.astype(i32)
                return shard_carry(dict(
                    j=c["j"] + 1, cache=cache, pending=jnp.where(active, tok, c["pending"]),
                    position=c["position"] + active.astype(i32), rlen=rlen,
                    rtok=c["rtok"].at[local, col].set(tok, mode="drop"),
                    rlogp=c["rlogp"].at[local, col].set(lp, mode="drop"),
                    rslogp=c["rslogp"].at[local, col].set(slp, mode="drop"),
                    rent=c["rent"].at[local, col].set(ent, mode="drop") if tc.with_entropy else c["rent"],
                    eos=c["eos"] | stopped, active=active & ~stopped & (rlen < max_len),
                    decoded=c["decoded"] + jnp.sum(active).astype(i32)))

            return tok_body

        c0 = shard_carry(dict(j=i32(0), cache=s["cache"], pending=s["pending"], position=s["position"],
                              rlen=s["rlen"], rtok=s["rtok"], rlogp=s["rlogp"], rslogp=s["rslogp"], rent=s["rent"],
                              eos=jnp.zeros((R,), bool), active=alive, decoded=s["decoded"]))
        sizes = _bucket_sizes(R, tc.row_buckets)
        if len(sizes) == 1:
            c = lax.while_loop(tok_cond, make_tok_body(rows, s["epoch"]), c0)
            cache_order = rows
        else:
            # live rows first (stable): the decode step then runs on the smallest bucket of rows holding them,
            # so weights are shared but KV reads and FLOPs follow the number of live paths
            perm = jnp.argsort(~alive, stable=True).astype(i32)
            cache_p = model.shard_cache(cache_lib.fork_rows(s["cache"], perm))

            def make_branch(nb):
                def branch(cache_p, c0):
                    sel = perm[:nb]
                    sub = {k: (v[sel] if k in row_keys else v) for k, v in c0.items() if k != "cache"}
                    sub["cache"] = model.shard_cache(jax.tree.map(lambda x: lax.slice_in_dim(x, 0, nb, axis=0),
                                                                  cache_p))
                    sub = shard_carry(sub)
                    out = lax.while_loop(tok_cond, make_tok_body(sel, s["epoch"][sel]), sub)
                    merged = {k: (c0[k].at[sel].set(out[k]) if k in row_keys else out[k]) for k in out
                              if k != "cache"}
                    merged["cache"] = model.shard_cache(jax.tree.map(
                        lambda full, part: lax.dynamic_update_slice_in_dim(full, part, 0, 0), cache_p, out["cache"]))
                    return merged
                return branch

            n_alive = jnp.sum(alive)
            which = jnp.sum(jnp.asarray(sizes[:-1]) < n_alive).astype(i32)
            c = lax.switch(which, [make_branch(nb) for nb in sizes], cache_p, c0)
            cache_order = perm  # physical row i of c["cache"] holds logical row perm[i]
        rlen, rtok, rlogp = c["rlen"], c["rtok"], c["rlogp"]
        depth = depth + alive.astype(i32)

        # 3. classify ended paths
        if tc.answer_fn is not None:
            answer = jax.vmap(tc.answer_fn)(rtok, rlen)
        else:
            answer = jnp.zeros((R,), bool)
        eos = alive & c["eos"]
        if tc.repetition_ngram > 0:
            if tc.repetition_scope == "segment":
                seg = _row_slices(jnp.pad(rtok, ((0, 0), (0, S))), seg_start, S)
                rep = kernels.ngram_repetition(seg, rlen - seg_start, tc.repetition_ngram, tc.repetition_count)
            else:
                rep = kernels.ngram_repetition(rtok, rlen, tc.repetition_ngram, tc.repetition_count)
        else:
            rep = jnp.zeros((R,), bool)
        status = jnp.full((R,), int(NodeStatus.ALIVE), i32)
        status = jnp.where((rlen >= max_len) | (depth >= D), int(NodeStatus.TRUNCATED), status)
        status = jnp.where(rep, int(NodeStatus.REPETITION), status)
        if tc.finish_on_answer:
            status = jnp.where(answer, int(NodeStatus.FINISHED), status)
        status = jnp.where(eos, jnp.where(answer, int(NodeStatus.FINISHED), int(NodeStatus.EOS)), status)
        ended = alive & (status != int(NodeStatus.ALIVE))
        still = alive & ~ended

        # 4. write ended paths to the leaf store (slot = leaves so far + rank among this segment's ended rows)
        ended_PxW = ended.reshape(P, W)
        slot = (s["nleaves"][:, None] + _rank_within(ended_PxW)).reshape(R)
        dst = jnp.where(ended, row_prompt * W + slot, R)
        ltok = s["ltok"].at[dst].set(rtok, mode="drop")
        llogp = s["llogp"].at[dst].set(rlogp, mode="drop")
        lslogp = s["lslogp"].at[dst].set(c["rslogp"], mode="drop")
        lent = s["lent"].at[dst].set(c["rent"], mode="drop")
        lpath = s["lpath"].at[dst].set(rpath, mode="drop")
        lstatus = s["lstatus"].at[dst].set(status, mode="drop")
        llen = s["llen"].at[dst].set(rlen, mode="drop")
        lrow = s["lrow"].at[dst].set(rows, mode="drop")
        finished_now = jnp.sum(ended_PxW, axis=-1).astype(i32)
        nleaves = s["nleaves"] + finished_now
        leaf_node = jnp.take_along_axis(rpath, depth[:, None], axis=1)[:, 0]
        flat = jnp.where(ended, row_prompt * N + leaf_node, P * N)
        node_status = node_status.reshape(-1).at[flat].set(status, mode="drop").reshape(P, N)
        stops = s["stops"].at[jnp.where(ended, status, len(NodeStatus))].add(1, mode="drop")

        # 5. branch-budget transfer and allocation
        live = still.reshape(P, W)
        n_live = jnp.sum(live, axis=-1).astype(i32)
        cap = b * n_live + (b * finished_now if tc.budget_transfer else 0)
        total = jnp.maximum(jnp.minimum(W - nleaves, cap), n_live)
        if tc.divergence == "fixed_average_official":
            counts = _official_average(live, total)
        else:
            if tc.divergence == "fixed_average":
                weights = jnp.ones((P, W), jnp.float32)
            else:
                if tc.divergence == "logprob_segment":
                    in_seg = (jnp.arange(T)[None, :] >= seg_start[:, None]) & (jnp.arange(T)[None, :] < rlen[:, None])
                else:
                    in_seg = jnp.arange(T)[None, :] < rlen[:, None]
                x = jnp.sum(jnp.where(in_seg, rlogp, 0.0), -1) / jnp.maximum(jnp.sum(in_seg, -1), 1)
                weights = kernels.divergence_weights(x.reshape(P, W), live, div_temp, tc.divergence_sign)
            counts = kernels.allocate_budget(weights, live, total, minimum=1)
        extra = jnp.maximum(counts - 1, 0)  # [P, W]
        cum = jnp.cumsum(extra, axis=-1)  # inclusive
        free = ~live
        free_rank = _rank_within(free)
        parent_local = jax.vmap(lambda cm, j: jnp.searchsorted(cm, j, side="right"))(cum, free_rank)
        takes = free & (free_rank < cum[:, -1:])
        src = jnp.where(takes, row_prompt.reshape(P, W) * W + parent_local, rows.reshape(P, W)).reshape(R)
        forked = takes.reshape(R)
        new_alive = still | forked

        # 6. depth-first fallback for prompts with no live path and < W leaves
        need = (n_live == 0) & (nleaves < W) if tc.fallback else jnp.zeros((P,), bool)
        k_fb = jax.random.fold_in(jax.random.fold_in(key, _FALLBACK_STREAM), it)
        k_pick, k_cut = jax.random.split(k_fb)
        lrow_ok = lrow >= 0
        cand = (lrow_ok & ((lstatus == int(NodeStatus.FINISHED)) | (lstatus == int(NodeStatus.EOS)))).reshape(P, W)
        cand = cand & (jnp.arange(W)[None, :] < nleaves[:, None])
        score = jnp.where(cand, jax.random.uniform(k_pick, (P, W)), -1.0)
        pick = jnp.argmax(score, axis=-1)  # local leaf slot
        has_cand = jnp.any(cand, axis=-1)
        leaf_idx = jnp.arange(P) * W + pick
        leaf_depth = jnp.sum(lpath[leaf_idx, 1:] >= 0, axis=-1)  # n_b
        k_draw = jax.random.randint(k_cut, (P,), 1, jnp.maximum(leaf_depth, 1) + 1)
        cut = jnp.where(has_cand, leaf_depth - k_draw, 0)  # segments kept
        base_row = jnp.where(has_cand, lrow[leaf_idx], jnp.arange(P) * W)
        copies = jnp.minimum(b, W - nleaves)
        base_local = base_row - jnp.arange(P) * W
        local = jnp.arange(W)[None, :]
        others_rank = _rank_within(local != base_local[:, None])
        fb_rows = need[:, None] & ((local == base_local[:, None]) | ((local != base_local[:, None]) &
                                                                     (others_rank < (copies - 1)[:, None])))
        fb_row = fb_rows.reshape(R)
        src = jnp.where(fb_row, base_row[row_prompt], src)
        new_alive = new_alive | fb_row

        # gather row state from sources (forks), then set fallback rows from their leaf
        def g(x):
            return jnp.take(x, src, axis=0)

        position_g, pending_g = g(c["position"]), g(c["pending"])
        rtok_n, rlogp_n, rslogp_n, rent_n = g(rtok), g(rlogp), g(c["rslogp"]), g(c["rent"])
        rlen_n, depth_n, rpath_n = g(rlen), g(depth), g(rpath)
        cut_r = cut[row_prompt]
        lidx_r = leaf_idx[row_prompt]
        keep_t = jnp.arange(T)[None, :] < (cut_r * S)[:, None]
        keep_d = jnp.arange(D + 1)[None, :] <= cut_r[:, None]
        fbm = fb_row[:, None]
        rtok_n = jnp.where(fbm, jnp.where(keep_t, ltok[lidx_r], 0), rtok_n)
        rlogp_n = jnp.where(fbm, jnp.where(keep_t, llogp[lidx_r], 0.0), rlogp_n)
        rslogp_n = jnp.where(fbm, jnp.where(keep_t, lslogp[lidx_r], 0.0), rslogp_n)
        rent_n = jnp.where(fbm, jnp.where(keep_t, lent[lidx_r], 0.0), rent_n)
        rpath_n = jnp.where(fbm, jnp.where(keep_d, jnp.where(has_cand[row_prompt][:, None], lpath[lidx_r], 0), -1),
                            rpath_n)
        rlen_n = jnp.where(fb_row, cut_r * S, rlen_n)
        depth_n = jnp.where(fb_row, cut_r, depth_n)
        prev_tok = jnp.take_along_axis(ltok[lidx_r], jnp.maximum(cut_r * S - 1, 0)[:, None], axis=1)[:, 0]
        pending_n = jnp.where(fb_row, jnp.where(cut_r > 0, prev_tok, last_tok_P[row_prompt]), pending_g)
        position_n = jnp.where(fb_row, last_pos_P[row_prompt] + cut_r * S, position_g)
        reassigned = forked | fb_row
        if len(sizes) == 1:
            cache = model.shard_cache(cache_lib.fork_rows(c["cache"], src, jnp.any(src != rows)))
        else:  # back to logical order, composed with the forks: one gather
            inverse = jnp.zeros((R,), i32).at[cache_order].set(rows)
            cache = model.shard_cache(cache_lib.fork_rows(c["cache"], inverse[src]))
        # a leaf stays resident only while no live path decodes in its row
        lrow = jnp.where((lrow >= 0) & ~new_alive[jnp.maximum(lrow, 0)], lrow, -1)
        return shard_state(dict(
            it=it + 1, cache=cache, pending=pending_n, position=position_n, epoch=s["epoch"] + reassigned.astype(i32),
            alive=new_alive, depth=depth_n, rlen=rlen_n, rtok=rtok_n, rlogp=rlogp_n, rslogp=rslogp_n, rent=rent_n,
            rpath=rpath_n, ltok=ltok, llogp=llogp, lslogp=lslogp, lent=lent, lpath=lpath, lstatus=lstatus, llen=llen,
            lrow=lrow, nleaves=nleaves, node_parent=node_parent, node_depth=node_depth, node_status=node_status,
            next_node=next_node, decoded=c["decoded"], forks=s["forks"] + jnp.sum(forked).astype(i32),
            fallbacks=s["fallbacks"] + jnp.sum(need).astype(i32),
            from_root=s["from_root"] + jnp.sum(need & ~has_cand).astype(i32), stops=stops))

    s = lax.while_loop(cond, segment, state)

    t = jnp.arange(T)
    llen = s["llen"].reshape(P, W)
    valid = t[None, None, :] < llen[:, :, None]
    forest = Forest(
        node_parent=s["node_parent"], node_depth=s["node_depth"], node_status=s["node_status"],
        leaf_path=s["lpath"].reshape(P, W, D + 1), leaf_status=s["lstatus"].reshape(P, W), leaf_length=llen,
        tokens=jnp.where(valid, s["ltok"].reshape(P, W, T), 0),
        logprobs=jnp.where(valid, s["llogp"].reshape(P, W, T), 0.0),
        segment_index=jnp.where(valid, (t // S)[None, None, :], -1).astype(i32),
        loss_mask=valid.astype(jnp.float32), segment_length=S)
    info = dict(
        decoded_tokens=s["decoded"], prefilled_tokens=jnp.sum(lengths - 1).astype(i32), forks=s["forks"],
        fallbacks=s["fallbacks"], fallback_from_root=s["from_root"], segments=s["it"],
        stops={name: s["stops"][int(code)] for name, code in zip(NodeStatus.names(), NodeStatus)},
        complete=jnp.all(s["nleaves"] == W), num_nodes=s["next_node"], init_divergence=n_init,
        sampling_logprobs=jnp.where(valid, s["lslogp"].reshape(P, W, T), 0.0),
        entropy=jnp.where(valid, s["lent"].reshape(P, W, T), 0.0))
    return forest, info


def make_tree_rollout(model: ModelConfig | decode.ModelFns, tree_config: TreeConfig, mesh=None,
                      rules: Rules = DEFAULT_RULES):
    """Returns ``rollout(params, prompt_tokens [P, Lp], prompt_lengths [P], key, step=0) -> (Forest, info)``.

    ``model`` is a :class:`ModelConfig` (the treejax transformer with ragged attention) or any
    :class:`decode.ModelFns`. ``mesh`` (a ``jax.sharding.Mesh``, e.g. ``treejax.parallel.mesh.make_mesh``) with
    ``rules``: run sharded (module docstring); ``params`` should then be placed by ``transformer.
    param_logical_axes`` (``logical_to_sharding(..., mesh, shapes=params)``). Prompts are right-padded; the padded width is bucketed (powers of two) so a new
    prompt length recompiles only when it crosses a bucket. ``step`` (the training step) drives the divergence
    temperature schedule. ``info`` holds the counters (see module docstring), ``sampling_logprobs`` and
    ``entropy`` ``[P, W, T]``, and ``complete`` (every prompt has W leaves).
    """
    fns = decode.as_model_fns(model, mesh, rules)
    tc = tree_config
    stop_ids = tc.stop_ids
    if stop_ids is None:
        stop_ids = tuple(model.eos_token_ids) if isinstance(model, ModelConfig) else ()
    stop_ids = tuple(int(x) for x in stop_ids)
    core = jax.jit(functools.partial(_rollout_core, model=fns, tc=tc, stop_ids=stop_ids),
                   compiler_options=decode.SAMPLER_COMPILER_OPTIONS)

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
    return rollout


def make_independent_rollout(model: ModelConfig | decode.ModelFns, num_samples: int, max_new_tokens: int,
                             segment_length: int | None = None, mesh=None, rules: Rules = DEFAULT_RULES, **kw):
    """GRPO baseline through the same API: ``num_samples`` independent samples per prompt, each prompt prefilled
    once, returned as a :class:`Forest` of chains (one leaf per chain)."""
    return make_tree_rollout(model, independent_config(num_samples, max_new_tokens, segment_length, **kw),
                             mesh=mesh, rules=rules)
