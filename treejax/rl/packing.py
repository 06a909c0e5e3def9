"""Tree packing: a rollout forest as a batch that holds every shared token once (the packed update's batch).

``forest_to_batch`` (:mod:`treejax.rl.batch`) expands each leaf into its own row, so a prompt and every node
segment are recomputed once per leaf below them. The packed batch stores, per prompt, the prompt tokens and each
node's segment **once**, with the attention structure of the tree; the per-leaf loss terms are read back through
a gather map from unique tokens to (leaf, token) pairs. Same loss and gradient, fewer FLOPs.

Layout of one packed row (``R`` rows of ``L`` tokens; one or more trees per row)::

    [tree a: prompt | node | node | ...][tree b: prompt | node | ...][pad ...]

* a tree is its prompt (the root, depth 0) followed by its nodes in depth-first **preorder** (a node's tokens
  before its children's), so an ancestor's tokens always precede its descendants' in the row;
* a node is a span ``(start, length)`` of its leaves' responses (:meth:`treejax.forest.Forest.spans`): a fixed
  segment (``start = (d - 1) S`` at depth ``d``, ``S`` tokens but a leaf's last) or a turn of any length (a
  multi-turn tree's policy tokens then the environment's observation tokens: observations are in the row and in
  the forward, so later tokens attend to them, but their pairs carry ``loss_mask = 0``);
* ``positions``: prompt token ``j`` at ``j``; token ``k`` of a node at ``n_p + start + k``, i.e. exactly the
  position the token has in its leaves' expanded rows (a node's tokens continue its parent's);
* attention: token ``i`` sees token ``j`` iff ``j <= i`` (row order) and ``j``'s node is an ancestor-or-self of
  ``i``'s node. Ancestry is stored as preorder (Euler-tour) intervals per token: ``node_lo`` = the preorder
  number of the token's node, ``node_hi`` = the largest preorder number in that node's subtree, and

      mask[i, j] = (j <= i) & (node_lo[j] <= node_lo[i] <= node_hi[j])

  (``a`` is an ancestor-or-self of ``b`` iff ``lo_a <= lo_b <= hi_a``). Preorder numbers are unique within a
  row, so trees sharing a row never see each other. Padding token ``c`` (the row's column ``c``, between nodes
  with ``align`` or after the last tree) has ``lo = hi = PAD_NODE + c``, above every real number: real tokens
  never see padding, and a pad token sees only itself (no row of the mask is empty, and the block-sparse kernel
  visits only the diagonal tiles of a row's padding instead of a causal triangle over it);
* ``prev[i]``: the row index of the token whose hidden state predicts token ``i``: ``i - 1`` inside a node or the
  prompt, the parent's last token for a node's first token (the prompt's last token at depth 1); ``-1`` for the
  first prompt token. ``log pi(tokens[i] | prefix) = log_softmax(h[prev[i]] W)[tokens[i]]``;
* the gather map: leaf slot ``s`` of row ``r`` holds leaf ``leaf_id[r, s] = p * W + w`` (``-1``: empty slot);
  ``pair_index[r, s, t]`` is the row index of that leaf's response token ``t``. Per-pair inputs (advantages,
  loss mask, old / sampler / reference log-probs) are stored per pair ``[R, Wr, T]``, because a shared token
  carries a different advantage on each leaf through it and the PPO clip applies per pair.

Static shapes by bucketing (so the jitted update and log-prob passes compile a handful of times per run, not
per step). Let ``n`` be the largest tree's unique tokens (after alignment padding):

* row length ``L = PackingConfig.row_length`` when set (a tree longer than that is an error), else
  ``granule * m`` with ``m`` the smallest of ``1, 2, 3, 4, 6, 8, 12, 16, 24, ...`` (powers of two and 1.5x powers
  of two) such that ``L >= n``: at most ~2 row lengths per octave, at most 33% padding on the longest tree;
* trees are placed first-fit-decreasing into rows of ``L`` (several small trees per row where they fit, at most
  ``max_trees_per_row``); the row count is rounded up to ``row_multiple * 2^k`` (``row_multiple``: micro-batches
  x batch-sharded devices, so rows split evenly), capped at the one-tree-per-row count rounded the same way;
* leaf slots per row ``Wr = W * 2^k`` (the smallest power of two >= the most trees in any row).
* ``align`` (optional) pads the prompt and every node to a multiple of ``align`` tokens, so block-sparse
  attention kernels see node-aligned blocks.

Sticky layouts (``PackingConfig.sticky``, default on): a run's layout ``(R, L, Wr)`` is fixed at its first
mini-batch from the config's bounds (:func:`startup_layout`), so the jitted update and log-prob passes compile
once per run:

* ``L`` = ``row_length`` when set, else the bucketed bound on one tree's unique tokens
  (:func:`tree_token_bound`: ``Lp + min(W T, (N - 1) S)`` for ``N`` node slots of at most ``S`` tokens, plus
  alignment), so every tree the rollout can produce fits one row;
* ``Wr = W * 2^k`` for the trees of a whole mini-batch (``max_trees_per_row`` caps it), so trees share rows as
  densely as they fit (first-fit decreasing), then spread over the layout's rows largest-first into the emptiest
  row (``balance``: equal work per micro-batch and device);
* ``R`` starts at ``row_multiple`` (``startup_rows="min"``) and is the only size that can grow: a mini-batch
  whose trees do not fit in ``R`` rows of ``L`` takes the next ``row_multiple * 2^k`` and keeps it
  (:class:`LayoutFloor`; one compile per growth, counted in ``packing/layouts``). The rungs ``R = row_multiple * 2^k`` up to one tree per row are known
  from the start, and ``precompile`` compiles them on a background thread after the first step
  (:mod:`treejax.rl.precompile`), so a growth costs no stall. ``startup_rows="max"`` starts at the top rung
  instead (one tree per row): nothing can grow, one compile per run.

The price is padding (a mini-batch of small trees still runs ``R x L`` token slots); the bound is on one tree, so
a row is about as long as the largest tree the config allows and a mini-batch of typical trees fits one row.

Trees without any trained token (dynamic sampling's filler prompts, ``skip_untrained``) are not packed at all:
they carry no loss and no gradient, but still count as sequences in the Dr.GRPO denominator
(``num_sequences``) exactly as in the expanded batch.

The plan (:func:`plan_packing`) is built on the host with NumPy from the forest's own tree (``node_parent`` /
``node_depth``) and its leaves' node paths, one tree at a time (:func:`treejax.rl.pack_tree.build_tree`: one
Python step per node, NumPy per token); placing the per-pair arrays into it (:func:`pack_pairs`) is a jittable
gather.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treejax.choices import check_choice
from treejax.forest import Forest
from treejax.models.tree_attention import TREE_ATTENTION_IMPLS
from treejax.parallel.multihost import host_tree
from treejax.rl.batch import PAIR_FILL, PAIR_KEYS, Batch, TreeInputs
from treejax.rl.pack_tree import PAD_NODE, PackedTree, build_tree


STARTUP_ROWS = ("min", "max")


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """Static settings of the packed batch (see the module docstring's bucketing rules).

    Attributes:
      row_length: fixed row length ``L``; ``None`` buckets it from the longest tree of each batch.
      granule: row lengths are multiples of this (bucketed mode).
      max_trees_per_row: cap on trees sharing one row (``None``: as many as fit).
      align: pad the prompt and every node segment to a multiple of this many tokens (1: no padding).
      skip_untrained: leave trees without any trained token (filler prompts) out of the packed rows.
      attention_impl: tree attention of the packed forward (``treejax.models.tree_attention``): ``"xla"`` (dense
        mask, exact everywhere, ``O(L^2)`` memory), ``"pallas"`` (block-sparse flash kernel, GPU),
        ``"pallas_tpu"`` (the same as a TPU kernel; rows a multiple of 128 tokens, the default ``granule``),
        ``"pallas_mgpu"`` (the same as Pallas Mosaic GPU kernels for Hopper; head sizes and rows multiples of 64;
        faster than ``"pallas"`` on an H200 at 128-wide heads and 14 x 512 rows) or ``"auto"`` (on a GPU the faster
        of ``"pallas_mgpu"`` and ``"pallas"`` for the model's heads and the row length,
        :func:`treejax.models.tree_attention.resolve_impl`; xla elsewhere: ``"pallas_tpu"``, the TPU kernel, is
        asked for by name until it has run on TPU hardware).
      sticky: fix the layout at the first mini-batch from the config's bounds (:func:`startup_layout`, module
        docstring) and pack every later mini-batch into it; only the row count can grow. ``False``: each
        mini-batch gets its own bucketed layout (a compile per new shape).
      precompile: with ``sticky``, compile the update and the log-prob pass for every other row count the layout
        can grow to (:meth:`LayoutFloor.ladder`) on a background thread after the first step's plan
        (:mod:`treejax.rl.precompile`), so a growth later in the run does not stop a step to compile.
      startup_rows: with ``sticky``, where the row count starts: ``"min"`` (``row_multiple`` rows, trees share
        rows; the count grows along the ladder when a mini-batch needs more) or ``"max"`` (the ladder's top: one
        tree per row, ``R`` = the mini-batch's trees rounded up to ``row_multiple``, ``W`` leaf slots a row): the
        layout can never grow, so the update compiles exactly once and there is nothing to precompile, at the
        price of padding every tree to the bound (still never more token slots than the expanded layout:
        ``tree_token_bound <= Lp + W T <= W (Lp + T)``).
    """

    row_length: int | None = None
    granule: int = 128
    max_trees_per_row: int | None = None
    align: int = 1
    skip_untrained: bool = True
    attention_impl: str = "auto"
    sticky: bool = True
    precompile: bool = True
    startup_rows: str = "min"

    def __post_init__(self):
        if self.row_length is not None and self.row_length < 1:
            raise ValueError(f"PackingConfig.row_length must be >= 1 or None, got {self.row_length}")
        if self.granule < 1 or self.align < 1:
            raise ValueError(f"PackingConfig.granule and align must be >= 1, got {self.granule}, {self.align}")
        if self.max_trees_per_row is not None and self.max_trees_per_row < 1:
            raise ValueError(f"PackingConfig.max_trees_per_row must be >= 1 or None, got {self.max_trees_per_row}")
        check_choice("PackingConfig.attention_impl", self.attention_impl, TREE_ATTENTION_IMPLS)
        check_choice("PackingConfig.startup_rows", self.startup_rows, STARTUP_ROWS)


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """Host-side result of :func:`plan_packing` (NumPy arrays; fields as in :class:`~treejax.rl.batch.TreeInputs`).

    ``pair_valid [R, Wr, T]``: the pair is a real response token with a predecessor (the expanded batch's
    ``trainable_mask`` before the loss mask). ``unique_tokens`` / ``expanded_tokens``: real tokens in the packed
    rows vs in the expanded rows of the same prompts (prompt + response per leaf); their ratio is the FLOP
    saving of the token-wise part of the model.
    """

    tokens: np.ndarray
    positions: np.ndarray
    node_lo: np.ndarray
    node_hi: np.ndarray
    prev: np.ndarray
    pair_index: np.ndarray
    pair_valid: np.ndarray
    leaf_id: np.ndarray
    num_sequences: int
    sequence_length: int
    unique_tokens: int
    expanded_tokens: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(R, L, Wr)``."""
        return self.tokens.shape[0], self.tokens.shape[1], self.leaf_id.shape[1]


# ----------------------------------------------------------------------------------------------- bucketing
def bucket_units(n: int) -> int:
    """The smallest of ``1, 2, 3, 4, 6, 8, 12, 16, 24, ...`` (``2^k`` and ``3 * 2^(k-1)``) that is ``>= n``."""
    n = max(int(n), 1)
    p = 1 << (n - 1).bit_length()  # next power of two >= n
    three_quarters = 3 * p // 4
    return three_quarters if p >= 4 and three_quarters >= n else p


def bucket_row_length(n_tokens: int, granule: int) -> int:
    """Row length for a longest tree of ``n_tokens``: ``granule * bucket_units(ceil(n_tokens / granule))``."""
    return granule * bucket_units(-(-int(n_tokens) // granule))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------------------------- the plan
def plan_packing(prompt_tokens_PxLp, prompt_lengths_P, leaf_path_PxWxD1, leaf_length_PxW, tokens_PxWxT,
                 segment_length: int, config: PackingConfig = PackingConfig(), *, prompts=None,
                 trained_PxW=None, row_multiple: int = 1, pad_id: int = 0,
                 floor: tuple[int, int, int] | None = None, node_parent_PxN=None,
                 node_depth_PxN=None, node_span_PxNx2=None, balance: bool = False) -> PackingPlan:
    """Host-side packing plan of the trees of ``prompts`` (default: all ``P``); arrays are NumPy (or fetched).

    ``trained_PxW`` (optional, bool): leaves with at least one trained token; with
    ``config.skip_untrained`` a tree none of whose leaves is trained is not packed. ``row_multiple``: the row
    count is a multiple of it (micro-batches x batch-sharded devices). Leaf ids are global (``p * W + w``), so
    :func:`pack_pairs` reads per-pair arrays of the whole forest. Raises ``ValueError`` on an inconsistent forest
    (a gap in a path, a node with two parents, leaves that disagree on a shared token, a node with children
    shorter than a segment or, with spans, a node that does not start where its parent ends, a leaf longer than
    its path) or a tree longer than ``config.row_length``. ``floor`` ``(R, L, Wr)``: the smallest
    layout to use (a sticky run's :class:`LayoutFloor`): ``L`` and ``R`` at least the floor's, at most ``Wr / W``
    trees per row (one tree per row always fits, so only ``L`` or ``R`` can grow past the floor). ``balance``:
    after first-fit decreasing has fixed ``R``, the trees are re-placed largest first into the row with the most
    free tokens (worst-fit decreasing; kept only if every tree fits), so the ``R`` rows hold even work rather than
    the first rows all of it.
    ``node_parent_PxN`` / ``node_depth_PxN`` (optional, the forest's): each tree's parents and depths are read from
    them instead of rebuilt from the leaf paths (which must agree with them). ``node_span_PxNx2`` (optional, the
    forest's :meth:`~treejax.forest.Forest.spans`): each node's ``(start, length)`` in its leaves' responses, so
    nodes may hold any number of tokens (turns); ``None``: fixed segments of ``segment_length`` tokens (then
    ``T = D * segment_length``). For a fixed-segment forest both give the same plan.
    """
    prompt_tokens = np.asarray(prompt_tokens_PxLp)
    lens = np.asarray(prompt_lengths_P).astype(np.int64)
    leaf_path = np.asarray(leaf_path_PxWxD1).astype(np.int64)
    leaf_length = np.asarray(leaf_length_PxW).astype(np.int64)
    tokens = np.asarray(tokens_PxWxT)
    P, W, D1 = leaf_path.shape
    T = tokens.shape[2]
    S = int(segment_length)
    if tokens.shape[:2] != (P, W) or leaf_length.shape != (P, W) or lens.shape != (P,):
        raise ValueError(f"plan_packing: inconsistent shapes: leaf_path {leaf_path.shape}, tokens {tokens.shape}, "
                         f"leaf_length {leaf_length.shape}, prompt_lengths {lens.shape}")
    spans = None if node_span_PxNx2 is None else np.asarray(node_span_PxNx2).astype(np.int64)
    if spans is None and (D1 - 1) * S != T:
        raise ValueError(f"plan_packing: T={T} response tokens but max depth {D1 - 1} x segment length {S}")
    if row_multiple < 1:
        raise ValueError(f"plan_packing: row_multiple must be >= 1, got {row_multiple}")
    prompts = np.arange(P) if prompts is None else np.asarray(prompts, np.int64)
    trained = None if trained_PxW is None else np.asarray(trained_PxW, bool)
    trees = [(int(p), build_tree(int(p), prompt_tokens[p, : lens[p]], leaf_path[p], leaf_length[p], tokens[p], S,
                                 config.align, pad_id, **_tree_nodes(p, node_parent_PxN, node_depth_PxN, spans)))
             for p in prompts if not (config.skip_untrained and trained is not None and not trained[p].any())]
    sizes = [len(tr.tokens) for _, tr in trees]
    L, cap = _row_length(sizes, config, floor, W)
    rows = _first_fit(sizes, L, cap)
    max_rows = _round_up(max(len(prompts), 1), row_multiple)  # one tree per row: constant per run
    R = min(row_multiple * (1 << (-(-max(len(rows), 1) // row_multiple) - 1).bit_length()), max_rows)
    Wr = W * (1 << (max((len(r) for r in rows), default=1) - 1).bit_length())
    if floor is not None:
        R, Wr = max(R, floor[0]), max(Wr, floor[2])
    if balance and len(rows) < R:
        rows = _spread(sizes, rows, R, L, min(cap, Wr // W))
    out_tok, out_pos, out_lo, out_hi, out_prev, out_pair, out_valid, out_leaf, unique = _fill_rows(
        trees, rows, (R, L, Wr), W, T, pad_id)
    expanded = int(np.sum(lens[prompts]) * W + np.sum(leaf_length[prompts]))
    return PackingPlan(out_tok, out_pos, out_lo, out_hi, out_prev, out_pair, out_valid, out_leaf,
                       num_sequences=len(prompts) * W, sequence_length=prompt_tokens.shape[1] + T,
                       unique_tokens=unique, expanded_tokens=expanded)


def _tree_nodes(p: int, node_parent_PxN, node_depth_PxN, spans) -> dict:
    """The forest's own node arrays of prompt ``p`` that :func:`build_tree` reads (none, parents and depths,
    spans)."""
    nodes = {} if node_parent_PxN is None else dict(node_parent=node_parent_PxN[p], node_depth=node_depth_PxN[p])
    if spans is not None:
        nodes["node_span"] = spans[p]
    return nodes


def _row_length(sizes: list[int], config: PackingConfig, floor: tuple[int, int, int] | None,
                W: int) -> tuple[int, int]:
    """``(L, cap)``: the row length (``config.row_length``, which the longest tree must fit, else bucketed from it;
    at least the floor's) and the most trees a row may hold (``config.max_trees_per_row``, at most the floor's
    ``Wr / W``)."""
    longest = max(sizes, default=1)
    if config.row_length is not None:
        L = config.row_length
        if longest > L:
            raise ValueError(f"plan_packing: a tree of {longest} unique tokens does not fit "
                             f"PackingConfig.row_length={L}; raise it or set it to None (bucketed)")
    else:
        L = bucket_row_length(longest, config.granule)
    cap = config.max_trees_per_row or len(sizes) or 1
    if floor is not None:
        f_rows, f_len, f_slots = floor
        if f_slots % W:
            raise ValueError(f"plan_packing: floor leaf slots {f_slots} are not a multiple of W={W}")
        if config.row_length is None:
            L = max(L, f_len)
        cap = min(cap, max(f_slots // W, 1))
    return L, cap


def _first_fit(sizes: list[int], L: int, cap: int) -> list[list[int]]:
    """First-fit decreasing of the trees (their ``sizes``) into rows of ``L`` tokens, at most ``cap`` trees a row:
    each tree, largest first, goes into the first row it fits, else a new row. The trees of each row, in order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for r in range(len(rows)):
            if free[r] >= sizes[i] and len(rows[r]) < cap:
                rows[r].append(i)
                free[r] -= sizes[i]
                break
        else:
            rows.append([i])
            free.append(L - sizes[i])
    return rows


def _fill_rows(trees: list[tuple[int, PackedTree]], rows: list[list[int]], shape: tuple[int, int, int], W: int,
               T: int, pad_id: int):
    """The packed arrays of ``shape`` ``(R, L, Wr)``: row ``r`` holds its trees end to end, each tree's token
    indices offset by where it starts and its preorder numbers by the nodes before it in the row; tree ``k`` of a
    row owns leaf slots ``[k W, (k + 1) W)`` (leaf ids ``p W + w``). Padding tokens get node number ``PAD_NODE +
    column``, above every real one, so each sees only itself (module docstring). Returns the eight arrays of
    :class:`PackingPlan` and the number of real tokens."""
    R, L, Wr = shape
    out_tok = np.full((R, L), pad_id, np.int32)
    out_pos = np.zeros((R, L), np.int32)
    out_lo = np.full((R, L), PAD_NODE, np.int32)
    out_hi = np.full((R, L), PAD_NODE, np.int32)
    out_prev = np.full((R, L), -1, np.int32)
    out_pair = np.zeros((R, Wr, T), np.int32)
    out_valid = np.zeros((R, Wr, T), bool)
    out_leaf = np.full((R, Wr), -1, np.int32)
    unique = 0
    for r, members in enumerate(rows):
        offset, node_base = 0, 0
        for k, i in enumerate(members):
            p, tr = trees[i]
            n = len(tr.tokens)
            sl = slice(offset, offset + n)
            out_tok[r, sl] = tr.tokens
            out_pos[r, sl] = tr.positions
            out_lo[r, sl] = np.where(tr.real, tr.node_lo + node_base, PAD_NODE)
            out_hi[r, sl] = np.where(tr.real, tr.node_hi + node_base, PAD_NODE)
            out_prev[r, sl] = np.where(tr.prev >= 0, tr.prev + offset, -1)
            out_pair[r, k * W:(k + 1) * W] = np.where(tr.pair_valid, tr.pair_index + offset, 0)
            out_valid[r, k * W:(k + 1) * W] = tr.pair_valid
            out_leaf[r, k * W:(k + 1) * W] = p * W + np.arange(W)
            offset += n
            node_base += tr.num_nodes
            unique += int(tr.real.sum())
    # Padding: each pad token its own node number above every real one, so it sees only itself (module docstring).
    pad_RxL = out_lo >= PAD_NODE
    out_lo = np.where(pad_RxL, PAD_NODE + np.arange(L, dtype=np.int32)[None, :], out_lo)
    out_hi = np.where(pad_RxL, out_lo, out_hi)
    return out_tok, out_pos, out_lo, out_hi, out_prev, out_pair, out_valid, out_leaf, unique


def _spread(sizes: list[int], rows: list[list[int]], R: int, L: int, cap: int) -> list[list[int]]:
    """Worst-fit decreasing of the trees over ``R`` rows of ``L`` tokens (at most ``cap`` trees a row); ``rows``
    (the first-fit placement) when some tree would not fit."""
    out: list[list[int]] = [[] for _ in range(R)]
    free = [L] * R
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = max((r for r in range(R) if len(out[r]) < cap), key=lambda r: free[r], default=None)
        if r is None or free[r] < sizes[i]:
            return rows
        out[r].append(i)
        free[r] -= sizes[i]
    return [r for r in out if r] + [r for r in out if not r]


def tree_token_bound(prompt_width: int, num_leaves: int, response_length: int, num_nodes: int,
                     node_length: int, align: int = 1) -> int:
    """An upper bound on the packed tokens of one tree (prompt + unique response tokens, alignment included)::

        ceil_a(Lp) + min(W T, (N - 1) S) + (N - 1)(a - 1)

    ``Lp`` the prompt width, ``W`` leaves of ``T`` response tokens, ``N`` node slots (the root included) of at
    most ``S`` tokens each (``node_length``: the segment length; ``T`` for a span forest, whose turns may be
    any length), ``a`` = ``align`` (every node padded to a multiple of it). A tree's response tokens are its
    non-root nodes', at most ``N - 1`` of at most ``S`` each, and at most all ``W T`` of its leaves'."""
    a = max(int(align), 1)
    nodes = max(int(num_nodes) - 1, 1)
    return (_round_up(int(prompt_width), a) + min(int(num_leaves) * int(response_length), nodes * int(node_length))
            + nodes * (a - 1))


def startup_layout(config: PackingConfig, *, prompt_width: int, num_leaves: int, response_length: int,
                   num_nodes: int, node_length: int, trees: int, row_multiple: int = 1) -> tuple[int, int, int]:
    """The layout ``(R, L, Wr)`` a sticky run starts from (module docstring): ``L`` = ``config.row_length`` or the
    bucketed :func:`tree_token_bound`; with ``config.startup_rows == "min"``, ``R = row_multiple`` and ``Wr = W *
    2^k >= W * min(trees, max_trees_per_row)`` (``trees``: the trees of one mini-batch); with ``"max"``, one tree
    per row: ``R = trees`` rounded up to ``row_multiple`` and ``Wr = W``."""
    if config.row_length is not None:
        L = config.row_length
    else:
        L = bucket_row_length(tree_token_bound(prompt_width, num_leaves, response_length, num_nodes, node_length,
                                               config.align), config.granule)
    if config.startup_rows == "max":
        return _round_up(max(int(trees), 1), int(row_multiple)), int(L), int(num_leaves)
    per_row = max(min(int(trees), config.max_trees_per_row or int(trees)), 1)
    return int(row_multiple), int(L), int(num_leaves) * (1 << (per_row - 1).bit_length())


class LayoutFloor:
    """A sticky run's layout ``(R, L, Wr)`` (host state, module docstring).

    ``shape`` is ``None`` until :meth:`start` (the start-up layout) or the first :meth:`grow`; :meth:`grow` takes a
    plan's shape and keeps the elementwise maximum (sizes only grow); ``layouts`` holds every distinct layout
    planned (one compile of the update each)."""

    def __init__(self):
        self.shape: tuple[int, int, int] | None = None
        self.layouts: set[tuple[int, int, int]] = set()
        self.max_rows: int | None = None  # one tree per row (set by start): the ladder's top
        self.precompiled: int | None = None  # ahead-of-time compiles done (None: not started)
        self.thread = None  # the ahead-of-time compile thread and its stop event (treejax.rl.step.start_ladder)
        self.stop = None

    def start(self, shape: tuple[int, int, int], max_rows: int | None = None) -> None:
        if self.shape is None:
            self.shape = tuple(int(x) for x in shape)
            self.max_rows = max_rows

    def ladder(self) -> list[int]:
        """The row counts a growth can reach from the current layout (``row_multiple * 2^k``, capped at one tree
        per row, as :func:`plan_packing` rounds them), smallest first; ``[]`` before :meth:`start`."""
        if self.shape is None or self.max_rows is None:
            return []
        R, out = self.shape[0], []
        step = R
        while step < self.max_rows:
            step = min(2 * step, self.max_rows)
            out.append(step)
        return out

    def grow(self, shape: tuple[int, int, int]) -> None:
        self.layouts.add(tuple(shape))
        self.shape = tuple(shape) if self.shape is None else tuple(max(a, b) for a, b in zip(self.shape, shape))


# ----------------------------------------------------------------------------------------------- per-pair arrays
def pack_pairs(plan: PackingPlan | TreeInputs | jax.Array, x_BxT: jax.Array, fill=0) -> jax.Array:
    """Per-pair array of the whole forest ``[P * W, T]`` (leaf ``b = p * W + w``) -> ``[R, Wr, T]`` in the packed
    slots (``fill`` in empty slots). Jittable in the arrays; ``plan`` (or a ``leaf_id [R, Wr]`` array) supplies
    the leaf of each slot."""
    leaf = jnp.asarray(getattr(plan, "leaf_id", plan))
    out = jnp.take(x_BxT, jnp.maximum(leaf, 0), axis=0)
    return jnp.where((leaf >= 0).reshape(leaf.shape + (1,) * (x_BxT.ndim - 1)), out, jnp.asarray(fill, x_BxT.dtype))


def unpack_pairs(batch: TreeInputs | PackingPlan, x_RxWrxT: jax.Array, num_leaves_total: int,
                 out: jax.Array | None = None) -> jax.Array:
    """Inverse of :func:`pack_pairs`: ``[R, Wr, T]`` -> ``[num_leaves_total, T]`` (rows of leaves not in the batch
    keep ``out``'s values, zeros by default)."""
    leaf = jnp.asarray(batch.leaf_id).reshape(-1)
    vals = x_RxWrxT.reshape((-1,) + x_RxWrxT.shape[2:])
    if out is None:
        out = jnp.zeros((num_leaves_total,) + x_RxWrxT.shape[2:], x_RxWrxT.dtype)
    return out.at[jnp.where(leaf >= 0, leaf, num_leaves_total)].set(vals, mode="drop")


PLAN_ARRAYS = ("tokens", "positions", "node_lo", "node_hi", "prev", "pair_index", "pair_valid", "leaf_id")


def plan_arrays(plan: PackingPlan) -> dict[str, np.ndarray]:
    """The plan's arrays by name (what :func:`assemble` needs besides the per-pair inputs)."""
    return {k: getattr(plan, k) for k in PLAN_ARRAYS}


@functools.partial(jax.jit, static_argnames=("num_sequences", "sequence_length"))
def assemble(arrays: dict[str, jax.Array], pairs: dict[str, jax.Array], eps_scale_B: jax.Array | None, *,
             num_sequences: int, sequence_length: int) -> Batch:
    """Jitted body of :func:`packed_batch`: gathers the per-pair arrays into the plan's slots."""
    leaf = arrays["leaf_id"]
    packed = {k: pack_pairs(leaf, jnp.asarray(v, jnp.float32), fill=PAIR_FILL.get(k, 0)) for k, v in pairs.items()}
    packed["loss_mask"] = jnp.where(arrays["pair_valid"], packed["loss_mask"], 0.0)
    eps = None if eps_scale_B is None else pack_pairs(leaf, jnp.asarray(eps_scale_B, jnp.float32), fill=1.0)
    inputs = TreeInputs(tokens=arrays["tokens"], positions=arrays["positions"], node_lo=arrays["node_lo"],
                        node_hi=arrays["node_hi"], prev=arrays["prev"], pair_index=arrays["pair_index"], leaf_id=leaf)
    return Batch(inputs=inputs, eps_scale=eps, num_sequences=num_sequences, sequence_length=sequence_length, **packed)


def packed_batch(plan: PackingPlan, pairs: dict[str, jax.Array], eps_scale_B: jax.Array | None = None
                 ) -> Batch:
    """The packed :class:`~treejax.rl.batch.Batch` of ``plan`` with per-pair arrays ``pairs`` in the forest's leaf layout
    ``[P * W, T]`` (``loss_mask``, ``advantages`` and ``old_logp`` required; ``sampler_logp`` / ``ref_logp`` /
    ``token_eps_scale`` optional; empty slots get 0, ``token_eps_scale`` 1) and an optional per-leaf
    ``eps_scale_B [P * W]``. ``loss_mask`` is narrowed to ``pair_valid``."""
    for k in ("loss_mask", "advantages", "old_logp"):
        if k not in pairs:
            raise ValueError(f"packed_batch: pairs is missing {k!r}; required: loss_mask, advantages, old_logp")
    unknown = set(pairs) - set(PAIR_KEYS)
    if unknown:
        raise ValueError(f"packed_batch: unknown pair arrays {sorted(unknown)}; allowed: {PAIR_KEYS}")
    return assemble(plan_arrays(plan), dict(pairs), eps_scale_B, num_sequences=plan.num_sequences,
                    sequence_length=plan.sequence_length)


def forest_pairs(forest: Forest, advantages_PxWxT: jax.Array, loss_mask_PxWxT: jax.Array | None = None,
                 token_eps_scale_PxWxT: jax.Array | None = None) -> dict[str, jax.Array]:
    """The forest's per-pair arrays in leaf layout ``[P * W, T]``, as :func:`treejax.rl.batch.forest_to_batch` fills
    them: ``loss_mask`` (0 past each leaf and on observation tokens, ``Forest.policy_mask``), ``advantages``, the
    sampler's log-probs as both ``old_logp`` and ``sampler_logp``, and with ``token_eps_scale_PxWxT`` (an
    estimator's ``Advantages.clip_scale``) ``token_eps_scale`` (1 off the policy tokens)."""
    P, W, T = forest.tokens.shape
    mask = forest.loss_mask if loss_mask_PxWxT is None else loss_mask_PxWxT
    valid = forest.segment_index >= 0
    trained = forest.policy_tokens() > 0  # observation tokens are in the rows, never in the loss
    flat = lambda x: jnp.asarray(x, jnp.float32).reshape(P * W, T)  # noqa: E731
    sampler = flat(jnp.where(valid, forest.logprobs, 0.0))
    out = {"loss_mask": flat(jnp.where(trained, mask, 0.0)),
           "advantages": flat(jnp.where(valid, advantages_PxWxT, 0.0)), "old_logp": sampler, "sampler_logp": sampler}
    if token_eps_scale_PxWxT is not None:
        out["token_eps_scale"] = flat(jnp.where(trained, token_eps_scale_PxWxT, 1.0))
    return out


def host_forest(prompt_tokens_PxLp, prompt_lengths_P, forest: Forest, loss_mask_BxT) -> dict[str, np.ndarray]:
    """What :func:`plan_packing` reads, as NumPy on this process: ``prompts``, ``lengths``, the leaves' ``path``,
    ``length`` and ``tokens``, the forest's ``node_parent`` / ``node_depth``, its nodes' ``spans``
    (:meth:`~treejax.forest.Forest.spans`), ``segment_length`` and ``trained [P, W]`` (a leaf with any token in
    the loss).

    The plan is host code over the whole forest, so in a multi-process run every process gathers the global
    arrays (one all-gather, :func:`treejax.parallel.multihost.host_tree`): ``np.asarray`` / ``jax.device_get``
    refuse arrays that span other processes' devices (on 2 GPUs the sampler's forest is sharded over the rows)."""
    P, W = forest.leaf_length.shape
    host = host_tree({"mask": loss_mask_BxT, "path": forest.leaf_path, "length": forest.leaf_length,
                      "tokens": forest.tokens, "prompts": prompt_tokens_PxLp, "lengths": prompt_lengths_P,
                      "node_parent": forest.node_parent, "node_depth": forest.node_depth, "spans": forest.spans()})
    host["trained"] = host.pop("mask").reshape(P, W, -1).max(-1) > 0
    host["segment_length"] = forest.segment_length
    host["fixed_segments"] = forest.fixed_segments
    return host


def forest_to_packed(prompt_tokens_PxLp, prompt_lengths_P, forest: Forest, advantages_PxWxT,
                     loss_mask_PxWxT=None, pad_id: int = 0, eps_scale_PxW=None,
                     config: PackingConfig = PackingConfig(), *, prompts=None, row_multiple: int = 1,
                     token_eps_scale_PxWxT=None) -> Batch:
    """The packed counterpart of :func:`treejax.rl.batch.forest_to_batch` (same arguments, same loss): plans on
    the host (:func:`plan_packing`), then places the per-pair arrays (:func:`packed_batch`). Not jittable (the
    plan's shapes depend on the forest); ``prompts`` selects a subset of the trees (a mini-batch)."""
    pairs = forest_pairs(forest, advantages_PxWxT, loss_mask_PxWxT, token_eps_scale_PxWxT)
    P, W = forest.leaf_length.shape
    host = host_forest(prompt_tokens_PxLp, prompt_lengths_P, forest, pairs["loss_mask"])
    plan = plan_packing(host["prompts"], host["lengths"], host["path"], host["length"], host["tokens"],
                        host["segment_length"], config, prompts=prompts, trained_PxW=host["trained"],
                        row_multiple=row_multiple, pad_id=pad_id, node_parent_PxN=host["node_parent"],
                        node_depth_PxN=host["node_depth"], node_span_PxNx2=host["spans"])
    eps = None if eps_scale_PxW is None else jnp.asarray(eps_scale_PxW, jnp.float32).reshape(P * W)
    return packed_batch(plan, pairs, eps)


def describe(plan: PackingPlan) -> dict[str, Any]:
    """Sizes of a plan (for logs and benchmarks): rows, row length, leaf slots, unique vs expanded tokens."""
    R, L, Wr = plan.shape
    return {"rows": R, "row_length": L, "leaf_slots": Wr, "unique_tokens": plan.unique_tokens,
            "expanded_tokens": plan.expanded_tokens, "fill": plan.unique_tokens / max(R * L, 1),
            "token_saving": plan.expanded_tokens / max(plan.unique_tokens, 1)}


__all__ = ["PackingConfig", "PackingPlan", "LayoutFloor", "plan_packing", "startup_layout", "tree_token_bound",
           "pack_pairs", "unpack_pairs", "packed_batch", "assemble", "plan_arrays", "forest_pairs", "host_forest",
           "forest_to_packed", "bucket_row_length", "STARTUP_ROWS", "bucket_units", "describe", "PAD_NODE"]
