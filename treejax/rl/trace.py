"""TRACE's turn-prefix allocation as a fork rule of the tree of turns (:func:`treejax.sampling.multiturn.
run_turn_trees`).

TRACE (methods reference T3-1; only the abstract is public) treats each ReAct turn as a node and spends the rollout
budget on the prompt roots and turn prefixes whose *predicted conditional success* ``p_hat`` promises mixed
outcomes: a prefix that will surely succeed or surely fail teaches nothing when expanded, one near ``p_hat = 1/2``
does. What we build, and the choices the abstract leaves open:

* **the predictor** is the policy itself: ``p_hat(prefix) = pi(a | q, prefix)``, the length-normalised probability of
  the ground-truth answer ``a`` teacher-forced after the conversation so far (IGPO's score,
  :mod:`treejax.rl.info_gain`; the answer written as the environment's answer line, e.g. ``"Answer: 42"``). It needs
  no trained head and is exact for the current weights; it is not calibrated (a small model gives low
  probabilities to any answer), hence
* **the allocation is by rank**: at each round of turn boundaries the requesting paths are ordered by ``u =
  p_hat (1 - p_hat)`` and the top ``fraction`` of them (at least one) fork into ``min(branch_factor, slots)``
  children; the others go on as one child holding all their slots. Ties keep the sampler's order.

Unbiasedness: a path's child count depends only on prefixes decoded so far (its own and the other paths' of the same
round), never on the children's draws, and an ended subtree is never re-entered, so every leaf slot stays one
sample of the policy (weight 1; :mod:`treejax.sampling.multiturn`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from treejax.sampling.multiturn import ForkRequest


def make_prefix_scorer(model_config, chunk_size: int = 8192, attention_impl: str = "xla") -> Callable:
    """A jitted ``score(params, tokens_BxL, positions_BxL, segment_ids_BxL, scored_BxL) -> mean_logp_B``: the mean
    log-prob of the ``scored`` positions under the learner's sequence forward
    (:func:`treejax.rl.layouts.sequence_logprobs`)."""
    from treejax.rl.info_gain import mean_scored_logprob
    from treejax.rl.layouts import sequence_logprobs

    @jax.jit
    def score(params, tokens, positions, segment_ids, scored):
        logp = sequence_logprobs(params, model_config, tokens, positions, segment_ids, chunk_size=chunk_size,
                                 attention_impl=attention_impl)
        return mean_scored_logprob(logp, scored)

    return score


def prefix_rows(prompts: list[np.ndarray], responses: list[list[int]], answers: list[np.ndarray],
                answers_scored: list[np.ndarray], width: int, rows: int, pad_id: int = 0):
    """``(tokens, positions, segment_ids, scored)`` ``[rows, width]``: row ``i`` is ``prompts[i] ++ responses[i] ++
    answers[i]`` right-padded, ``scored`` 1 on the answer tokens marked in ``answers_scored[i]``; rows past the
    inputs are padding (nothing scored)."""
    if len(prompts) > rows:
        raise ValueError(f"prefix_rows: {len(prompts)} sequences for {rows} rows")
    tokens = np.full((rows, width), pad_id, np.int32)
    seg = np.zeros((rows, width), np.int32)
    scored = np.zeros((rows, width), np.float32)
    for i, (p, r, a, s) in enumerate(zip(prompts, responses, answers, answers_scored)):
        seq = list(p) + list(r) + list(a)
        if len(seq) > width:
            raise ValueError(f"prefix_rows: a sequence of {len(seq)} tokens exceeds the width {width}")
        tokens[i, :len(seq)], seg[i, :len(seq)] = seq, 1
        scored[i, len(p) + len(r):len(seq)] = np.asarray(s, np.float32)[:len(a)]
    positions = np.where(seg > 0, np.arange(width)[None, :], 0).astype(np.int32)
    return tokens, positions, seg, scored


@dataclasses.dataclass
class TraceRule:
    """The fork rule (module docstring). ``score``: :func:`make_prefix_scorer`'s function; ``params``: the weights
    being sampled; ``prompts[p]`` / ``answers[p]`` / ``answers_scored[p]``: prompt ``p``'s tokens, its answer line's
    tokens and which of them are the ground truth's; ``width``: the scoring rows' static width (prompt + response
    capacity + answer); ``branch_factor``; ``fraction`` of each round's requests that fork. After a call,
    ``p_hat`` / ``counts`` hold the round's predictions and child counts; ``history`` collects them all."""

    score: Callable
    params: Any
    prompts: list[np.ndarray]
    answers: list[np.ndarray]
    answers_scored: list[np.ndarray]
    width: int
    branch_factor: int = 2
    fraction: float = 0.5
    pad_id: int = 0
    history: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not 0.0 < self.fraction <= 1.0 or self.branch_factor < 1:
            raise ValueError(f"TraceRule: need 0 < fraction <= 1 and branch_factor >= 1, got {self.fraction}, "
                             f"{self.branch_factor}")

    def predict(self, requests: list[ForkRequest]) -> np.ndarray:
        """``p_hat`` of each request's prefix (module docstring)."""
        rows = 1 << max(len(requests) - 1, 0).bit_length()  # a few batch sizes: few compiles
        batch = prefix_rows([self.prompts[r.prompt] for r in requests], [r.episode.tokens for r in requests],
                            [self.answers[r.prompt] for r in requests],
                            [self.answers_scored[r.prompt] for r in requests], self.width, rows, self.pad_id)
        logp = np.asarray(self.score(self.params, *(jnp.asarray(x) for x in batch)))[:len(requests)]
        return np.exp(logp)

    def __call__(self, requests: list[ForkRequest]) -> list[int]:
        p_hat = self.predict(requests)
        u = p_hat * (1.0 - p_hat)
        k = max(1, int(np.ceil(self.fraction * len(requests))))
        top = set(np.argsort(-u, kind="stable")[:k].tolist())
        counts = [min(self.branch_factor, r.slots) if i in top else 1 for i, r in enumerate(requests)]
        self.history.extend(zip(p_hat.tolist(), counts))
        return counts


@functools.lru_cache(maxsize=None)
def cached_prefix_scorer(model_config) -> Callable:
    """:func:`make_prefix_scorer`, built once per model config."""
    return make_prefix_scorer(model_config)


__all__ = ["TraceRule", "cached_prefix_scorer", "make_prefix_scorer", "prefix_rows"]
