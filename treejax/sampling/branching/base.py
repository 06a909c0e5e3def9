"""The branching-rule interface, the per-path statistics a rule sees, and the name registry.

At every segment boundary of a tree rollout (:mod:`treejax.sampling.tree`) the sampler

1. decodes a segment for every live path and classifies each (stop token, repetition, length, depth);
2. asks the rule which of the paths that would go on to **prune** (:meth:`BranchingRule.prune`): each becomes a
   leaf with status ``NodeStatus.PRUNED`` (it keeps its tokens, so the forest still has exactly ``W`` real
   paths per prompt) and, like a path that stopped early, hands its share of the branching budget back to the
   prompt (it counts among the ``f`` paths that ended in this segment, below);
3. computes the prompt's budget of paths for the next segment (TreePO's budget transfer, official code), with
   ``F`` leaves so far, ``A`` surviving live paths and ``f`` paths that ended (or were pruned) in this segment:
       ``total = max(min(W - F, b * A + b * f), A)``   (``budget_transfer=False``: ``max(min(W - F, b * A), A)``);
4. asks the rule for the **child count** of every surviving path (:meth:`BranchingRule.allocate`): a path with
   ``c`` children keeps decoding in its row and forks ``c - 1`` copies into free rows.

The contract of ``allocate``: ``counts_PxW`` is ``>= 1`` on live paths, ``0`` elsewhere, and sums per prompt to
at most ``max(total_P, A)`` (a rule may leave budget unused: it stays with the prompt and is offered again at the
next boundary; the depth-first fallback re-enters the tree once no path is live, so every prompt still ends with
exactly ``W`` leaves). The sampler clips counts to ``[1, W]`` on live paths and never forks more rows than are
free.

A rule is a frozen (hashable) dataclass: static under ``jit``, so swapping rules recompiles once and nothing
recompiles between segments or steps (the training step and the segment index arrive as arrays in
:class:`PathStats`). A rule declares the per-token statistics it needs (:attr:`BranchingRule.needs_entropy`,
:attr:`BranchingRule.top_k`); the sampler computes them in the decode step only when some rule asks.

Adding a rule: one file with a ``@register("name")`` frozen dataclass subclassing :class:`BranchingRule`, and one
import line in ``treejax/sampling/branching/__init__.py`` (README, "Adding a branching rule").
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from treejax.registry import Registry
from treejax.sampling import kernels


@struct.dataclass
class PathStats:
    """What a rule sees at a segment boundary, per prompt ``p`` and path ``w`` (the path in row ``p*W + w``).

    Masks: ``live_PxW`` the path goes on (a child-count candidate; after pruning, the survivors),
    ``ended_PxW`` it ended in this segment (a new leaf; pruned paths included after pruning),
    ``decoded_PxW`` it decoded in this segment (``live | ended``). ``status_PxW`` its :class:`NodeStatus`
    (``ALIVE`` for live paths). ``depth_PxW`` segments on the path (this one included), ``length_PxW`` response
    tokens, ``segment_start_PxW`` the first token of its last segment. Per token (0 at ``t >= length``):
    ``tokens_PxWxT``, ``logp_PxWxT`` (policy log-probs), ``entropy_PxWxT`` (zeros unless
    :attr:`BranchingRule.needs_entropy`), ``topk_PxWxTxK`` (the policy's ``K = top_k`` largest log-probs,
    descending). ``path_PxWxD1`` node id per depth (``-1`` past the end; siblings share the node at
    ``depth - 1``). ``leaves_P`` leaves stored before this segment's; ``step`` the training step, ``segment``
    the loop iteration, ``key`` a PRNG key for this boundary (a stream of its own). ``extra_PxWxTxC`` the rule's
    :attr:`BranchingRule.token_stats` (read them with :meth:`token_stat`); ``probe_ready`` whether the probe
    those statistics read has been trained (a rule should not act on an untrained probe). ``path_scores_PxW``
    the rule's path scorer's score of each path's last segment (:attr:`BranchingRule.path_scorer`, e.g. a PRM;
    ``None`` unless the rule has one; only live paths are meaningful). ``branch_factor``
    ``b``, ``segment_length`` ``S`` and ``token_stat_names`` are static.
    """

    live_PxW: jax.Array
    ended_PxW: jax.Array
    status_PxW: jax.Array
    depth_PxW: jax.Array
    length_PxW: jax.Array
    segment_start_PxW: jax.Array
    tokens_PxWxT: jax.Array
    logp_PxWxT: jax.Array
    entropy_PxWxT: jax.Array
    topk_PxWxTxK: jax.Array
    path_PxWxD1: jax.Array
    leaves_P: jax.Array
    step: jax.Array
    segment: jax.Array
    key: jax.Array
    extra_PxWxTxC: jax.Array | None = None
    path_scores_PxW: jax.Array | None = None
    probe_ready: jax.Array | bool = False
    branch_factor: int = struct.field(pytree_node=False, default=2)
    segment_length: int = struct.field(pytree_node=False, default=1)
    token_stat_names: tuple = struct.field(pytree_node=False, default=())

    def token_stat(self, name: str) -> jax.Array:
        """float[P, W, T]: the per-token statistic ``name`` (one of the rule's ``token_stats``)."""
        if name not in self.token_stat_names:
            raise KeyError(f"per-token statistic {name!r} was not computed (the rule's token_stats: "
                           f"{self.token_stat_names})")
        return self.extra_PxWxTxC[..., self.token_stat_names.index(name)]

    def last_token(self, x_PxWxT: jax.Array) -> jax.Array:
        """float[P, W]: ``x`` at each path's last decoded token (``length - 1``; 0 for empty paths)."""
        t = jnp.maximum(self.length_PxW - 1, 0)[:, :, None]
        return jnp.where(self.length_PxW > 0, jnp.take_along_axis(x_PxWxT, t, axis=-1)[:, :, 0], 0.0)

    @property
    def decoded_PxW(self) -> jax.Array:
        return self.live_PxW | self.ended_PxW

    def response_mask(self) -> jax.Array:
        """bool[P, W, T]: ``t < length`` (the whole response)."""
        t = jnp.arange(self.tokens_PxWxT.shape[-1])
        return t[None, None, :] < self.length_PxW[:, :, None]

    def segment_mask(self) -> jax.Array:
        """bool[P, W, T]: ``segment_start <= t < length`` (the last segment)."""
        t = jnp.arange(self.tokens_PxWxT.shape[-1])
        t = t[None, None, :]
        return (t >= self.segment_start_PxW[:, :, None]) & (t < self.length_PxW[:, :, None])

    def masked_mean(self, x_PxWxT: jax.Array, mask_PxWxT: jax.Array) -> jax.Array:
        """float[P, W]: ``sum_t mask x / max(sum_t mask, 1)``."""
        return (jnp.sum(jnp.where(mask_PxWxT, x_PxWxT, 0.0), -1)
                / jnp.maximum(jnp.sum(mask_PxWxT, -1), 1))

    def segment_tokens(self) -> jax.Array:
        """int32[P, W, S]: the last segment's tokens left-aligned (``-1`` past its end)."""
        S = self.segment_length
        t = self.segment_start_PxW[:, :, None] + jnp.arange(S)[None, None, :]
        toks = jnp.take_along_axis(self.tokens_PxWxT, jnp.minimum(t, self.tokens_PxWxT.shape[-1] - 1), axis=-1)
        return jnp.where(t < self.length_PxW[:, :, None], toks, -1)

    def parent_node(self) -> jax.Array:
        """int32[P, W]: the node at ``depth - 1`` (the branch point the path's last segment started from)."""
        d = jnp.maximum(self.depth_PxW - 1, 0)
        return jnp.take_along_axis(self.path_PxWxD1, d[:, :, None], axis=-1)[:, :, 0]


class BranchingRule:
    """Base class of branching/pruning rules (module docstring). Subclasses are frozen dataclasses.

    ``needs_entropy`` / ``top_k`` / ``token_stats``: per-token statistics the rule reads (the decode step
    computes them only when asked; ``token_stats`` from :mod:`treejax.sampling.token_stats`). ``prunes``: whether :meth:`prune` can return True (static; ``False`` skips the pruning stage).
    ``splits_slots``: whether the rule implements :meth:`slot_children` (slot trees, ``TreeConfig.allocation =
    "slots"``, accept only such rules). ``restarts``: whether :meth:`root_restarts` can turn new children into
    fresh root paths (static; ``False`` skips the stage). ``name``: the name the rule is registered under (set by
    :func:`register`, as is its alias ``rule_name``).
    """

    name: ClassVar[str] = ""
    needs_entropy: ClassVar[bool] = False
    top_k: ClassVar[int] = 0
    token_stats: ClassVar[tuple[str, ...]] = ()
    prunes: ClassVar[bool] = False
    restarts: ClassVar[bool] = False
    splits_slots: ClassVar[bool] = False
    needs_path_scores: ClassVar[bool] = False

    @property
    def path_scorer(self):
        """The :class:`~treejax.sampling.path_scores.PathScorer` that fills ``PathStats.path_scores_PxW`` (None)."""
        return None

    def check_tree(self, tc) -> None:
        """Refuses a :class:`~treejax.sampling.tree_config.TreeConfig` the rule cannot run in (a one-line
        ``ConfigError`` with the fix; default: any)."""

    def prune(self, stats: PathStats) -> jax.Array:
        """bool[P, W]: live paths to end here as ``PRUNED`` leaves (default: none)."""
        return jnp.zeros_like(stats.live_PxW)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        """int32[P, W]: children per live path (``>= 1``; 0 elsewhere), summing to at most ``max(total, A)``."""
        raise NotImplementedError

    def root_restarts(self, stats: PathStats, counts_PxW: jax.Array) -> jax.Array:
        """int32[P]: how many of the prompt's new children (``sum(counts - 1)`` over its live paths) start afresh
        at the root instead of forking (only read when ``restarts``; default none). The sampler turns the
        prompt's first forked rows into root paths: same row budget, a new independent draw from the prompt."""
        return jnp.zeros(counts_PxW.shape[:1], jnp.int32)

    def slot_children(self, stats: PathStats, slots_PxW: jax.Array) -> jax.Array:
        """int32[P, W]: children of each live path of a slot tree, in ``[1, min(b, slots)]`` (0 elsewhere).

        The count may depend on anything decoded so far (never on the children themselves), and a rule may only
        split a path's OWN ``slots`` (the sampler splits them as evenly as possible over the children), never
        move slots between paths: that keeps every slot an exact draw of the policy. Default (used by
        :class:`FixedAverage`): as many children as allowed, ``min(b, slots)``."""
        b = stats.branch_factor
        return jnp.where(stats.live_PxW, jnp.clip(slots_PxW, 1, b), 0).astype(jnp.int32)


#: Every branching rule class by name (gin knows each by its class name). Registration sets ``cls.name`` and,
#: as an alias kept for existing code, ``cls.rule_name``.
RULES: Registry[type] = Registry("branching rule", base=BranchingRule, name_attrs=("name", "rule_name"))
_REGISTRY = RULES  # the name tests and notebooks use to undo a registration (``_REGISTRY.pop(name)``)


def register(name: str, *, overwrite: bool = False):
    """Class decorator: registers a frozen-dataclass :class:`BranchingRule` under ``name`` (the gin-facing name;
    a second class under the same name is an error unless ``overwrite=True``, e.g. a notebook cell run twice)."""
    return RULES.register(name, overwrite=overwrite)


def get_rule(name: str, **kwargs) -> BranchingRule:
    """Builds the rule registered under ``name`` (``KeyError`` listing the valid names otherwise)."""
    return RULES.get(name)(**kwargs)


def rule_classes() -> dict[str, type]:
    """``{registered name: class}`` (e.g. for gin registration)."""
    return RULES.classes()


# ----------------------------------------------------------------------------------------------- shared kernels
def capped_allocation(score_PxW: jax.Array, cap_PxW: jax.Array, live_PxW: jax.Array, total_P: jax.Array,
                      spill: bool = True) -> jax.Array:
    """int32[P, W]: 1 child per live path, then the extra budget ``E = max(total - A, 0)`` by descending score.

    Live paths in descending ``score`` (ties: lower index first) take ``min(cap, what is left)`` extra children
    each, ``cap_PxW >= 0`` (a path with cap 0 gets no extra). With ``spill``, what no cap absorbs is split evenly
    over all live paths (largest remainder, lower index first, as :func:`kernels.allocate_budget` with equal
    weights); without, it stays unused (returned to the prompt for later boundaries).
    """
    live = live_PxW.astype(bool)
    n_live = jnp.sum(live, axis=-1).astype(jnp.int32)
    extra_P = jnp.maximum(total_P.astype(jnp.int32) - n_live, 0)
    cap = jnp.where(live, jnp.maximum(cap_PxW.astype(jnp.int32), 0), 0)
    score = jnp.where(live, score_PxW.astype(jnp.float32), -jnp.inf)
    W = live.shape[-1]
    idx = jnp.arange(W)
    # ahead[p, i, j]: path j ranks before path i (higher score, or equal score and lower index)
    ahead = ((score[:, None, :] > score[:, :, None])
             | ((score[:, None, :] == score[:, :, None]) & (idx[None, :] < idx[:, None])[None]))
    before = jnp.sum(jnp.where(ahead & live[:, None, :], cap[:, None, :], 0), axis=-1)  # caps ranked ahead of i
    extra = jnp.where(live, jnp.clip(extra_P[:, None] - before, 0, cap), 0)
    counts = jnp.where(live, 1 + extra, 0)
    if spill:
        left = extra_P - jnp.sum(extra, axis=-1)
        even = kernels.allocate_budget(jnp.ones(live.shape, jnp.float32), live, left, minimum=0)
        counts = counts + even
    return counts.astype(jnp.int32)


def windowed_mean(x_PxWxT: jax.Array, length_PxW: jax.Array, window: int) -> jax.Array:
    """float[P, W, T]: mean of ``x`` over the last ``window`` tokens up to and including ``t`` (fewer at the
    start), 0 at ``t >= length``."""
    t = jnp.arange(x_PxWxT.shape[-1])
    valid = t[None, None, :] < length_PxW[:, :, None]
    x = jnp.where(valid, x_PxWxT, 0.0)
    c = jnp.cumsum(x, axis=-1)
    shifted = jnp.pad(c, ((0, 0), (0, 0), (window, 0)))[:, :, : c.shape[-1]]
    n = jnp.minimum(t + 1, window).astype(jnp.float32)
    return jnp.where(valid, (c - shifted) / n[None, None, :], 0.0)
