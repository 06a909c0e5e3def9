"""Multi-turn episodes with an environment, as independent conversations or as trees of turns: turns alternate
between the policy (sampled tokens, KV written as they are decoded) and the environment (observation tokens
appended to the same cache rows in one chunk over the cached prefix; never re-prefilled).

Per path (one cache row each, all rows at once):

1. the prompt is prefilled; ``env.reset(example)``'s text, if any, is appended as an observation;
2. the policy decodes in jitted chunks of ``chunk`` tokens (:func:`_decode_chunk`: stop tokens and the turn's
   token cap end a row inside the chunk); between chunks the host decodes each row's turn so far and looks for the
   environment's ``stop_strings``. A turn ends at the first token whose text ends with one (the tokens decoded
   after it in the same chunk are dropped: the row's pending token and position move back to it, and the slots
   past it are overwritten later, as the decode row protocol allows), at a stop token, or at ``turn_tokens``;
3. ``env.step(turn_text)`` gives the observation, the reward and ``done``; a non-final observation is formatted
   (``observation_format``: the text as is, or a chat turn of the model's template, :func:`chat_observation`),
   tokenized and appended (:func:`treejax.sampling.decode.append_tokens`);
4. an episode ends when the environment says ``done``, after ``max_turns`` policy turns (status ``"max_turns"``),
   or when the response capacity ``max_tokens`` (policy and observation tokens together) cannot hold the next
   observation or turn (``"max_tokens"``).

**Trees of turns** (:func:`run_turn_trees`, :class:`TurnTreeConfig`). A prompt has ``W`` leaf slots; ``roots``
episodes start from it, each owning a share of the slots. When a turn ends and the episode goes on, the turn (its
policy tokens and the observation appended after it) becomes a node; a path that owns ``n > 1`` slots and has
made at most ``fork_turns`` turns forks there into ``c <= n`` children: each new child gets a free cache row, a
copy of the parent's KV row (one gather, :func:`treejax.sampling.cache.fork_rows`: exact, nothing recomputed)
and a copy of the environment (``env.clone()``), and the slots are split among the children. A path that ends
owns its slots to the end: a slot is one sample of the policy (the child counts are fixed before the children are
drawn, and an ended subtree is never re-entered), so plain means over the ``W`` slots are unbiased (the
unbiased-tree rule of :mod:`treejax.forest`); a path that ended early holding ``n`` slots is stored ``n`` times.
:func:`turn_forest` makes the :class:`~treejax.forest.Forest` the learner reads: nodes as token spans,
``policy_mask`` 0 on observation tokens.

Each :class:`Episode` holds the response tokens after the prompt, ``policy_mask`` (True on sampled tokens: only
they may enter a loss), the policy's log-probs of the sampled tokens (0 elsewhere), the turn spans ``(start, end,
"policy" | "env")``, the rewards of the steps, and host counters. Randomness: token ``t`` of the response on cache
row ``r`` is drawn with ``decode.token_keys(key, r, 0, t)``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from treejax.envs.base import turn_ended
from treejax.sampling import attention as attention_lib
from treejax.sampling import decode
from treejax.sampling.cache import fork_rows
from treejax.sampling.strategies import Strategy


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """``max_turns`` policy turns per episode, ``turn_tokens`` sampled tokens per turn, ``max_tokens`` response
    tokens in all (the cache's response capacity), ``chunk`` tokens decoded between host checks."""

    max_turns: int = 4
    turn_tokens: int = 256
    max_tokens: int = 1024
    chunk: int = 16

    def __post_init__(self):
        if min(self.max_turns, self.turn_tokens, self.max_tokens, self.chunk) < 1:
            raise ValueError(f"TurnLimits: every limit must be >= 1, got {self}")


@dataclasses.dataclass
class Episode:
    """One conversation's response (module docstring)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    policy_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    infos: list[dict] = dataclasses.field(default_factory=list)
    status: str = "running"
    env_seconds: float = 0.0

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def policy_turns(self) -> int:
        return sum(1 for t in self.turns if t[2] == "policy")

    def _add(self, toks, logps, policy: bool) -> None:
        start = len(self.tokens)
        self.tokens += [int(t) for t in toks]
        self.logprobs += [float(x) for x in logps] if policy else [0.0] * len(toks)
        self.policy_mask += [policy] * len(toks)
        self.turns.append((start, len(self.tokens), "policy" if policy else "env"))


def chat_observation(tokenizer) -> Callable[[str], str]:
    """A formatter that wraps an observation as a user turn of ``tokenizer``'s chat template, ending with the
    assistant's opening, so the policy answers in a new turn. The template's text between an assistant message and
    the next user message's content is found by rendering a probe conversation; the assistant's end-of-turn marker
    is left out when the policy's turn already ended with it (its stop token)."""
    probe = [{"role": "user", "content": "\x00A"}, {"role": "assistant", "content": "\x00B"},
             {"role": "user", "content": "\x00C"}]
    text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    between = text[text.index("\x00B") + 2:]
    before, after = between.split("\x00C")
    return lambda obs: f"{before}{obs}{after}"


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


@dataclasses.dataclass(frozen=True)
class TurnTreeConfig:
    """The shape of a tree of turns (module docstring): ``num_slots`` W leaf slots per prompt, ``roots`` episodes
    started from the prompt, each owning ``W / roots`` slots (split as evenly as possible); at the end of each of
    a path's first ``fork_turns`` policy turns (when the episode goes on), a row owning ``n > 1`` slots forks into
    ``min(branch_factor, n)`` children (``fork_rule`` may choose fewer), its slots split evenly among them.
    ``roots = num_slots``: independent episodes."""

    num_slots: int = 1
    roots: int = 1
    branch_factor: int = 2
    fork_turns: int = 1

    def __post_init__(self):
        if not 1 <= self.roots <= self.num_slots:
            raise ValueError(f"TurnTreeConfig: need 1 <= roots <= num_slots, got {self}")
        if self.branch_factor < 1 or self.fork_turns < 0:
            raise ValueError(f"TurnTreeConfig: branch_factor >= 1 and fork_turns >= 0 required, got {self}")


@dataclasses.dataclass
class TurnNode:
    """A node of a turn tree: response tokens ``[start, end)`` of the paths through it (its policy turn and the
    observation appended after it; the first node of a path also holds the reset observation before its turn),
    its ``parent`` node and ``depth`` (the root, node 0, is the prompt: depth 0, no tokens)."""

    parent: int
    depth: int
    start: int
    end: int


@dataclasses.dataclass
class TurnTree:
    """One prompt's tree of turns: ``nodes`` (node 0 the root), and per leaf slot its ``slot_path`` (node ids from
    the root to its last node) and ``slot_episode`` (the :class:`Episode` of that path: its tokens, masks,
    log-probs, rewards, status; the slots of one path share the object). Node ``n`` at depth ``d`` holds the
    episode's ``d``-th policy turn: its reward is ``slot_episode[s].rewards[d - 1]`` on any slot through it."""

    nodes: list[TurnNode]
    slot_path: list[list[int]]
    slot_episode: list[Episode]
    forks: int = 0


@dataclasses.dataclass(frozen=True)
class ForkRequest:
    """A path that may fork at a turn boundary: its ``prompt`` index, its :class:`Episode` so far (the conversation
    through the observation just appended) and the number of leaf ``slots`` it owns (>= 2)."""

    prompt: int
    episode: Episode
    slots: int


@jax.jit
def _fork(cache, src):
    return fork_rows(cache, src)


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in ``parts`` contiguous ranges, sizes differing by at most one (larger first)."""
    n = hi - lo
    sizes = [n // parts + (1 if k < n % parts else 0) for k in range(parts)]
    edges = np.concatenate([[0], np.cumsum(sizes)]) + lo
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def run_turn_trees(params, model: decode.ModelFns, tokenizer, make_env: Callable[[int], object], examples: list,
                   prompts, prompt_lengths, key: jax.Array, strategy: Strategy, limits: TurnLimits = TurnLimits(),
                   tree: TurnTreeConfig = TurnTreeConfig(), stop_ids: tuple[int, ...] = (),
                   observation_format: Callable[[str], str] | None = None,
                   fork_rule: Callable[[list[ForkRequest]], list[int]] | None = None) -> list[TurnTree]:
    """Runs a tree of turns per prompt (module docstring): ``examples[p]`` after prompt ``prompts[p,
    :prompt_lengths[p]]``, ``tree.roots`` episodes each with its own environment ``make_env(p)`` (reset on the
    example), forks at turn boundaries that copy the KV row (:func:`treejax.sampling.cache.fork_rows`) and the
    environment (``env.clone()``). ``model``: sampler fns with ``extend``; ``tokenizer``: ``encode`` / ``decode``;
    ``observation_format``: observation text -> appended text (default: as is). ``fork_rule(requests)``: for the
    paths that may fork at this round's turn boundaries (one :class:`ForkRequest` each: prompt, path so far,
    slots owned), the number of children of each, ``1..slots`` (default ``min(branch_factor, slots)``). It sees
    only the paths so far, so the child counts are fixed before the children are drawn: each leaf slot stays one
    sample of the policy, weight 1 (e.g. :class:`treejax.rl.trace.TraceRule` ranks the prefixes by predicted
    success).

    Cache rows: prompt ``p``'s slots are rows ``p W .. p W + W - 1``; a path owning slots ``[lo, hi)`` decodes on
    row ``p W + lo``. Token ``t`` of the response on row ``r`` is drawn with ``decode.token_keys(key, r, 0, t)``,
    so ``roots = W`` (independent episodes) draws exactly what one-row-per-episode decoding draws."""
    tokens, lens = decode.validate_prompts(prompts, prompt_lengths)
    P, W = tokens.shape[0], tree.num_slots
    if len(examples) != P:
        raise ValueError(f"run_turn_trees: {P} prompts and {len(examples)} examples")
    if model.extend is None:
        raise ValueError(f"ModelFns {model.name!r} cannot append observations (no extend)")
    fmt = observation_format or (lambda text: text)
    B = P * W
    bucket = decode.bucket_length(tokens.shape[1])
    L = attention_lib.round_cache_length(bucket + limits.max_tokens, model.cache_multiple)
    pp = model.prepare(params)
    cache = model.init_cache(B, L)
    roots = [(p, lo, hi) for p in range(P) for lo, hi in _split(0, W, tree.roots)]
    root_rows = np.array([p * W + lo for p, lo, _ in roots], np.int32)
    root_p = np.array([p for p, _, _ in roots])
    cache, pend, pos = decode.prefill_prompts(model, pp, cache, jnp.asarray(decode.pad_prompts(tokens[root_p], bucket)),
                                              jnp.asarray(lens[root_p]), jnp.asarray(root_rows))
    pending, position = np.zeros(B, np.int32), np.zeros(B, np.int32)
    pending[root_rows], position[root_rows] = np.asarray(pend), np.asarray(pos)
    eps: list[Episode | None] = [None] * B
    envs: list = [None] * B
    slots = np.zeros((B, 2), np.int64)
    path: list[list[int]] = [[] for _ in range(B)]
    node_start = np.zeros(B, np.int64)
    turn: list[list] = [[] for _ in range(B)]
    active = np.zeros(B, bool)
    trees = [TurnTree([TurnNode(-1, 0, 0, 0)], [[] for _ in range(W)], [None] * W) for _ in range(P)]
    n_fork = fork_rule or (lambda reqs: [min(tree.branch_factor, r.slots) for r in reqs])

    def text_of(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def observe(b: int, text: str) -> list[int] | None:
        """Tokens of observation ``text`` for row ``b``, or None when they do not fit (the episode ends). When the
        policy's turn ended on a stop token whose text the formatted observation starts with (a chat template's
        end-of-turn marker), that text is not appended twice."""
        ep = eps[b]
        full = fmt(text) if text else ""
        last = ep.tokens[-1] if ep.tokens and ep.policy_mask[-1] else None
        if full and last is not None and last in stop_ids:
            marker = tokenizer.decode([last], skip_special_tokens=False)
            if marker and full.startswith(marker):
                full = full[len(marker):]
        toks = tokenizer.encode(full) if full else []
        if len(ep.tokens) + len(toks) + 1 > limits.max_tokens:  # room for at least one more policy token
            return None
        return toks

    def append(rows_obs: dict[int, list[int]]) -> None:
        nonlocal cache
        rows_obs = {b: t for b, t in rows_obs.items() if t}
        if not rows_obs:
            return
        C = max(len(t) for t in rows_obs.values())
        C = 1 << (C - 1).bit_length()  # a few chunk widths: few compiles
        rows = np.array(sorted(rows_obs), np.int32)
        toks = np.zeros((len(rows), C), np.int32)
        for i, b in enumerate(rows):
            toks[i, :len(rows_obs[b])] = rows_obs[b]
        length = np.array([len(rows_obs[b]) for b in rows], np.int32)
        cache, new_pending, new_position = _append(pp, cache, jnp.asarray(rows), jnp.asarray(pending[rows]),
                                                   jnp.asarray(position[rows]), jnp.asarray(toks),
                                                   jnp.asarray(length), model=model)
        pending[rows], position[rows] = np.asarray(new_pending), np.asarray(new_position)
        for b in rows:
            eps[b]._add(rows_obs[b], [], policy=False)

    def close(b: int) -> int:
        """Ends row ``b``'s current node at its response length; returns the node id."""
        t = trees[b // W]
        parent = path[b][-1] if path[b] else 0
        t.nodes.append(TurnNode(parent, len(path[b]) + 1, int(node_start[b]), len(eps[b].tokens)))
        path[b].append(len(t.nodes) - 1)
        node_start[b] = len(eps[b].tokens)
        return path[b][-1]

    def finish(b: int, status: str) -> None:
        eps[b].status, active[b] = status, False
        if len(eps[b].tokens) > node_start[b] or not path[b]:
            close(b)
        t = trees[b // W]
        for s in range(*slots[b]):
            t.slot_path[s] = [0] + path[b]
            t.slot_episode[s] = eps[b]

    first = {}
    for (p, lo, hi), b in zip(roots, root_rows):
        eps[b], envs[b], slots[b], active[b] = Episode(), make_env(p), (lo, hi), True
        t = time.perf_counter()
        text = envs[b].reset(examples[p])
        eps[b].env_seconds += time.perf_counter() - t
        toks = observe(b, text)
        if toks is None:
            raise ValueError(f"run_turn_trees: the first observation of prompt {p} ({len(tokenizer.encode(fmt(text)))}"
                             f" tokens) does not fit TurnLimits.max_tokens={limits.max_tokens}")
        first[b] = toks
    append(first)
    while active.any():
        room = np.zeros(B, np.int32)
        t0 = np.zeros(B, np.int32)
        for b in np.nonzero(active)[0]:
            room[b] = min(limits.turn_tokens - len(turn[b]), limits.max_tokens - len(eps[b].tokens) - len(turn[b]))
            t0[b] = len(eps[b].tokens) + len(turn[b])
        live = active & (room > 0)
        out = _decode_chunk(pp, cache, jnp.asarray(pending), jnp.asarray(position), jnp.asarray(live),
                            jnp.asarray(room), jnp.asarray(t0), key, model=model, strategy=strategy,
                            stop_ids=tuple(stop_ids), chunk=limits.chunk)
        cache = out[0]
        new_pending, new_position, toks, lps, n, stopped = (np.array(x) for x in out[1:])
        observations, going_on = {}, []
        for b in np.nonzero(live)[0]:
            before = len(turn[b])
            turn[b] += list(zip(toks[b, :n[b]].tolist(), lps[b, :n[b]].tolist()))
            pending[b], position[b] = new_pending[b], new_position[b]
            end = None
            ids = [t for t, _ in turn[b]]
            # the first token of this chunk whose turn text ends with a stop string; a text that ends with one at
            # some token contains it, so one decode of the whole turn rules most chunks out
            whole = text_of(ids) if envs[b].stop_strings else ""
            if any(s in whole for s in envs[b].stop_strings):
                for k in range(before, len(turn[b])):
                    if turn_ended(text_of(ids[:k + 1]), envs[b].stop_strings):
                        end = k + 1
                        break
            if end is not None and end < len(turn[b]):  # drop the tokens decoded past the stop string
                turn[b] = turn[b][:end]
                pending[b] = turn[b][-1][0]
                position[b] = position[b] - (n[b] - (end - before))
            capped = len(turn[b]) >= limits.turn_tokens or len(eps[b].tokens) + len(turn[b]) >= limits.max_tokens
            if end is None and not stopped[b] and not capped:
                continue
            ids, logps = zip(*turn[b]) if turn[b] else ((), ())
            eps[b]._add(ids, logps, policy=True)
            turn[b] = []
            t = time.perf_counter()
            result = envs[b].step(text_of(ids))
            eps[b].env_seconds += time.perf_counter() - t
            eps[b].rewards.append(float(result.reward))
            eps[b].infos.append(dict(result.info))
            if result.done:
                finish(b, "done")
            elif eps[b].policy_turns >= limits.max_turns:
                finish(b, "max_turns")
            else:
                obs = observe(b, result.observation)
                if obs is None:
                    finish(b, "max_tokens")
                else:
                    observations[b] = obs
                    going_on.append(b)
        append(observations)
        src = np.arange(B, dtype=np.int32)
        for b in going_on:  # the turn's node ends after its observation
            close(b)
        may = [b for b in going_on if eps[b].policy_turns <= tree.fork_turns and slots[b][1] - slots[b][0] >= 2]
        counts = list(n_fork([ForkRequest(b // W, eps[b], int(slots[b][1] - slots[b][0])) for b in may])) if may else []
        if len(counts) != len(may):
            raise ValueError(f"fork_rule gave {len(counts)} counts for {len(may)} requests")
        for b, c in zip(may, counts):  # forks copy the row and the environment
            lo, hi = slots[b]
            c = int(c)
            if not 1 <= c <= hi - lo:
                raise ValueError(f"fork_rule gave {c} children for a row owning {hi - lo} slots (need 1..{hi - lo})")
            parts = _split(int(lo), int(hi), c)
            slots[b] = parts[0]
            for a, z in parts[1:]:
                r = (b // W) * W + a
                src[r] = b
                pending[r], position[r], active[r], slots[r] = pending[b], position[b], True, (a, z)
                eps[r] = copy.deepcopy(eps[b])
                envs[r] = envs[b].clone()
                path[r], node_start[r], turn[r] = list(path[b]), node_start[b], []
                trees[b // W].forks += 1
        if np.any(src != np.arange(B)):
            cache = _fork(cache, jnp.asarray(src))
    return trees


def turn_forest(trees: list[TurnTree], max_length: int, status_of: Callable[[Episode], int] | None = None,
                max_depth: int | None = None, num_nodes: int | None = None):
    """The :class:`~treejax.forest.Forest` of turn trees (nodes as token spans, :func:`treejax.forest.
    forest_from_spans`): ``P = len(trees)`` prompts, ``W`` slots each, ``T = max_length`` response tokens, ``D`` =
    the deepest path, ``N`` = the most nodes; ``policy_mask`` (and so ``loss_mask``) 0 on observation tokens;
    ``leaf_weight`` 1 for every slot (each slot is one sample of the policy: the paths' child counts are fixed
    before the children are drawn and no subtree is re-entered). ``status_of(episode)``: a leaf's
    :class:`~treejax.forest.NodeStatus` code (default: EOS when the environment said done, else TRUNCATED).
    ``max_depth`` / ``num_nodes``: static capacities to pad ``D`` / ``N`` to (a trainer passes the limits'
    ``max_turns`` and ``1 + W max_turns`` so the shapes, and so the compiled update, do not change between steps)."""
    from treejax.forest import NodeStatus, forest_from_spans

    P, W = len(trees), len(trees[0].slot_path)
    D = max(len(sp) for t in trees for sp in t.slot_path) - 1
    N = max(len(t.nodes) for t in trees)
    if (max_depth is not None and D > max_depth) or (num_nodes is not None and N > num_nodes):
        raise ValueError(f"turn_forest: the trees hold depth {D} and {N} nodes, over the capacities "
                         f"max_depth={max_depth}, num_nodes={num_nodes}")
    D, N = max_depth or D, num_nodes or N
    path = np.full((P, W, D + 1), -1, np.int32)
    node_length = np.zeros((P, N), np.int32)
    tokens = np.zeros((P, W, max_length), np.int32)
    logp = np.zeros((P, W, max_length), np.float32)
    policy = np.zeros((P, W, max_length), np.float32)
    status = np.zeros((P, W), np.int32)
    status_of = status_of or (lambda ep: int(NodeStatus.EOS if ep.status == "done" else NodeStatus.TRUNCATED))
    for p, t in enumerate(trees):
        for n, node in enumerate(t.nodes):
            node_length[p, n] = node.end - node.start
        for w, (sp, ep) in enumerate(zip(t.slot_path, t.slot_episode)):
            if ep is None or len(sp) < 2:
                raise ValueError(f"turn_forest: slot {w} of prompt {p} holds no episode")
            k = len(ep.tokens)
            if k > max_length:
                raise ValueError(f"turn_forest: an episode of {k} tokens exceeds max_length={max_length}")
            path[p, w, :len(sp)] = sp
            tokens[p, w, :k], logp[p, w, :k], policy[p, w, :k] = ep.tokens, ep.logprobs, ep.policy_mask
            status[p, w] = status_of(ep)
    return forest_from_spans(path, node_length, tokens, logp, policy, status, max_length,
                             leaf_weight=np.ones((P, W), np.float32))


def run_episodes(params, model: decode.ModelFns, tokenizer, envs: list, examples: list, prompts, prompt_lengths,
                 key: jax.Array, strategy: Strategy, limits: TurnLimits = TurnLimits(),
                 stop_ids: tuple[int, ...] = (), observation_format: Callable[[str], str] | None = None
                 ) -> list[Episode]:
    """Runs one independent episode per row (module docstring): ``envs[b]`` (an
    :class:`~treejax.envs.base.Environment`) on ``examples[b]`` after prompt ``prompts[b, :prompt_lengths[b]]``
    (:func:`run_turn_trees` with one slot per prompt). Returns the :class:`Episode` of each row."""
    tokens, _ = decode.validate_prompts(prompts, prompt_lengths)
    if not (len(envs) == len(examples) == tokens.shape[0]):
        raise ValueError(f"run_episodes: {tokens.shape[0]} prompts, {len(envs)} environments and {len(examples)} "
                         "examples")
    trees = run_turn_trees(params, model, tokenizer, lambda b: envs[b], examples, prompts, prompt_lengths, key,
                           strategy, limits, TurnTreeConfig(), stop_ids, observation_format)
    return [t.slot_episode[0] for t in trees]


__all__ = ["Episode", "ForkRequest", "TurnLimits", "TurnNode", "TurnTree", "TurnTreeConfig", "chat_observation", "run_episodes",
           "run_turn_trees", "turn_forest"]
