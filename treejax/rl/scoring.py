"""Decode, then score: response texts from token arrays, the task's verifier scores, and the shaped rewards.

The one place where token ids become text for a verifier (the rollout source's leaves, ReMax's greedy answers and
the held-out evaluation all go through :func:`decode_texts`):

    text[i]    = tokenizer.decode(tokens[i, :length[i]], skip_special_tokens=True)
    score[i]   = task.score(text[i], example[i])                       in [0, 1], correct iff >= 1
    reward[i]  = verifier_reward(score[i] >= 1, style) + overlong_penalty(length[i])    (DAPO, when buffer > 0)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.parallel import multihost
from treejax.rl import rewards as rewards_lib


def decode_texts(tokenizer, tokens_NxT: np.ndarray, lengths_N: np.ndarray) -> list:
    """Texts of host token rows cut at their lengths; any leading shape (``[P, W, T]`` gives ``[P][W]`` lists)."""
    tokens, lengths = np.asarray(tokens_NxT), np.asarray(lengths_N)
    if tokens.ndim > 2:
        return [decode_texts(tokenizer, t, n) for t, n in zip(tokens, lengths)]
    return [tokenizer.decode(tokens[i, : lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(tokens))]


def leaf_texts(tokenizer, forest: Forest) -> list[list[str]]:
    """Every leaf's response text (the forest's tokens are all-gathered in a multi-process run: call it on every
    process)."""
    return decode_texts(tokenizer, *multihost.host_tree((forest.tokens, forest.leaf_length)))


def score_texts(task, examples, texts_PxW: list[list[str]]) -> np.ndarray:
    """[P, W] verifier scores in [0, 1] of response texts (row ``p`` answers ``examples[p]``)."""
    return np.array([[task.score(t, ex) for t in row] for row, ex in zip(texts_PxW, examples)], np.float32)


def score_forest(tokenizer, task, examples, forest: Forest) -> np.ndarray:
    """[P, W] verifier scores in [0, 1] of every leaf's decoded text."""
    return score_texts(task, examples, leaf_texts(tokenizer, forest))


def answer_steps(tokenizer, task, examples, tokens_PxWxT, lengths_PxW, scores_PxW) -> np.ndarray:
    """int32 ``[P, W]``: for each correct leaf (score >= 1) the first response position ``e`` at which the
    prefix ``tokens[:e]`` already states the correct answer (``task.answer_reached``), checked at every line
    break (after each token whose text holds a newline) and at the leaf's end; -1 for wrong leaves. When only the
    whole response passes, ``e = length`` (no redundant tokens). DECS's necessary-reasoning prefix
    (:mod:`treejax.rl.advantages.decs`)."""
    tokens, lengths, scores = np.asarray(tokens_PxWxT), np.asarray(lengths_PxW), np.asarray(scores_PxW)
    out = np.full(scores.shape, -1, np.int32)
    for p, w in zip(*np.nonzero(scores >= 1.0)):
        n = int(lengths[p, w])
        ids = tokens[p, w, :n].tolist()
        breaks = [i + 1 for i in range(n - 1) if "\n" in tokenizer.decode([ids[i]])]
        out[p, w] = n
        for e in breaks:
            if task.answer_reached(tokenizer.decode(ids[:e], skip_special_tokens=True), examples[p]):
                out[p, w] = e
                break
    return out


def continuation_rewards(tokenizer, task, examples, tokens_PxWxT, cont, reward_fn) -> np.ndarray:
    """float32 ``[P, W, B]``: the mean reward of each cut's ``K`` continuations (SPO-chain's ``V(s)``,
    :mod:`treejax.rl.advantages.spo_chain`), 0 where there is no cut. ``cont``: host
    :class:`~treejax.sampling.continuation.Continuations`; continuation ``k`` of cut ``s`` of leaf ``(p, w)`` is
    scored as the whole response ``tokens[p, w, :s]`` + its own tokens, against ``examples[p]``;
    ``reward_fn(scores, lengths)`` shapes the scores (the leaves' own rewards, with the whole responses'
    lengths)."""
    cut, toks, lens = np.asarray(cont.cut_PxWxB), np.asarray(cont.tokens_PxWxBxKxT), np.asarray(cont.length_PxWxBxK)
    tokens = np.asarray(tokens_PxWxT)
    K = toks.shape[3]
    where = np.argwhere(cut >= 0)
    texts, total, owner = [], [], []
    for p, w, b in where:
        s = int(cut[p, w, b])
        for k in range(K):
            n = int(lens[p, w, b, k])
            ids = tokens[p, w, :s].tolist() + toks[p, w, b, k, :n].tolist()
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            total.append(s + n)
            owner.append(p)
    scores = np.array([task.score(t, examples[p]) for t, p in zip(texts, owner)], np.float32)
    values = np.zeros(cut.shape, np.float32)
    if len(where):
        r = np.asarray(reward_fn(scores, np.array(total, np.int32)), np.float32).reshape(len(where), K)
        values[tuple(where.T)] = r.mean(axis=1)
    return values


def shaped_rewards(scores: np.ndarray, lengths: np.ndarray, style: str, max_length: int, overlong_buffer: int = 0,
                   overlong_factor: float = 1.0) -> np.ndarray:
    """Verifier reward (``style``: ``"pm1"`` or ``"01"``) of scores in [0, 1] plus DAPO's overlong penalty on the
    response lengths when ``overlong_buffer > 0`` (any matching shapes: ``[P, W]`` leaves, ``[P]`` greedy answers)."""
    r = rewards_lib.verifier_reward(jnp.asarray(scores >= 1.0), style)
    if overlong_buffer > 0:
        r = r + rewards_lib.overlong_penalty(jnp.asarray(lengths), max_length, overlong_buffer, overlong_factor)
    return np.asarray(r)


def reward_range(style: str, overlong_buffer: int = 0, overlong_factor: float = 1.0) -> tuple[float, float]:
    """The possible reward range (verifier reward plus the overlong penalty): a fixed colour scale for pictures."""
    lo, hi = (-1.0, 1.0) if style == "pm1" else (0.0, 1.0)
    return (lo - (overlong_factor if overlong_buffer > 0 else 0.0), hi)


__all__ = ["decode_texts", "leaf_texts", "score_texts", "score_forest", "answer_steps", "continuation_rewards",
           "shaped_rewards",
           "reward_range"]
