"""Answer predicates over token ids: jitted hooks ``fn(tokens_T, length) -> bool`` the tree rollout calls at
segment boundaries (TreePO marks a path FINISHED when it ends with EOS after a recognizable answer).

:class:`BoxedAnswer` detects a *closed* ``\\boxed{...}`` from token ids alone: the id pattern of ``\\boxed{``
(e.g. ``tok.encode("\\boxed{")``, which may be several pieces) must occur, and the braces after it must balance
back to zero. With ``o_j`` / ``c_j`` the number of ``{`` / ``}`` characters in token ``j`` (a per-id table,
since a piece such as ``}}`` closes two), the box opened by the pattern ending at ``e`` is closed iff

    exists j > e (j < length):  1 + sum_{e < i <= j} (o_i - c_i) <= 0.

Only the first occurrence matters (a later ``\\boxed{`` before the first closes is nested inside it). Within a
single token the order of its characters is not known; a token holding both braces counts by its net delta.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BoxedAnswer:
    """``open_pattern``: ids of ``\\boxed{`` (its own ``{`` is the opening brace); ``brace_delta``: pairs
    ``(token_id, net_brace_change)`` for every id containing ``{`` or ``}`` (e.g. ``(id("}"), -1)``,
    ``(id("}}"), -2)``, ``(id("{"), +1)``)."""

    open_pattern: tuple[int, ...]
    brace_delta: tuple[tuple[int, int], ...]

    def __post_init__(self):
        if not self.open_pattern:
            raise ValueError("BoxedAnswer.open_pattern must hold the token ids of '\\boxed{'")

    @classmethod
    def from_vocab(cls, vocab: dict[str, int], open_pattern: tuple[int, ...]) -> "BoxedAnswer":
        """Builds the brace table from a ``{piece: id}`` vocabulary (e.g. ``tokenizer.get_vocab()``)."""
        delta = tuple(sorted((i, s.count("{") - s.count("}")) for s, i in vocab.items()
                             if ("{" in s or "}" in s) and s.count("{") != s.count("}")))
        return cls(tuple(int(t) for t in open_pattern), delta)

    def __call__(self, tokens_T, length):
        T = tokens_T.shape[0]
        n = len(self.open_pattern)
        if n > T:
            return jnp.zeros((), bool)
        starts = T - n + 1
        match = jnp.ones((starts,), bool)
        for k, tid in enumerate(self.open_pattern):
            match = match & (tokens_T[k: k + starts] == tid)
        match = match & (jnp.arange(starts) + n <= length)
        found = jnp.any(match)
        end = jnp.argmax(match) + n - 1  # index of the pattern's last piece
        ids = np.array([i for i, _ in self.brace_delta] or [-1], np.int32)
        deltas = np.array([d for _, d in self.brace_delta] or [0], np.int32)
        hit = tokens_T[:, None] == jnp.asarray(ids)[None, :]
        delta_T = jnp.sum(jnp.where(hit, jnp.asarray(deltas)[None, :], 0), axis=-1)
        t = jnp.arange(T)
        after = (t > end) & (t < length)
        depth = 1 + jnp.cumsum(jnp.where(after, delta_T, 0))
        return found & jnp.any(after & (depth <= 0))
