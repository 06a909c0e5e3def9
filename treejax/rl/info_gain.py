"""Teacher-forced scoring passes over a turn forest: IGPO's ``pi(a | q, o_<=t)`` for every node, and InfoPO's
counterfactual feedback gain (:func:`feedback_gains`: each turn's shift when its parent turn's observation is masked).

IGPO (Wang et al. 2025, "Information Gain-based Policy Optimization", arXiv 2510.14967) and A2TGPO (Chen et al.
2026, arXiv 2605.06200) reward a turn by how much it moved the policy's belief in the ground-truth answer ``a``.
After each turn ``t`` the answer's tokens are scored by the policy, teacher-forced after the conversation so far::

    log pi(a | q, o_<=t) = (1 / L) sum_{j in scored} log pi(a_j | q, o_<=t, a_<j)       (L = number of scored tokens)

(length-normalised; ``pi(a | ...) = exp`` of it is IGPO's "probability of the ground truth"). In a turn forest
(:func:`treejax.forest.forest_from_spans`) a node ``n`` at depth ``d >= 1`` is one turn (policy tokens, then the
environment's observation tokens), so ``o_<=t`` for the turn of node ``n`` is the response through the end of
``n``'s span, observation included (the official code scores after the tool's reply has been appended, at the
start of the next turn); the root (node 0) is the prompt alone (IGPO's turn-0 baseline ``pi(a | q)``).

:func:`truth_logprobs` builds one sequence per node slot of every prompt::

    row (p, n) = prompt_p[:len_p] ++ response tokens [0, end(n)) of a leaf through n ++ answer_p[:alen_p]

right-padded to the static width ``Lp + T + La`` (``end(n) = start + length`` of :meth:`Forest.spans`; the root's
is 0), runs ``logprob_fn`` over the rows (optionally in chunks of ``rows_per_call`` under ``lax.map``) and averages
the log-probs of the scored answer positions. The result ``truth_logp_PxN [P, N]`` is what the ``igpo`` and
``a2tgpo`` estimators read (``Rollouts.estimator_inputs["truth_logp_PxN"]``); node slots on no leaf's path get 0.

``logprob_fn(params, tokens_BxL, positions_BxL, segment_ids_BxL) -> logp_BxL`` is the learner's sequence forward
(``logp[b, i] = log pi(tokens[b, i] | tokens[b, :i])``, :func:`treejax.rl.layouts.sequence_logprobs` with the model
config bound; :func:`make_truth_scorer` builds it). Every prompt needs ``len_p >= 1`` (the first answer token is
predicted from the prompt's last token).

The answer tokens: the text the task's verifier would accept, tokenized the way the policy would write it, with
``answer_scored`` marking which of them are averaged (IGPO's official code wraps the ground truth in a fixed
prefix/suffix, ``"...</think>\\n<answer>\\n" + gt + "\\n</answer>"``, and averages only the tokens of ``gt``).
:func:`answer_tokens` builds ``(answer_PxLa, answer_lengths_P, answer_scored_PxLa)`` from texts on the host.

Cost: ``P * N`` rows of ``Lp + T + La`` tokens (one full forward per node slot, unused slots included, since the
shapes are static); a packed tree forward (each node's tokens once, :mod:`treejax.rl.packing`) would share the
prefixes and is the natural next step when this pass matters for speed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from treejax.forest import Forest


@struct.dataclass
class TruthBatch:
    """The scoring rows of :func:`truth_sequences`, ``B = P * N`` rows of width ``L = Lp + T + La``.

    ``tokens`` / ``positions`` / ``segment_ids`` (1 on real tokens, 0 on padding) as the sequence forward takes
    them; ``scored [B, L]`` 1.0 on the answer positions whose log-probs are averaged; ``used [P, N]`` node slots on
    some leaf's path (and the root of a prompt with a used leaf)."""

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    scored: jax.Array
    used: jax.Array


def node_ends(forest: Forest) -> jax.Array:
    """int32[P, N]: the end of each node's span in the response (``start + length``; 0 for the root and unused)."""
    span = forest.spans()
    return (span[..., 0] + span[..., 1]).astype(jnp.int32)


def node_leaves(forest: Forest) -> tuple[jax.Array, jax.Array]:
    """``(rep [P, N] int32, used [P, N] bool)``: the first leaf slot whose path holds node ``n`` (0 if none) and
    whether any does (the root counts as used when some leaf slot is)."""
    P, N = forest.node_parent.shape
    path = forest.leaf_path  # [P, W, D+1]
    has = jnp.any(path[:, :, :, None] == jnp.arange(N)[None, None, None, :], axis=2)  # [P, W, N]
    has = has & (path[:, :, :1] >= 0)
    return jnp.argmax(has, axis=1).astype(jnp.int32), jnp.any(has, axis=1)


def truth_sequences(prompts_PxLp: jax.Array, prompt_lengths_P: jax.Array, forest: Forest, answer_PxLa: jax.Array,
                    answer_lengths_P: jax.Array, answer_scored_PxLa: jax.Array | None = None,
                    pad_id: int = 0) -> TruthBatch:
    """The rows ``prompt ++ response through node n ++ answer`` of every (prompt, node slot), row ``p * N + n``
    (module docstring). ``answer_scored_PxLa`` (default: every answer token) selects the averaged positions."""
    prompts = jnp.asarray(prompts_PxLp, jnp.int32)
    answer = jnp.asarray(answer_PxLa, jnp.int32)
    P, Lp = prompts.shape
    La = answer.shape[1]
    N = forest.node_parent.shape[1]
    T = forest.tokens.shape[2]
    L = Lp + T + La
    rep, used = node_leaves(forest)
    ends = node_ends(forest)[:, :, None]  # [P, N, 1]
    lp = jnp.asarray(prompt_lengths_P, jnp.int32)[:, None, None]
    la = jnp.asarray(answer_lengths_P, jnp.int32)[:, None, None]
    scored_in = (jnp.arange(La)[None, :] < la[:, 0]) if answer_scored_PxLa is None else (
        jnp.asarray(answer_scored_PxLa) > 0)
    i = jnp.arange(L, dtype=jnp.int32)[None, None, :]  # [1, 1, L]
    resp = jnp.take_along_axis(forest.tokens, rep[:, :, None], axis=1)  # [P, N, T]: the node's leaf's response
    prompt_tok = jnp.take_along_axis(prompts[:, None, :], jnp.clip(i, 0, Lp - 1), axis=2)  # [P, 1, L]
    resp_tok = jnp.take_along_axis(resp, jnp.clip(i - lp, 0, T - 1), axis=2)  # [P, N, L]
    a_idx = jnp.clip(i - lp - ends, 0, La - 1)  # [P, N, L]
    ans_tok = jnp.take_along_axis(jnp.broadcast_to(answer[:, None, :], (P, N, La)), a_idx, axis=2)
    in_prompt, in_resp = i < lp, i < lp + ends
    in_answer = (i >= lp + ends) & (i < lp + ends + la)
    real = i < lp + ends + la
    tokens = jnp.where(in_prompt, prompt_tok, jnp.where(in_resp, resp_tok, jnp.where(in_answer, ans_tok, pad_id)))
    scored_flag = jnp.take_along_axis(jnp.broadcast_to(scored_in[:, None, :], (P, N, La)), a_idx, axis=2)
    scored = in_answer & scored_flag & used[:, :, None]
    flat = lambda x: x.reshape((P * N, L))  # noqa: E731
    return TruthBatch(tokens=flat(tokens.astype(jnp.int32)), positions=flat(jnp.where(real, i, 0).astype(jnp.int32)),
                      segment_ids=flat(real.astype(jnp.int32)), scored=flat(scored.astype(jnp.float32)), used=used)


def truth_logprobs(logprob_fn: Callable, params: Any, prompts_PxLp: jax.Array, prompt_lengths_P: jax.Array,
                   forest: Forest, answer_PxLa: jax.Array, answer_lengths_P: jax.Array,
                   answer_scored_PxLa: jax.Array | None = None, *, pad_id: int = 0,
                   rows_per_call: int | None = None) -> jax.Array:
    """float32[P, N]: ``(1 / L) sum_{j scored} log pi(a_j | q, o_<=n, a_<j)`` for every node slot (module docstring);
    0 for node slots on no path and for prompts with no scored answer token.

    ``logprob_fn(params, tokens_BxL, positions_BxL, segment_ids_BxL) -> logp_BxL`` (aligned with the tokens);
    ``rows_per_call``: run the ``P * N`` rows in chunks of this many under ``lax.map`` (memory), default all at
    once. Pure: jit it with ``logprob_fn`` closed over (:func:`make_truth_scorer`)."""
    b = truth_sequences(prompts_PxLp, prompt_lengths_P, forest, answer_PxLa, answer_lengths_P, answer_scored_PxLa,
                        pad_id)
    P, N = b.used.shape
    B, L = b.tokens.shape
    if rows_per_call is None or rows_per_call >= B:
        logp = logprob_fn(params, b.tokens, b.positions, b.segment_ids)
    else:
        if rows_per_call < 1:
            raise ValueError(f"truth_logprobs: rows_per_call must be >= 1, got {rows_per_call}")
        chunks = -(-B // rows_per_call)
        pad = chunks * rows_per_call - B
        split = lambda x: jnp.pad(x, ((0, pad), (0, 0))).reshape((chunks, rows_per_call, L))  # noqa: E731
        logp = jax.lax.map(lambda xs: logprob_fn(params, *xs),
                           (split(b.tokens), split(b.positions), split(b.segment_ids))).reshape((-1, L))[:B]
    return mean_scored_logprob(logp, b.scored).reshape((P, N))


def mean_scored_logprob(logp_BxL: jax.Array, scored_BxL: jax.Array) -> jax.Array:
    """float32[B]: the mean of ``logp`` over each row's scored positions (``scored > 0``); 0 for a row with none."""
    on = scored_BxL > 0
    total = jnp.sum(jnp.where(on, logp_BxL.astype(jnp.float32), 0.0), axis=-1)
    count = jnp.sum(on.astype(jnp.float32), axis=-1)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0).astype(jnp.float32)


def make_truth_scorer(model_config, *, rows_per_call: int | None = None, pad_id: int = 0, chunk_size: int = 8192,
                      attention_impl: str = "xla") -> Callable:
    """A jitted ``scorer(params, prompts_PxLp, prompt_lengths_P, forest, answer_PxLa, answer_lengths_P,
    answer_scored_PxLa=None) -> truth_logp_PxN`` with the learner's sequence forward
    (:func:`treejax.rl.layouts.sequence_logprobs`) of ``model_config``."""
    from treejax.rl.layouts import sequence_logprobs

    def logprob_fn(params, tokens, positions, segment_ids):
        return sequence_logprobs(params, model_config, tokens, positions, segment_ids, chunk_size=chunk_size,
                                 attention_impl=attention_impl)

    fn = functools.partial(truth_logprobs, logprob_fn, pad_id=pad_id, rows_per_call=rows_per_call)
    return jax.jit(fn)


def answer_tokens(encode: Callable[[str], Sequence[int]], answers: Sequence[str], prefix: str = "",
                  suffix: str = "", max_length: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host helper: ``(answer_PxLa int32, answer_lengths_P int32, answer_scored_PxLa float32)`` for the texts
    ``prefix + answer + suffix``, each part tokenized on its own with ``encode`` and concatenated; only the answer
    part is scored (IGPO's official code scores the ground truth's tokens inside a fixed answer template).
    ``max_length``: the width ``La`` (default: the longest); a longer answer is an error, not a silent cut."""
    pre, suf = list(encode(prefix)) if prefix else [], list(encode(suffix)) if suffix else []
    rows = [(pre, list(encode(a)), suf) for a in answers]
    if any(len(a) == 0 for _, a, _ in rows):
        raise ValueError("answer_tokens: an answer tokenizes to no tokens (nothing to score)")
    width = max(len(p) + len(a) + len(s) for p, a, s in rows)
    La = width if max_length is None else int(max_length)
    if width > La:
        raise ValueError(f"answer_tokens: an answer needs {width} tokens, more than max_length={La}")
    toks = np.zeros((len(rows), La), np.int32)
    scored = np.zeros((len(rows), La), np.float32)
    lengths = np.zeros(len(rows), np.int32)
    for r, (p, a, s) in enumerate(rows):
        seq = p + a + s
        toks[r, :len(seq)] = seq
        scored[r, len(p):len(p) + len(a)] = 1.0
        lengths[r] = len(seq)
    return toks, lengths, scored


# ------------------------------------------------------------------------------------------------ InfoPO
#: InfoPO's placeholder for a masked observation (the official code's ``observation_placeholder``).
FEEDBACK_PLACEHOLDER = "No information found."


@struct.dataclass
class FeedbackBatch:
    """The rows of :func:`feedback_sequences`, ``B = P * N`` rows of width ``L = Lp + T`` each, in two versions:
    ``tokens`` (the conversation as it was) and ``masked`` (the parent turn's observation replaced by the
    placeholder); ``positions`` / ``segment_ids`` as the sequence forward takes them (shared by both versions);
    ``scored [B, L]`` 1.0 on the node's own policy tokens; ``has_gain [P, N]`` the nodes with a gain: a turn (depth
    >= 2) on some leaf's path, with >= 1 policy token, whose parent turn has >= 1 observation token."""

    tokens: jax.Array
    masked: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    scored: jax.Array
    has_gain: jax.Array


def feedback_sequences(prompts_PxLp: jax.Array, prompt_lengths_P: jax.Array, forest: Forest,
                       placeholder_K: jax.Array, pad_id: int = 0) -> FeedbackBatch:
    """InfoPO's counterfactual rows: for every (prompt ``p``, node slot ``n``), row ``p * N + n`` is ``prompt_p ++
    response tokens [0, end(n))`` of a leaf through ``n`` (:func:`node_leaves`), right-padded to ``Lp + T``; in the
    ``masked`` version the observation tokens of ``n``'s parent turn (its span's tokens with ``policy_mask`` 0)
    are replaced, position by position, by ``placeholder_K`` padded with its last token or cut to the
    observation's length (the official code's rule: the positions of every later token stay as they were)."""
    prompts = jnp.asarray(prompts_PxLp, jnp.int32)
    ph = jnp.asarray(placeholder_K, jnp.int32)
    P, Lp = prompts.shape
    N, T, K = forest.node_parent.shape[1], forest.tokens.shape[2], ph.shape[0]
    L = Lp + T
    rep, used = node_leaves(forest)
    span = forest.spans()
    start, end = span[..., 0], span[..., 0] + span[..., 1]  # [P, N]
    parent = jnp.clip(forest.node_parent, 0, N - 1)
    pstart, pend = jnp.take_along_axis(start, parent, axis=1), jnp.take_along_axis(end, parent, axis=1)
    resp = jnp.take_along_axis(forest.tokens, rep[:, :, None], axis=1)  # [P, N, T]
    pm = jnp.take_along_axis(forest.policy_tokens(), rep[:, :, None], axis=1) > 0  # [P, N, T]
    r = jnp.arange(T)[None, None, :]
    own_policy = (r >= start[:, :, None]) & (r < end[:, :, None]) & pm
    parent_obs = (r >= pstart[:, :, None]) & (r < pend[:, :, None]) & ~pm
    obs_start = jnp.min(jnp.where(parent_obs, r, T), axis=-1)  # [P, N]
    depth = forest.node_depth
    has_gain = used & (depth >= 2) & jnp.any(own_policy, -1) & jnp.any(parent_obs, -1)
    lp = jnp.asarray(prompt_lengths_P, jnp.int32)[:, None, None]
    i = jnp.arange(L, dtype=jnp.int32)[None, None, :]
    ri = jnp.clip(i - lp, 0, T - 1)  # the response index of position i
    take = lambda x: jnp.take_along_axis(x, jnp.broadcast_to(ri, (P, N, L)), axis=2)  # noqa: E731
    prompt_tok = jnp.take_along_axis(prompts[:, None, :], jnp.clip(i, 0, Lp - 1), axis=2)
    in_prompt, real = i < lp, i < lp + end[:, :, None]
    tokens = jnp.where(in_prompt, prompt_tok, jnp.where(real, take(resp), pad_id))
    fill = ph[jnp.clip(i - lp - obs_start[:, :, None], 0, K - 1)]
    masked = jnp.where(~in_prompt & real & take(parent_obs), fill, tokens)
    scored = ~in_prompt & real & take(own_policy) & has_gain[:, :, None]
    flat = lambda x: x.reshape((P * N, L))  # noqa: E731
    positions = jnp.broadcast_to(jnp.where(real, i, 0), (P, N, L))
    return FeedbackBatch(tokens=flat(tokens.astype(jnp.int32)), masked=flat(masked.astype(jnp.int32)),
                         positions=flat(positions.astype(jnp.int32)), segment_ids=flat(
                             jnp.broadcast_to(real, (P, N, L)).astype(jnp.int32)),
                         scored=flat(scored.astype(jnp.float32)), has_gain=has_gain)


def feedback_gains(logprob_fn: Callable, params: Any, prompts_PxLp: jax.Array, prompt_lengths_P: jax.Array,
                   forest: Forest, placeholder_K: jax.Array, *, pad_id: int = 0) -> jax.Array:
    """float32[P, N]: InfoPO's counterfactual information gain of each node's turn from its parent's feedback,

        g(n) = (1 / |a_n|) sum_{j in a_n} [log pi(a_j | q, o_<n, a_<j) - log pi(a_j | q, o~_<n, a_<j)]

    ``a_n`` node ``n``'s policy tokens (teacher-forced), ``o_<n`` the conversation before them as it was and
    ``o~_<n`` the same with the parent turn's observation masked (:func:`feedback_sequences`): the sampled-token
    estimate of ``KL(pi(. | with feedback) || pi(. | masked))`` on the next action that the official code computes
    (``compute_batched_kl_divergence`` of kfq20/InfoPO). NaN where the node has no gain (the root, first turns,
    unused slots, a parent turn without observation, a turn without policy tokens). ``logprob_fn`` as in
    :func:`truth_logprobs`; two forwards of ``P * N`` rows."""
    b = feedback_sequences(prompts_PxLp, prompt_lengths_P, forest, placeholder_K, pad_id)
    P, N = b.has_gain.shape
    with_fb = logprob_fn(params, b.tokens, b.positions, b.segment_ids)
    without = logprob_fn(params, b.masked, b.positions, b.segment_ids)
    gain = mean_scored_logprob(with_fb.astype(jnp.float32) - without.astype(jnp.float32), b.scored).reshape((P, N))
    return jnp.where(b.has_gain, gain, jnp.nan)


def make_feedback_scorer(model_config, *, pad_id: int = 0, chunk_size: int = 8192,
                         attention_impl: str = "xla") -> Callable:
    """A jitted ``scorer(params, prompts_PxLp, prompt_lengths_P, forest, placeholder_K) -> feedback_gain_PxN``
    (:func:`feedback_gains`) with the learner's sequence forward of ``model_config``."""
    from treejax.rl.layouts import sequence_logprobs

    def logprob_fn(params, tokens, positions, segment_ids):
        return sequence_logprobs(params, model_config, tokens, positions, segment_ids, chunk_size=chunk_size,
                                 attention_impl=attention_impl)

    return jax.jit(functools.partial(feedback_gains, logprob_fn, pad_id=pad_id))


__all__ = ["FEEDBACK_PLACEHOLDER", "FeedbackBatch", "TruthBatch", "answer_tokens", "feedback_gains", "feedback_sequences",
           "make_feedback_scorer", "make_truth_scorer", "mean_scored_logprob", "node_ends", "node_leaves", "truth_logprobs",
           "truth_sequences"]
