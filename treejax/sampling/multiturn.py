"""Multi-turn episodes with an environment (issue 26, first part): independent conversations whose turns
alternate between the policy (sampled tokens, KV written as they are decoded) and the environment (observation
tokens appended to the same cache rows in one chunk over the cached prefix; never re-prefilled).

Per episode (one cache row each, ``B`` at once):

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

Each :class:`Episode` holds the response tokens after the prompt, ``policy_mask`` (True on sampled tokens: only
they may enter a loss), the policy's log-probs of the sampled tokens (0 elsewhere), the turn spans ``(start, end,
"policy" | "env")``, the rewards of the steps, and host counters. Randomness: token ``t`` of the response of row
``r`` is drawn with ``decode.token_keys(key, r, 0, t)``.

Not here yet: branching at turn boundaries (a tree of turns, forking the environment with ``clone()`` and the KV
with a cache-row copy) and the turn forest the learner reads.
"""

from __future__ import annotations

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


def run_episodes(params, model: decode.ModelFns, tokenizer, envs: list, examples: list, prompts, prompt_lengths,
                 key: jax.Array, strategy: Strategy, limits: TurnLimits = TurnLimits(),
                 stop_ids: tuple[int, ...] = (), observation_format: Callable[[str], str] | None = None
                 ) -> list[Episode]:
    """Runs one episode per row (module docstring): ``envs[b]`` (an :class:`~treejax.envs.base.Environment`) on
    ``examples[b]`` after prompt ``prompts[b, :prompt_lengths[b]]``. ``model``: sampler fns with ``extend``;
    ``tokenizer``: ``encode`` / ``decode``; ``observation_format``: observation text -> appended text (default:
    as is). Returns the :class:`Episode` of each row."""
    tokens, lens = decode.validate_prompts(prompts, prompt_lengths)
    B = tokens.shape[0]
    if not (len(envs) == len(examples) == B):
        raise ValueError(f"run_episodes: {B} prompts, {len(envs)} environments and {len(examples)} examples")
    if model.extend is None:
        raise ValueError(f"ModelFns {model.name!r} cannot append observations (no extend)")
    fmt = observation_format or (lambda text: text)
    bucket = decode.bucket_length(tokens.shape[1])
    L = attention_lib.round_cache_length(bucket + limits.max_tokens, model.cache_multiple)
    p = model.prepare(params)
    cache = model.init_cache(B, L)
    cache, pending, position = decode.prefill_prompts(model, p, cache, jnp.asarray(decode.pad_prompts(tokens, bucket)),
                                                      jnp.asarray(lens), jnp.arange(B, dtype=jnp.int32))
    pending, position = np.array(pending), np.array(position)  # host copies, updated in place
    eps = [Episode() for _ in range(B)]
    turn = [[] for _ in range(B)]  # the current policy turn: (token, logp)
    active = np.ones(B, bool)

    def text_of(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def observe(b: int, text: str) -> list[int] | None:
        """Tokens of observation ``text`` for row ``b``, or None when they do not fit (the episode ends). When the
        policy's turn ended on a stop token whose text the formatted observation starts with (a chat template's
        end-of-turn marker), that text is not appended twice."""
        full = fmt(text) if text else ""
        last = eps[b].tokens[-1] if eps[b].tokens and eps[b].policy_mask[-1] else None
        if full and last is not None and last in stop_ids:
            marker = tokenizer.decode([last], skip_special_tokens=False)
            if marker and full.startswith(marker):
                full = full[len(marker):]
        toks = tokenizer.encode(full) if full else []
        if len(eps[b].tokens) + len(toks) + 1 > limits.max_tokens:  # room for at least one more policy token
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
        cache, new_pending, new_position = _append(p, cache, jnp.asarray(rows), jnp.asarray(pending[rows]),
                                                   jnp.asarray(position[rows]), jnp.asarray(toks),
                                                   jnp.asarray(length), model=model)
        pending[rows], position[rows] = np.asarray(new_pending), np.asarray(new_position)
        for b in rows:
            eps[b]._add(rows_obs[b], [], policy=False)

    first = {}
    for b in range(B):
        t = time.perf_counter()
        text = envs[b].reset(examples[b])
        eps[b].env_seconds += time.perf_counter() - t
        toks = observe(b, text)
        if toks is None:
            eps[b].status, active[b] = "max_tokens", False
        else:
            first[b] = toks
    append(first)
    while active.any():
        room = np.array([min(limits.turn_tokens - len(turn[b]), limits.max_tokens - len(eps[b].tokens) - len(turn[b]))
                         for b in range(B)], np.int32)
        t0 = np.array([len(eps[b].tokens) + len(turn[b]) for b in range(B)], np.int32)
        live = active & (room > 0)
        out = _decode_chunk(p, cache, jnp.asarray(pending), jnp.asarray(position), jnp.asarray(live),
                            jnp.asarray(room), jnp.asarray(t0), key, model=model, strategy=strategy,
                            stop_ids=tuple(stop_ids), chunk=limits.chunk)
        cache = out[0]
        new_pending, new_position, toks, lps, n, stopped = (np.array(x) for x in out[1:])
        observations = {}
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
                eps[b].status, active[b] = "done", False
            elif eps[b].policy_turns >= limits.max_turns:
                eps[b].status, active[b] = "max_turns", False
            else:
                obs = observe(b, result.observation)
                if obs is None:
                    eps[b].status, active[b] = "max_tokens", False
                else:
                    observations[b] = obs
        append(observations)
    return eps


__all__ = ["Episode", "TurnLimits", "chat_observation", "run_episodes"]
