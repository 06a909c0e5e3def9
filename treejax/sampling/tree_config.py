"""Static settings of a tree rollout (:class:`TreeConfig`) and the GRPO-baseline config of independent chains."""

from __future__ import annotations

import dataclasses
from typing import Callable

from treejax.choices import check_choice
from treejax.errors import ConfigError
from treejax.sampling.branching import BranchingRule, FixedAverage, rule_classes
from treejax.sampling.strategies import Strategy, Temperature

#: ``TreeConfig.allocation`` values (see :class:`TreeConfig`).
ALLOCATIONS = ("transfer", "slots")
#: ``TreeConfig.prefix_cache`` values (see :class:`TreeConfig`).
PREFIX_CACHES = ("per_row", "shared", "auto")
#: ``prefix_cache="auto"`` with the XLA cascade (:func:`treejax.sampling.attention.cascade_decode_attention`,
#: ``impl="xla"``) takes the shared layout from this bucketed prompt length on (with ``W >= 2``), where the per-row
#: attention is the XLA ragged loop too. Measured on an H200 (experiments/bench_shared_prefix.py, qwen2.5-0.5b,
#: 64 prompts x W = 16, bf16): XLA cascade 84,401 vs ragged per-row 41,018 tokens/s at 1024-token prompts (2.06x),
#: 37,431 vs 13,269 at 4096 (2.82x); 256 was not measured against ragged. The XLA cascade loses to the per-row
#: Pallas kernel at every length (0.52x / 0.55x / 0.57x at 256 / 1024 / 4096), so it is never chosen over it.
SHARED_PREFIX_MIN_PROMPT = 1024
#: The same threshold where both cascade passes are the Pallas kernel (a GPU with 16-bit caches, one device:
#: ``ModelFns.cascade_attention == "pallas"``). Measured on an H200 (same benchmark and sizes, prefix pass
#: ``block_h`` 128 / 32) against the per-row Pallas kernel: 249,114 / 252,536 vs 236,732 tokens/s at 256-token
#: prompts (1.05x / 1.07x), 223,328 / 227,194 vs 154,301 at 1024 (1.45x / 1.47x), 173,090 / 158,477 vs 65,917 at
#: 4096 (2.63x / 2.40x); peak memory 5.6 vs 8.4, 6.2 vs 17.4 and 8.4 vs 53.4 GiB (``experiments/results/
#: perf_round/shared_prefix_pallas_h200.json``).
SHARED_PREFIX_MIN_PROMPT_PALLAS = 256


def auto_shared_prefix(prompt_bucket: int, rows_per_prompt: int, per_row_attention: str,
                       cascade_attention: str | None) -> bool:
    """``prefix_cache="auto"``'s rule (the measurements are at :data:`SHARED_PREFIX_MIN_PROMPT` and
    :data:`SHARED_PREFIX_MIN_PROMPT_PALLAS`), with ``W >= 2``:

    * both cascade passes Pallas (``cascade_attention == "pallas"``): shared from a bucketed prompt of
      ``SHARED_PREFIX_MIN_PROMPT_PALLAS`` tokens;
    * XLA cascade, per-row attention not the Pallas kernel: shared from ``SHARED_PREFIX_MIN_PROMPT`` tokens;
    * XLA cascade against the per-row Pallas kernel (e.g. a multi-device mesh, where the cascade has no
      ``shard_map`` wrapper): per-row rows.

    On a TPU (``"pallas_tpu"`` per-row attention and cascade passes, or the XLA cascade on a mesh) and with the
    Mosaic GPU kernel (``"pallas_mgpu"`` per-row and cascade passes, asked for by name) nothing has been
    measured, so the second rule applies: shared from ``SHARED_PREFIX_MIN_PROMPT`` tokens."""
    if rows_per_prompt < 2:
        return False
    if cascade_attention == "pallas":
        return prompt_bucket >= SHARED_PREFIX_MIN_PROMPT_PALLAS
    return prompt_bucket >= SHARED_PREFIX_MIN_PROMPT and per_row_attention != "pallas"


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static settings of a tree rollout (hashable; part of the jit signature).

    ``num_leaves`` W, ``max_depth`` D, ``segment_length`` S, ``branch_factor`` b; ``init_divergence`` initial
    branches per prompt (default b) or ``init_divergence_range=(m, n)`` for a random count in ``[m, n]`` per
    prompt; ``max_response_length`` (default ``D * S``); ``stop_ids`` (default: the model's EOS ids);
    ``answer_fn(tokens_T, length) -> bool`` optional jittable predicate (e.g. ``predicates.BoxedAnswer``);
    ``repetition_ngram``/``repetition_count`` (0 disables) and ``repetition_scope`` ("segment" | "response");
    ``branching``: the branching/pruning rule (:mod:`treejax.sampling.branching`; default
    :class:`~treejax.sampling.branching.FixedAverage`), e.g. ``TreeConfig.branching = @LogProbWeighted()`` in
    gin.

    ``allocation``: how the prompt's ``W`` leaves are shared out over the tree.

    * ``"transfer"`` (TreePO's official allocation, the default): every leaf is one of ``W`` equal shares,
      ``budget_transfer`` hands the budget of paths that stop to the paths that go on, ``fallback`` re-enters
      finished leaves until ``W`` leaves exist. The leaves are a *biased* sample of the policy: leaf ``l``
      stands for its path mass ``m(l) = prod_{v ancestor of l} 1 / c(v)`` (``c(v)``: v's children), not
      ``1/W``, so early stops (short answers) are under-represented; :attr:`treejax.forest.Forest.leaf_weight`
      holds ``W m(l)`` (meaningful only without ``fallback``, which adds children to ended subtrees).
    * ``"slots"`` (unbiased by construction): the ``W`` slots are split evenly over ``k = init_divergence``
      root paths; at a boundary a live path with ``n > 1`` slots splits its OWN slots over
      ``c = rule.slot_children(...) <= min(b, n)`` children (as evenly as possible, the first children take
      the remainder); a path that ends is stored once per slot it holds (a leaf repeated ``n`` times: same
      path, tokens and status). No transfer, no fallback (``budget_transfer`` and ``fallback`` are not read),
      at most ``D`` rounds. Every slot is then an exact draw of the policy's response distribution and every
      existing estimator, whitening, loss aggregation and metric is slot-weighted with no extra plumbing;
      ``k = W`` is GRPO's independent sampling. Only rules that can split a path's own slots
      (:attr:`BranchingRule.splits_slots`, e.g. ``FixedAverage``) and that do not prune are allowed.

    ``with_entropy``: record per-token entropy in ``info["entropy"]`` (also computed whenever the rule needs it);
    ``max_prompt_length``: prompts longer than this are rejected (the cache is sized from it when given).
    ``row_buckets``: the decode step runs on the smallest of ``R, R/2, ..., R/2^(row_buckets-1)`` rows that
    holds every live path (live rows are packed first at each segment start; 1 = always all ``R`` rows). A tree
    has few live paths near the root, so this is where its saving in decode cost comes from.

    ``prefix_cache``: the KV-cache layout of the prompts (:mod:`treejax.sampling.cache`).

    * ``"per_row"``: every row holds the whole sequence; each prompt's KV is prefilled into its first
      row and copied into its ``W`` rows, so a decode step reads the prompt's KV ``W`` times.
    * ``"shared"``: the prompt's KV is stored once per prompt and every row holds only its own suffix (the
      pending prompt token and the response); decode attention is the exact cascade of a prefix pass per prompt
      and a suffix pass per row merged by log-sum-exp (:func:`treejax.sampling.attention.
      cascade_decode_attention`: both passes through the Pallas kernel where the per-row attention is Pallas,
      the XLA ragged loop otherwise; ``make_model_fns(cascade=...)``). Works with both
      allocations, ``row_buckets``, fallbacks, root restarts and continuations (their work cache is expanded to
      per-row rows, :func:`treejax.sampling.cache.per_row_rows`). Needs model fns with ``init_shared_cache`` (the
      treejax transformer's; a scripted :class:`~treejax.sampling.decode.ModelFns` without it raises). Not for
      partial rollouts (:mod:`treejax.sampling.partial` prefills a different prefix per row: ``"shared"``
      raises there, ``"auto"`` is per-row), the multi-turn sampler or ``decode.generate`` (per-row only).
    * ``"auto"`` (default): ``"shared"`` where it measured faster, else ``"per_row"`` (:meth:`resolved_prefix_cache`,
      the rule in :func:`auto_shared_prefix`): ``W >= 2``, model fns that support it, and a bucketed prompt of at
      least :data:`SHARED_PREFIX_MIN_PROMPT_PALLAS` (256) tokens when both cascade passes are the Pallas kernel
      (a GPU with 16-bit caches), :data:`SHARED_PREFIX_MIN_PROMPT` (1024) when both the cascade and the per-row
      attention are XLA (CPU, fp32 caches, head sizes the kernel cannot take); never the XLA cascade against the
      per-row Pallas kernel.
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
    branching: BranchingRule | None = None
    budget_transfer: bool = True
    fallback: bool = True
    allocation: str = "transfer"
    max_prompt_length: int | None = None
    with_entropy: bool = False
    row_buckets: int = 4
    prefix_cache: str = "auto"

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
        if self.branching is not None and not isinstance(self.branching, BranchingRule):
            raise ConfigError(f"TreeConfig.branching must be a branching rule, got {self.branching!r}; valid: "
                              f"{', '.join(f'@{c.__name__}()' for c in rule_classes().values())}")
        check_choice("TreeConfig.allocation", self.allocation, ALLOCATIONS)
        self.rule.check_tree(self)
        if self.allocation == "slots":
            rule = self.rule
            if rule.prunes:
                raise ConfigError(f"TreeConfig.allocation='slots' cannot use the pruning rule {rule!r}: a pruned path "
                                  "would keep its slots as an unfinished answer, so the slots would no longer be "
                                  "draws of the policy; use allocation='transfer' for pruning rules")
            if not rule.splits_slots:
                raise ConfigError(f"TreeConfig.allocation='slots' needs a rule that splits a path's own slots "
                                  f"(BranchingRule.splits_slots), {type(rule).__name__} moves budget between "
                                  "paths; use TreeConfig.branching=@FixedAverage() or allocation='transfer'")
        check_choice("TreeConfig.repetition_scope", self.repetition_scope, ("segment", "response"))
        check_choice("TreeConfig.prefix_cache", self.prefix_cache, PREFIX_CACHES)
        if (self.repetition_ngram > 0) != (self.repetition_count > 0):
            raise ValueError("set both repetition_ngram and repetition_count (> 0) or neither")
        if self.row_buckets < 1:
            raise ValueError(f"row_buckets must be >= 1, got {self.row_buckets}")
        if self.max_prompt_length is not None and self.max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {self.max_prompt_length}")

    def resolved_prefix_cache(self, prompt_bucket: int, supports_shared: bool = True,
                              per_row_attention: str = "ragged", cascade_attention: str | None = "xla") -> str:
        """``"per_row"`` or ``"shared"`` for prompts padded to ``prompt_bucket`` (``prefix_cache`` docstring);
        ``supports_shared``: whether the model fns can run the shared layout (``"shared"`` without it raises);
        ``per_row_attention`` / ``cascade_attention``: the model fns' per-row decode attention and cascade passes
        (``ModelFns.attention``, ``ModelFns.cascade_attention``)."""
        if self.prefix_cache == "shared":
            if not supports_shared:
                raise ValueError("TreeConfig.prefix_cache='shared' needs model fns with a shared-prefix cache "
                                 "(ModelFns.init_shared_cache, e.g. decode.make_model_fns(config)); these have "
                                 "none: use prefix_cache='per_row' or 'auto'")
            return "shared"
        if self.prefix_cache == "auto":
            shared = supports_shared and auto_shared_prefix(prompt_bucket, self.num_leaves, per_row_attention,
                                                            cascade_attention)
            return "shared" if shared else "per_row"
        return "per_row"

    @property
    def rule(self) -> BranchingRule:
        """The branching rule: ``branching``, or :class:`~treejax.sampling.branching.FixedAverage` by default."""
        return FixedAverage() if self.branching is None else self.branching

    @property
    def slots(self) -> bool:
        """Whether the rollout uses the slot-tree allocation (unbiased by construction)."""
        return self.allocation == "slots"

    @property
    def needs_entropy(self) -> bool:
        """Whether the decode step computes per-token entropy (asked for, or needed by the rule)."""
        return self.with_entropy or self.rule.needs_entropy

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
        """Loop bound: each round of a prompt ends >= 1 leaf within D segments, so W * D iterations suffice
        (slot trees: one round, D segments)."""
        return self.max_depth if self.slots else self.num_leaves * self.max_depth


def independent_config(num_samples: int, max_new_tokens: int, segment_length: int | None = None, **kw) -> TreeConfig:
    """The GRPO baseline as a tree: ``num_samples`` chains per prompt (``b = 1``, init divergence W, no fallback
    needed since every chain ends in exactly one leaf). ``max_new_tokens`` is rounded up to whole segments."""
    S = segment_length or max_new_tokens
    D = -(-max_new_tokens // S)
    return TreeConfig(num_leaves=num_samples, max_depth=D, segment_length=S, branch_factor=1,
                      init_divergence=num_samples, max_response_length=max_new_tokens, **kw)


