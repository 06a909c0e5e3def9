"""A picture of one prompt's rollout tree (PNG or SVG) from the shared :class:`~treejax.forest.Forest`.

Nodes are segments: x = depth (segment index + 1; the prompt/root at 0), y = the node's place in a depth-first
leaf order (a node sits at the mean height of its children, so subtrees never cross). Each node is colored by its
value, the mean reward of the leaves under it:

    V(p, n) = sum_w R[p, w] * [leaf_path[p, w, depth(n)] == n] / sum_w [leaf_path[p, w, depth(n)] == n]

Leaves (the end node of each of the W rollouts) get a marker for their finish reason (``NodeStatus``: why decoding
stopped, which says nothing about the answer) and their reward written next to them, with a check or a cross when
the verifier's results are given (``correct``). The colour scale is the run's reward range when given
(``reward_range``), so one colour means one value in every picture of a run. Pruned nodes are crossed out. Matplotlib's object API is used without pyplot, so
drawing never changes the global backend (safe in notebooks and headless servers).
"""

from __future__ import annotations

import os
import textwrap
import warnings
from typing import Any, Sequence

import numpy as np

from treejax.forest import Forest, NodeStatus

_LEAF_MARKERS = {
    NodeStatus.FINISHED: ("o", "stop token + answer predicate"),
    NodeStatus.EOS: ("s", "stop token"),
    NodeStatus.TRUNCATED: (">", "truncated (length/depth)"),
    NodeStatus.REPETITION: ("X", "repetition stop"),
    NodeStatus.PRUNED: ("x", "pruned"),
    NodeStatus.ALIVE: ("^", "alive (unfinished)"),
    NodeStatus.UNUSED: ("d", "unused"),
}


def node_values(leaf_path_PxWxD1: Any, node_depth_PxN: Any, rewards_PxW: Any) -> np.ndarray:
    """``[P, N]`` mean reward of the leaves under each node (formula in the module docstring); NaN for unused
    nodes and nodes with no leaf below them."""
    path = np.asarray(leaf_path_PxWxD1)
    depth = np.asarray(node_depth_PxN)
    rewards = np.asarray(rewards_PxW, np.float64)
    P, N = depth.shape
    D1 = path.shape[-1]
    # under[p, n, w] = leaf w passes through node n  (path at the node's depth equals n)
    d_clipped = np.clip(depth, 0, D1 - 1)  # [P, N]
    at_depth = np.take_along_axis(path, np.broadcast_to(d_clipped[:, None, :], (P, path.shape[1], N)), axis=2)
    under = (at_depth == np.arange(N)[None, None, :]) & (depth >= 0)[:, None, :]  # [P, W, N]
    count = under.sum(axis=1)
    total = np.einsum("pwn,pw->pn", under.astype(np.float64), rewards)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def tree_layout(forest: Forest, prompt: int = 0) -> dict[int, tuple[float, float]]:
    """``{node id: (x, y)}`` for the used nodes of one prompt: x = depth, y = depth-first leaf order."""
    parent = np.asarray(forest.node_parent[prompt])
    depth = np.asarray(forest.node_depth[prompt])
    used = np.flatnonzero(depth >= 0)
    children: dict[int, list[int]] = {int(n): [] for n in used}
    for n in used:
        if parent[n] >= 0:
            children[int(parent[n])].append(int(n))
    pos: dict[int, tuple[float, float]] = {}
    next_row = [0.0]

    def place(n: int) -> float:  # iterative-depth recursion is fine: depth <= D (tens of segments)
        kids = sorted(children[n])
        if not kids:
            y = next_row[0]
            next_row[0] += 1.0
        else:
            y = float(np.mean([place(k) for k in kids]))
        pos[n] = (float(depth[n]), y)
        return y

    place(0)
    return pos


def _one_line(text: str, chars: int, tail: bool = True) -> str:
    """``text`` on one line (whitespace collapsed), its last (``tail``) or first ``chars`` characters."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    if len(flat) <= chars:
        return flat
    return "\u2026" + flat[-chars:] if tail else flat[:chars] + "\u2026"


def draw_tree(forest: Forest, rewards: Any, path: str | os.PathLike, prompt: int = 0, *,
              title: str | None = None, cmap: str = "RdYlGn", dpi: int = 120,
              reward_range: tuple[float, float] | None = None, correct: Any = None, prompt_text: str | None = None,
              leaf_texts: Sequence[str] | None = None, text_chars: int = 60) -> str:
    """Draws prompt ``prompt``'s tree to ``path`` (format from the suffix: ``.png`` or ``.svg``); returns the path.

    ``rewards``: ``[P, W]`` (or ``[W]`` for the drawn prompt) leaf rewards. ``reward_range``: the colour scale's
    ``(low, high)``; give the run's reward range so colours mean the same in every picture (default: this
    tree's own min/max, so an all -1 tree would be drawn neutral). ``correct``: optional ``[P, W]`` / ``[W]``
    verifier results, drawn as a check or a cross next to each leaf's reward (the finish reason says only why
    decoding stopped, not whether the answer was right). ``prompt_text``: the prompt, shown under the title;
    ``leaf_texts``: each leaf's response text (``W`` strings), its last ``text_chars`` characters shown next to
    the leaf (where the answer is), on one line.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"draw_tree: path must end in .png or .svg, got {path!r}")
    if not 0 <= prompt < forest.num_prompts:
        raise ValueError(f"draw_tree: prompt {prompt} out of range [0, {forest.num_prompts})")
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim == 1:
        rewards_W = rewards
    else:
        rewards_W = rewards[prompt]
    if rewards_W.shape != (forest.num_leaves,):
        raise ValueError(f"draw_tree: rewards must be [P, W] or [W] with W={forest.num_leaves}, got {rewards.shape}")

    if leaf_texts is not None and len(leaf_texts) != forest.num_leaves:
        raise ValueError(f"draw_tree: leaf_texts must hold W={forest.num_leaves} strings, got {len(leaf_texts)}")
    correct_W = None
    if correct is not None:
        correct = np.asarray(correct, bool)
        correct_W = correct if correct.ndim == 1 else correct[prompt]
    leaf_path = np.asarray(forest.leaf_path[prompt])
    node_depth = np.asarray(forest.node_depth[prompt])
    node_status = np.asarray(forest.node_status[prompt])
    leaf_status = np.asarray(forest.leaf_status[prompt])
    leaf_depth = np.sum(leaf_path[:, 1:] >= 0, axis=-1)
    values = node_values(leaf_path[None], node_depth[None], rewards_W[None])[0]
    pos = tree_layout(forest, prompt)
    lo, hi = reward_range if reward_range is not None else (float(np.min(rewards_W)), float(np.max(rewards_W)))
    if hi <= lo:
        lo, hi = lo - 1.0, hi + 1.0
    norm = Normalize(vmin=lo, vmax=hi)

    n_rows = max(y for _, y in pos.values()) + 1
    # inches for the leaves' answers (7-point text, ~0.05 inch a character, the reward and quotes included)
    text_width = 0.05 * (text_chars + 14) if leaf_texts is not None else 0.0
    tree_width = 3.0 + 1.1 * max(forest.max_depth, 1)
    fig = Figure(figsize=(tree_width + text_width,
                          2.6 + 0.32 * n_rows + (0.5 if prompt_text else 0.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    parent = np.asarray(forest.node_parent[prompt])
    for n, (x, y) in pos.items():
        if parent[n] >= 0:
            px, py = pos[int(parent[n])]
            ax.plot([px, px + 0.5, x], [py, y, y], color="0.6", lw=1.0, zorder=1)
    nodes = sorted(pos)
    xs = [pos[n][0] for n in nodes]
    ys = [pos[n][1] for n in nodes]
    vals = [values[n] for n in nodes]
    sc = ax.scatter(xs, ys, c=vals, cmap=cmap, norm=norm, s=140, edgecolors="k", linewidths=0.6, zorder=2,
                    plotnonfinite=True)
    pruned = [n for n in nodes if node_status[n] == NodeStatus.PRUNED]
    if pruned:
        ax.scatter([pos[n][0] for n in pruned], [pos[n][1] for n in pruned], marker="x", c="k", s=90, zorder=3)

    seen: dict[int, Any] = {}
    for w in range(forest.num_leaves):
        end = int(leaf_path[w, leaf_depth[w]])
        x, y = pos[end]
        status = NodeStatus(int(leaf_status[w]))
        marker, label = _LEAF_MARKERS[status]
        ax.scatter([x + 0.28], [y], marker=marker, s=55, color="k", zorder=3)
        mark = ""
        if correct_W is not None:
            mark = " \u2713" if correct_W[w] else " \u2717"
        answer = f"  {_one_line(leaf_texts[w], text_chars)!r}" if leaf_texts is not None else ""
        ax.annotate(f"{rewards_W[w]:+.2f}{mark}{answer}", (x + 0.4, y), va="center", fontsize=7,
                    annotation_clip=False)
        seen[int(status)] = Line2D([], [], marker=marker, color="k", ls="", label=label)
    handles = [seen[k] for k in sorted(seen)]
    if correct_W is not None:
        handles.append(Line2D([], [], ls="", label="\u2713 / \u2717: verifier says correct / wrong"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3,
              fontsize=7, title="leaf finish reason", title_fontsize=7, frameon=False)
    fig.colorbar(sc, ax=ax, label="value (mean leaf reward)", fraction=0.05)
    ax.set_xlabel("depth (segment)")
    ax.set_xticks(range(forest.max_depth + 1))
    ax.set_yticks([])
    ax.invert_yaxis()
    # the tree keeps its scale (data units per inch of the plot without text); the answers get the added width
    units_per_inch = (forest.max_depth + 1.4) / max(tree_width - 1.6, 1.0)
    ax.set_xlim(-0.4, forest.max_depth + 1.0 + text_width * units_per_inch)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    n_pruned = int(np.sum(leaf_status == NodeStatus.PRUNED))
    heading = title or (f"prompt {prompt}: {forest.num_leaves} leaves, segment length {forest.segment_length}"
                        + (f", {n_pruned} pruned" if n_pruned else ""))
    if prompt_text:
        heading += "\n" + "\n".join(textwrap.wrap("prompt: " + _one_line(prompt_text, 240, tail=False), 100))
    ax.set_title(heading, fontsize=9)
    with warnings.catch_warnings():  # a model's text may hold characters the font lacks: drawn as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, dpi=dpi, format=ext[1:])
    return path
