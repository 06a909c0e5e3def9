"""The stages of the turn sampler (:func:`treejax.sampling.turns.run.run_turn_trees`). Each reads the run's
constants (:class:`~treejax.sampling.turns.state.TurnContext`), changes the rows in flight
(:class:`~treejax.sampling.turns.state.TurnRows`) and the turn trees in place (host state), and returns the KV
cache when it changes it.

Start, once:

0. :func:`root_paths`     the ``roots`` paths of each prompt, slots ``[0, W)`` split evenly (:func:`split_slots`);
   :func:`prefill_roots`  each root's prompt prefilled on its row ``p W + lo``;
   :func:`reset_roots`    each root's environment ``make_env(p)`` reset on the example: the first observation;
   :func:`append_obs`     (stage 4) appends it.

A round, while a row is active:

1. :func:`decode_round`   up to ``chunk`` tokens per live row, one jitted call (a row is live when it is active and
                          its turn has room: ``room = min(turn_tokens - |turn|, max_tokens - |episode| - |turn|) >
                          0``); token ``t`` of the response on row ``r`` is drawn with ``token_keys(key, r, 0, t)``;
2. :func:`end_turns`      the tokens join each row's turn; a turn ends at the first token whose text ends with a stop
                          string (the tokens past it are dropped: pending token and position move back to it), at a
                          stop token, or at the caps; an ended turn joins the episode as a policy span;
3. :func:`step_envs`      ``env.step(turn text)`` for each ended turn, in row order (environments with a
                          ``step_batch`` classmethod stepped together: :func:`treejax.envs.base.step_all`): the
                          reward and info, then the
                          episode ends (``done``, ``max_turns``; ``max_tokens`` when the observation and one more
                          policy token would not fit) or its observation's tokens are returned;
4. :func:`append_obs`     the observations appended to their rows' KV in one chunk (width a power of two);
5. :func:`close_turns`    the turn of every row that goes on becomes a node (its policy tokens and observation);
6. :func:`fork_counts`    the paths that may fork (at most ``fork_turns`` turns made, >= 2 slots owned) and the fork
                          rule's child count for each, ``1..slots``, fixed before any child is drawn;
   :func:`fork`           each path's slots split among its children (:func:`split_slots`, the parent keeps the
                          first range); every other child takes the row of its range's first slot, a copy of the
                          parent's KV row (one gather, :func:`treejax.sampling.cache.fork_rows`), a deep copy of the
                          episode and a ``clone()`` of the environment.

A path that ends (:func:`finish_row`) writes its path and episode into every slot it owns: the slots of a path that
ended early are copies, each still one sample of the policy.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from treejax.envs.base import step_all, turn_ended
from treejax.sampling import decode
from treejax.sampling.cache import fork_rows
from treejax.sampling.strategies import Strategy
from treejax.sampling.turns.state import Decoded, Episode, ForkRequest, TurnContext, TurnNode, TurnRows, TurnTree


# ----------------------------------------------------------------------------------------------- device programs
@functools.partial(jax.jit, static_argnames=("model", "strategy", "stop_ids", "chunk"),
                   compiler_options=decode.SAMPLER_COMPILER_OPTIONS)
def _decode_chunk(params, cache, pending, position, live, room, t0, key, *, model: decode.ModelFns,
                  strategy: Strategy, stop_ids: tuple[int, ...], chunk: int):
    """Up to ``chunk`` tokens per live row (a row stops on a stop token or after ``room`` tokens). Returns
    ``(cache, pending, position, tokens [B, chunk], logp [B, chunk], count [B], stopped [B])``; ``t0 [B]``: the
    rows' response lengths (the draws' token index)."""
    B = pending.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)

    def body(i, s):
        cache, pending, position, live, toks, lps, n, stopped = s
        keys = decode.token_keys(key, rows, jnp.zeros_like(rows), t0 + n)
        tok, lp, _, _, cache = decode.decode_token(model, strategy, params, cache, pending, position, live, keys,
                                                   with_entropy=False)
        tok = jnp.where(live, tok, 0)
        toks = toks.at[:, i].set(tok)
        lps = lps.at[:, i].set(jnp.where(live, lp, 0.0))
        stop = live & decode.stop_mask(tok, stop_ids)
        n = n + live.astype(jnp.int32)
        pending = jnp.where(live, tok, pending)
        position = position + live.astype(jnp.int32)
        return cache, pending, position, live & ~stop & (n < room), toks, lps, n, stopped | stop

    init = (cache, pending, position, live, jnp.zeros((B, chunk), jnp.int32), jnp.zeros((B, chunk), jnp.float32),
            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool))
    cache, pending, position, _, toks, lps, n, stopped = lax.fori_loop(0, chunk, body, init)
    return cache, pending, position, toks, lps, n, stopped


@functools.partial(jax.jit, static_argnames=("model",))
def _append(params, cache, rows, pending, position, tokens, length, *, model):
    return decode.append_tokens(model, params, cache, rows, pending, position, tokens, length)


@jax.jit
def _fork(cache, src):
    return fork_rows(cache, src)


# ----------------------------------------------------------------------------------------------- host helpers
def split_slots(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in ``parts`` contiguous ranges, sizes differing by at most one (larger first)."""
    n = hi - lo
    sizes = [n // parts + (1 if k < n % parts else 0) for k in range(parts)]
    edges = np.concatenate([[0], np.cumsum(sizes)]) + lo
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def observation_ids(tokenizer, fmt, stop_ids: tuple, last_policy_token: int | None, text: str) -> list[int]:
    """Tokens of observation ``text`` formatted by ``fmt`` (None: as is). When the policy's turn ended on a stop
    token (``last_policy_token``, None when the last token is not the policy's) whose text the formatted observation
    starts with (a chat template's end-of-turn marker), that text is not appended twice. Also the expert episodes'
    rule (:mod:`treejax.sft_episodes`), so their rows are the sampler's."""
    full = (fmt(text) if fmt is not None else text) if text else ""
    if full and last_policy_token is not None and last_policy_token in stop_ids:
        marker = tokenizer.decode([last_policy_token], skip_special_tokens=False)
        if marker and full.startswith(marker):
            full = full[len(marker):]
    return tokenizer.encode(full) if full else []


def observation_tokens(ctx: TurnContext, ep: Episode, text: str) -> list[int] | None:
    """Tokens of observation ``text`` after episode ``ep`` (:func:`observation_ids` with ``ctx.fmt``), or None when
    they and one more policy token do not fit ``max_tokens`` (the episode ends)."""
    last = ep.tokens[-1] if ep.tokens and ep.policy_mask[-1] else None
    toks = observation_ids(ctx.tokenizer, ctx.fmt, ctx.stop_ids, last, text)
    if len(ep.tokens) + len(toks) + 1 > ctx.limits.max_tokens:  # room for at least one more policy token
        return None
    return toks


def close_node(ctx: TurnContext, rows: TurnRows, trees: list[TurnTree], b: int) -> int:
    """Ends row ``b``'s open node at its response length (a child of the path's last node, one deeper); returns
    the node id."""
    t, path, ep = trees[b // ctx.W], rows.path_B[b], rows.episode_B[b]
    parent = path[-1] if path else 0
    t.nodes.append(TurnNode(parent, len(path) + 1, int(rows.node_start_B[b]), len(ep.tokens)))
    path.append(len(t.nodes) - 1)
    rows.node_start_B[b] = len(ep.tokens)
    return path[-1]


def finish_row(ctx: TurnContext, rows: TurnRows, trees: list[TurnTree], b: int, status: str) -> None:
    """Row ``b``'s episode ends with ``status``: its open node is closed (if it holds tokens, or the path has no
    node yet) and every slot the row owns gets the path and the episode."""
    ep = rows.episode_B[b]
    ep.status, rows.active_B[b] = status, False
    if len(ep.tokens) > rows.node_start_B[b] or not rows.path_B[b]:
        close_node(ctx, rows, trees, b)
    t = trees[b // ctx.W]
    for s in range(*rows.slots_Bx2[b]):
        t.slot_path[s] = [0] + rows.path_B[b]
        t.slot_episode[s] = ep


# ----------------------------------------------------------------------------------------------- 0. start
def root_paths(ctx: TurnContext) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """The roots ``(p, lo, hi)`` (prompt, owned slots) in prompt order and their rows ``p W + lo``."""
    roots = [(p, lo, hi) for p in range(ctx.P) for lo, hi in split_slots(0, ctx.W, ctx.tree.roots)]
    return roots, np.array([p * ctx.W + lo for p, lo, _ in roots], np.int32)


def prefill_roots(ctx: TurnContext, root_rows: np.ndarray) -> tuple[object, TurnRows]:
    """A fresh cache of ``B`` rows with each root's prompt prefilled on its row; the rows, all inactive."""
    cache = ctx.model.init_cache(ctx.B, ctx.cache_length)
    root_p = root_rows // ctx.W
    cache, pend, pos = decode.prefill_prompts(ctx.model, ctx.params, cache,
                                              jnp.asarray(decode.pad_prompts(ctx.tokens_PxLp[root_p], ctx.bucket)),
                                              jnp.asarray(ctx.lengths_P[root_p]), jnp.asarray(root_rows))
    rows = TurnRows.empty(ctx.B)
    rows.pending_B[root_rows], rows.position_B[root_rows] = np.asarray(pend), np.asarray(pos)
    return cache, rows


def reset_roots(ctx: TurnContext, rows: TurnRows, roots: list, root_rows: np.ndarray) -> dict:
    """Each root row gets an episode and its environment (``make_env(p)``, reset on the example), owns its slots
    and is active; returns the first observations' tokens by row. Raises when one does not fit ``max_tokens``."""
    first = {}
    for (p, lo, hi), b in zip(roots, root_rows):
        rows.episode_B[b], rows.env_B[b], rows.slots_Bx2[b], rows.active_B[b] = (Episode(), ctx.make_env(p), (lo, hi),
                                                                                  True)
        t = time.perf_counter()
        text = rows.env_B[b].reset(ctx.examples[p])
        rows.episode_B[b].env_seconds += time.perf_counter() - t
        toks = observation_tokens(ctx, rows.episode_B[b], text)
        if toks is None:
            raise ValueError(f"run_turn_trees: the first observation of prompt {p} "
                             f"({len(ctx.tokenizer.encode(ctx.fmt(text)))} tokens) does not fit "
                             f"TurnLimits.max_tokens={ctx.limits.max_tokens}")
        first[b] = toks
    return first


# ----------------------------------------------------------------------------------------------- 1. decode
def decode_round(ctx: TurnContext, cache, rows: TurnRows) -> tuple[object, Decoded]:
    """Up to ``chunk`` tokens for every live row (module docstring); the cache and the round's host copies."""
    limits = ctx.limits
    room = np.zeros(ctx.B, np.int32)
    t0 = np.zeros(ctx.B, np.int32)
    for b in np.nonzero(rows.active_B)[0]:
        turn, ep = rows.turn_B[b], rows.episode_B[b]
        room[b] = min(limits.turn_tokens - len(turn), limits.max_tokens - len(ep.tokens) - len(turn))
        t0[b] = len(ep.tokens) + len(turn)
    live = rows.active_B & (room > 0)
    out = _decode_chunk(ctx.params, cache, jnp.asarray(rows.pending_B), jnp.asarray(rows.position_B),
                        jnp.asarray(live), jnp.asarray(room), jnp.asarray(t0), ctx.key, model=ctx.model,
                        strategy=ctx.strategy, stop_ids=ctx.stop_ids, chunk=limits.chunk)
    return out[0], Decoded(live, *(np.array(x) for x in out[1:]))


# ----------------------------------------------------------------------------------------------- 2. end turns
def stop_string_end(ctx: TurnContext, stop_strings, ids: list[int], before: int) -> int | None:
    """The length of the turn ``ids`` through its first token at index ``>= before`` (this round's) whose text ends
    with one of ``stop_strings``, or None. A text that ends with one at some token contains it, so one decode of
    the whole turn rules most rounds out."""
    whole = ctx.text(ids) if stop_strings else ""
    if any(s in whole for s in stop_strings):
        for k in range(before, len(ids)):
            if turn_ended(ctx.text(ids[:k + 1]), stop_strings):
                return k + 1
    return None


def extend_turn(ctx: TurnContext, rows: TurnRows, d: Decoded, b: int) -> tuple | None:
    """Row ``b``'s decoded tokens join its turn (cut after a stop string, the row's pending token and position
    moved back to the cut); when the turn ended it joins the episode as a policy span and its token ids are
    returned, else None."""
    turn, ep, n = rows.turn_B[b], rows.episode_B[b], d.count_B[b]
    before = len(turn)
    turn += list(zip(d.tokens_BxC[b, :n].tolist(), d.logp_BxC[b, :n].tolist()))
    rows.pending_B[b], rows.position_B[b] = d.pending_B[b], d.position_B[b]
    end = stop_string_end(ctx, rows.env_B[b].stop_strings, [t for t, _ in turn], before)
    if end is not None and end < len(turn):  # drop the tokens decoded past the stop string
        turn = rows.turn_B[b] = turn[:end]
        rows.pending_B[b] = turn[-1][0]
        rows.position_B[b] = rows.position_B[b] - (n - (end - before))
    capped = len(turn) >= ctx.limits.turn_tokens or len(ep.tokens) + len(turn) >= ctx.limits.max_tokens
    if end is None and not d.stopped_B[b] and not capped:
        return None
    ids, logps = zip(*turn) if turn else ((), ())
    ep._add(ids, logps, policy=True)
    rows.turn_B[b] = []
    return ids


def end_turns(ctx: TurnContext, rows: TurnRows, d: Decoded) -> dict:
    """:func:`extend_turn` for every live row, in row order; the token ids of the turns that ended, by row."""
    ended = {}
    for b in np.nonzero(d.live_B)[0]:
        ids = extend_turn(ctx, rows, d, b)
        if ids is not None:
            ended[b] = ids
    return ended


# ----------------------------------------------------------------------------------------------- 3. environments
def step_envs(ctx: TurnContext, rows: TurnRows, trees: list[TurnTree], ended: dict) -> dict:
    """``env.step`` on each ended turn's text, in row order: the step's reward and info join the episode, which then
    ends (:func:`finish_row`: ``"done"``, ``"max_turns"``, or ``"max_tokens"`` when the observation does not fit)
    or goes on; returns the observation tokens of the rows that go on (possibly empty), by row."""
    observations = {}
    order = list(ended)
    results, seconds = step_all([rows.env_B[b] for b in order], [ctx.text(ended[b]) for b in order])
    for b, result, dt in zip(order, results, seconds):
        ep = rows.episode_B[b]
        ep.env_seconds += dt
        ep.rewards.append(float(result.reward))
        ep.infos.append(dict(result.info))
        if result.done:
            finish_row(ctx, rows, trees, b, "done")
        elif ep.policy_turns >= ctx.limits.max_turns:
            finish_row(ctx, rows, trees, b, "max_turns")
        else:
            obs = observation_tokens(ctx, ep, result.observation)
            if obs is None:
                finish_row(ctx, rows, trees, b, "max_tokens")
            else:
                observations[b] = obs
    return observations


# ----------------------------------------------------------------------------------------------- 4. append
def append_obs(ctx: TurnContext, cache, rows: TurnRows, rows_obs: dict) -> object:
    """The non-empty observations appended over their rows' cached prefixes in one chunk
    (:func:`treejax.sampling.decode.append_tokens`); they join the episodes as environment spans.

    Few compiles: the chunk's width is the next power of two of the longest observation, and its row count the
    next power of two of the rows appending (at most ``B``), filled up with other rows of the cache given no
    tokens (``length = 0``: unchanged). Without the row bucket every new count of rows appending in a round was a
    new program: a task-chain run on an H200 kept compiling for 108 s after its first step."""
    rows_obs = {b: t for b, t in rows_obs.items() if t}
    if not rows_obs:
        return cache
    C = max(len(t) for t in rows_obs.values())
    C = 1 << (C - 1).bit_length()  # a few chunk widths
    real = np.array(sorted(rows_obs), np.int32)
    n = min(1 << (len(real) - 1).bit_length(), ctx.B)  # a few row counts
    idx = np.concatenate([real, np.setdiff1d(np.arange(ctx.B, dtype=np.int32), real)[:n - len(real)]])
    toks = np.zeros((n, C), np.int32)
    length = np.zeros(n, np.int32)
    for i, b in enumerate(real):
        toks[i, :len(rows_obs[b])] = rows_obs[b]
        length[i] = len(rows_obs[b])
    cache, new_pending, new_position = _append(ctx.params, cache, jnp.asarray(idx), jnp.asarray(rows.pending_B[idx]),
                                               jnp.asarray(rows.position_B[idx]), jnp.asarray(toks),
                                               jnp.asarray(length), model=ctx.model)
    k = len(real)
    rows.pending_B[real], rows.position_B[real] = np.asarray(new_pending)[:k], np.asarray(new_position)[:k]
    for b in real:
        rows.episode_B[b]._add(rows_obs[b], [], policy=False)
    return cache


# ----------------------------------------------------------------------------------------------- 5. nodes
def close_turns(ctx: TurnContext, rows: TurnRows, trees: list[TurnTree], going_on: list) -> None:
    """The turn of each row that goes on ends as a node, after its observation (:func:`close_node`)."""
    for b in going_on:
        close_node(ctx, rows, trees, b)


# ----------------------------------------------------------------------------------------------- 6. fork
def fork_counts(ctx: TurnContext, rows: TurnRows, going_on: list) -> list[tuple[int, int]]:
    """``(row, children)`` for each row that may fork (module docstring), from the fork rule; raises when the rule
    gives a count per request that is missing or outside ``1..slots``."""
    slots, eps = rows.slots_Bx2, rows.episode_B
    may = [b for b in going_on if eps[b].policy_turns <= ctx.tree.fork_turns and slots[b][1] - slots[b][0] >= 2]
    requests = [ForkRequest(b // ctx.W, eps[b], int(slots[b][1] - slots[b][0])) for b in may]
    counts = list(ctx.fork_rule(requests)) if may else []
    if len(counts) != len(may):
        raise ValueError(f"fork_rule gave {len(counts)} counts for {len(may)} requests")
    out = []
    for b, c in zip(may, counts):
        lo, hi = slots[b]
        c = int(c)
        if not 1 <= c <= hi - lo:
            raise ValueError(f"fork_rule gave {c} children for a row owning {hi - lo} slots (need 1..{hi - lo})")
        out.append((b, c))
    return out


def fork(ctx: TurnContext, cache, rows: TurnRows, trees: list[TurnTree], counts: list[tuple[int, int]]) -> object:
    """Each row ``b`` forks into its ``c`` children (module docstring): the rows copied on the host
    (:meth:`TurnRows.copy_row`) and the KV rows in one gather ``cache[src]`` (``src[r] = b`` for each new child's
    row ``r``, ``src[r] = r`` elsewhere; none when nothing forks)."""
    src = np.arange(ctx.B, dtype=np.int32)
    for b, c in counts:
        lo, hi = rows.slots_Bx2[b]
        parts = split_slots(int(lo), int(hi), c)
        rows.slots_Bx2[b] = parts[0]
        for a, z in parts[1:]:
            r = (b // ctx.W) * ctx.W + a
            src[r] = b
            rows.copy_row(b, r, (a, z))
            trees[b // ctx.W].forks += 1
    if np.any(src != np.arange(ctx.B)):
        cache = _fork(cache, jnp.asarray(src))
    return cache


__all__ = ["append_obs", "close_node", "close_turns", "decode_round", "end_turns", "extend_turn", "finish_row",
           "fork", "fork_counts", "observation_tokens", "prefill_roots", "reset_roots", "root_paths", "split_slots",
           "step_envs", "stop_string_end"]
