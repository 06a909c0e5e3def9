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

Trees of turns (multi-turn rollouts, :class:`~treejax.sampling.turns.TurnTree`): :func:`draw_turn_tree` draws
a box per turn (its action, its observation, its kind: tool call ran / tool error / answer / no answer, the slots
through it and the leaf's reward, forks marked), :func:`turn_tree_text` prints the same tree as an indented
outline; both read the tree through :func:`turn_boxes`, which checks it first.
"""

from __future__ import annotations

import dataclasses
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

    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"draw_tree: path must end in .png or .svg, got {path!r}")
    if not 0 <= prompt < forest.num_prompts:
        raise ValueError(f"draw_tree: prompt {prompt} out of range [0, {forest.num_prompts})")
    rewards_W, correct_W = _leaf_values(forest, prompt, rewards, correct, leaf_texts)
    values = node_values(np.asarray(forest.leaf_path[prompt])[None], np.asarray(forest.node_depth[prompt])[None],
                         rewards_W[None])[0]
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
    sc = _draw_nodes(ax, forest, prompt, pos, values, cmap, norm)
    handles = _draw_leaves(ax, forest, prompt, pos, rewards_W, correct_W, leaf_texts, text_chars)
    _finish_tree_axes(fig, ax, sc, handles, forest, prompt, title, prompt_text, tree_width, text_width)
    with warnings.catch_warnings():  # a model's text may hold characters the font lacks: drawn as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(path, dpi=dpi, format=ext[1:])
    return path


def _leaf_values(forest: Forest, prompt: int, rewards: Any, correct: Any,
                 leaf_texts: Sequence[str] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The drawn prompt's ``rewards_W`` and ``correct_W`` (None when not given), from ``[P, W]`` or ``[W]``
    arrays; checks that they and ``leaf_texts`` have ``W`` entries."""
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
    return rewards_W, correct_W


def _draw_nodes(ax: Any, forest: Forest, prompt: int, pos: dict, values: np.ndarray, cmap: str, norm: Any) -> Any:
    """The edges (parent -> child, elbow lines) and the nodes coloured by value, pruned nodes crossed out; returns
    the nodes' scatter (for the colour bar)."""
    node_status = np.asarray(forest.node_status[prompt])
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
    return sc


def _draw_leaves(ax: Any, forest: Forest, prompt: int, pos: dict, rewards_W: np.ndarray, correct_W: Any,
                 leaf_texts: Sequence[str] | None, text_chars: int) -> list:
    """Each leaf's finish-reason marker and its reward (with the verifier's check or cross and the end of its text
    when given) next to its end node; returns the legend's handles (one per finish reason drawn)."""
    from matplotlib.lines import Line2D

    leaf_path = np.asarray(forest.leaf_path[prompt])
    leaf_status = np.asarray(forest.leaf_status[prompt])
    leaf_depth = np.sum(leaf_path[:, 1:] >= 0, axis=-1)
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
    return handles


def _finish_tree_axes(fig: Any, ax: Any, sc: Any, handles: list, forest: Forest, prompt: int, title: str | None,
                      prompt_text: str | None, tree_width: float, text_width: float) -> None:
    """The legend, the colour bar, the depth axis (the tree keeps its scale, the leaves' texts get the added
    width) and the title (default: the tree's size; the prompt's text under it)."""
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
    n_pruned = int(np.sum(np.asarray(forest.leaf_status[prompt]) == NodeStatus.PRUNED))
    heading = title or (f"prompt {prompt}: {forest.num_leaves} leaves, segment length {forest.segment_length}"
                        + (f", {n_pruned} pruned" if n_pruned else ""))
    if prompt_text:
        heading += "\n" + "\n".join(textwrap.wrap("prompt: " + _one_line(prompt_text, 240, tail=False), 100))
    ax.set_title(heading, fontsize=9)


# ------------------------------------------------------------------------------------------ trees of turns
TURN_KINDS = {  # kind -> (box colour, legend text)
    "root": ("white", "prompt"),
    "tool ok": ("#cfe2f3", "tool call, ran"),
    "tool error": ("#f4b6b6", "tool call, error"),
    "answer": ("#c9e7c1", "answer"),
    "no answer": ("#d9d9d9", "no answer (limit reached / none given)"),
    "turn": ("#fff2cc", "other turn"),
}


@dataclasses.dataclass(frozen=True)
class TurnBox:
    """What the pictures show of one node of a :class:`~treejax.sampling.turns.TurnTree`: ``node`` id,
    ``parent``, ``depth``, ``kind`` (a key of :data:`TURN_KINDS`), the abbreviated ``action`` (the turn's
    code or answer line) and ``observation``, the number of ``slots`` through it, its ``children``, and
    ``value`` (mean episode reward of those slots). ``reward`` / ``status``: the episode's total reward and
    status for a leaf (a node no path goes past), else None."""

    node: int
    parent: int
    depth: int
    kind: str
    action: str
    observation: str
    slots: int
    children: tuple[int, ...]
    value: float
    reward: float | None = None
    status: str | None = None


def turn_kind(info: dict, last: bool, status: str) -> str:
    """A turn's kind from its step ``info`` (the keys :class:`~treejax.envs.code_tool.CodeToolEnv` writes),
    whether it is its episode's ``last`` turn and the episode's ``status``:

    * ``info["tool_error"]`` present: "tool error" when true, else "tool ok";
    * ``info["answered"]`` false (no answer given, or the tool-call limit ended the episode): "no answer";
    * otherwise the last turn: "answer" when the environment ended the episode (``status == "done"``), else
      "no answer" (``max_turns`` / ``max_tokens``); any other turn: "turn"."""
    if "tool_error" in info:
        return "tool error" if info["tool_error"] else "tool ok"
    if info.get("answered") is False:
        return "no answer"
    if last:
        return "answer" if status == "done" else "no answer"
    return "turn"


def _action_summary(text: str, max_chars: int) -> str:
    """The code of a ``<code>...</code>`` call (its first ``max_chars`` characters), else the turn's
    ``Answer:`` line or last non-empty line (its last ``max_chars``), on one line."""
    from treejax.envs.code_tool import extract_code

    code = extract_code(text)
    if code is not None:
        return _one_line(code, max_chars, tail=False)
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    answers = [ln for ln in lines if ln.strip().lower().startswith("answer")]
    return _one_line(answers[-1] if answers else (lines[-1] if lines else ""), max_chars)


def _observation_summary(text: str, kind: str, max_chars: int) -> str:
    """The observation without ``<output>`` tags, on one line: its end for a tool error (where the error is),
    else its start."""
    flat = str(text).replace("<output>", " ").replace("</output>", " ")
    return _one_line(flat, max_chars, tail=kind == "tool error")


def _check_turn_tree(tree: Any, where: str) -> None:
    """Raises ValueError (TypeError for a non-tree) naming what is wrong with ``tree``."""
    if not all(hasattr(tree, a) for a in ("nodes", "slot_path", "slot_episode")):
        raise TypeError(f"{where}: expected a TurnTree (nodes, slot_path, slot_episode), got {type(tree).__name__}")
    nodes = tree.nodes
    if not nodes or nodes[0].parent != -1 or nodes[0].depth != 0:
        raise ValueError(f"{where}: node 0 must be the root (parent -1, depth 0)")
    for n, node in enumerate(nodes[1:], start=1):
        if not 0 <= node.parent < n:
            raise ValueError(f"{where}: node {n} has parent {node.parent}; a parent must be an earlier node")
        if node.depth != nodes[node.parent].depth + 1:
            raise ValueError(f"{where}: node {n} has depth {node.depth}, its parent {node.parent} depth "
                             f"{nodes[node.parent].depth}")
        if not 0 <= node.start <= node.end:
            raise ValueError(f"{where}: node {n} spans [{node.start}, {node.end})")
    if not tree.slot_path or len(tree.slot_path) != len(tree.slot_episode):
        raise ValueError(f"{where}: {len(tree.slot_path)} slot paths and {len(tree.slot_episode)} slot episodes")
    seen = {0}
    for s, (sp, ep) in enumerate(zip(tree.slot_path, tree.slot_episode)):
        if ep is None or len(sp) < 2 or sp[0] != 0:
            raise ValueError(f"{where}: slot {s} holds no episode or its path {sp} does not start at the root "
                             "and reach a turn")
        for a, b in zip(sp[:-1], sp[1:]):
            if not 0 < b < len(nodes) or nodes[b].parent != a:
                raise ValueError(f"{where}: slot {s}'s path {sp} does not follow the nodes' parents ({a} -> {b})")
        if nodes[sp[-1]].end > len(ep.tokens):
            raise ValueError(f"{where}: slot {s}'s last node ends at {nodes[sp[-1]].end}, past its episode's "
                             f"{len(ep.tokens)} tokens")
        if len(ep.rewards) < len(sp) - 1:
            raise ValueError(f"{where}: slot {s}'s episode has {len(ep.rewards)} step rewards for {len(sp) - 1} "
                             "turns")
        seen.update(sp)
    missing = sorted(set(range(len(nodes))) - seen)
    if missing:
        raise ValueError(f"{where}: nodes {missing} lie on no slot's path")


def turn_boxes(tree: Any, tokenizer: Any, max_chars: int = 32, where: str = "turn_boxes") -> list[TurnBox]:
    """One :class:`TurnBox` per node of ``tree`` (a :class:`~treejax.sampling.turns.TurnTree`, checked
    first), node 0 the root. Node ``n`` at depth ``d`` is the ``d``-th policy turn of the episodes through it:
    its action is the policy span inside the node's tokens, its observation the environment spans after it (a
    path's reset observation, before its first turn, is not shown); its kind :func:`turn_kind` of the
    episode's ``infos[d - 1]``. ``tokenizer.decode(ids, skip_special_tokens=True)`` gives the texts."""
    _check_turn_tree(tree, where)
    if max_chars < 4:
        raise ValueError(f"{where}: max_chars must be >= 4, got {max_chars}")
    nodes = tree.nodes
    through: dict[int, list[int]] = {n: [] for n in range(len(nodes))}
    for s, sp in enumerate(tree.slot_path):
        for n in sp:
            through[n].append(s)
    children: dict[int, list[int]] = {n: [] for n in range(len(nodes))}
    for n, node in enumerate(nodes[1:], start=1):
        children[node.parent].append(n)
    rewards = [float(ep.reward) for ep in tree.slot_episode]
    boxes = []
    for n, node in enumerate(nodes):
        slots = through[n]
        value = float(np.mean([rewards[s] for s in slots]))
        kids = tuple(sorted(children[n]))
        if n == 0:
            boxes.append(TurnBox(0, -1, 0, "root", "", "", len(slots), kids, value))
            continue
        ep = tree.slot_episode[slots[0]]
        spans = [(max(a, node.start), min(b, node.end), k) for a, b, k in ep.turns if a < node.end and b > node.start]
        policy = [(a, b) for a, b, k in spans if k == "policy"]
        act_ids = ep.tokens[policy[0][0]:policy[0][1]] if policy else []
        after = policy[0][1] if policy else node.start
        obs_ids = [t for a, b, k in spans if k != "policy" and a >= after for t in ep.tokens[a:b]]
        leaf = not kids
        kind = turn_kind(ep.infos[node.depth - 1] if len(ep.infos) >= node.depth else {},
                         leaf and node.depth == ep.policy_turns, ep.status)
        action = _action_summary(tokenizer.decode(list(act_ids), skip_special_tokens=True), max_chars)
        observation = _observation_summary(tokenizer.decode(list(obs_ids), skip_special_tokens=True), kind,
                                           max_chars)
        boxes.append(TurnBox(n, node.parent, node.depth, kind, action, observation, len(slots), kids, value,
                             float(ep.reward) if leaf else None, ep.status if leaf else None))
    return boxes


def _box_label(b: TurnBox, prompt_text: str | None, num_slots: int, forks: int, max_chars: int) -> str:
    if b.node == 0:
        lines = ["prompt"] + (textwrap.wrap(_one_line(prompt_text, 3 * max_chars, tail=False), max_chars)
                              if prompt_text else [])
        return "\n".join(lines + [f"{num_slots} slots, {forks} fork{'s' if forks != 1 else ''}"])
    head = f"[{b.node}] {b.kind}" + (f"  fork x{len(b.children)}" if len(b.children) > 1 else "")
    lines = [head, f"> {b.action}" if b.action else "> (empty)"]
    if b.observation:
        lines.append(f"< {b.observation}")
    s = f"{b.slots} slot{'s' if b.slots != 1 else ''}"
    lines.append(f"{s}  R={b.reward:+.2f} {b.status}" if b.reward is not None else f"{s}  V={b.value:+.2f}")
    return "\n".join(lines)


def turn_tree_text(tree: Any, tokenizer: Any, *, prompt_text: str | None = None, max_chars: int = 40) -> str:
    """An indented outline of one prompt's tree of turns (a :class:`~treejax.sampling.turns.TurnTree`), for
    notebooks and logs: a line for the prompt, then one line per turn node, depth-first (children by node id),
    indented two spaces a level::

        prompt: What is 2+3?  (4 slots, 1 fork)
          [1] tool ok: print(2+3) => 5  (4 slots, fork x2, V=+0.50)
            [2] answer: Answer: 5  (2 slots, R=+1.00 done)
            [3] answer: Answer: 6  (2 slots, R=+0.00 done)

    Each turn shows its kind (:func:`turn_kind`), its action (the code of a call, or the answer line) and its
    observation after ``=>`` (both cut to ``max_chars`` characters; the prompt to ``3 max_chars``), the slots (samples) through it, and the
    value (mean reward of those slots) or, at a leaf, the episode's reward and status."""
    boxes = turn_boxes(tree, tokenizer, max_chars, where="turn_tree_text")
    root = boxes[0]
    forks = int(getattr(tree, "forks", 0))
    head = f"prompt: {_one_line(prompt_text, 3 * max_chars, tail=False)}" if prompt_text else "prompt"
    lines = [f"{head}  ({root.slots} slots, {forks} fork{'s' if forks != 1 else ''})"]

    def visit(n: int) -> None:
        b = boxes[n]
        text = f"{'  ' * b.depth}[{n}] {b.kind}: {b.action}" + (f" => {b.observation}" if b.observation else "")
        extra = [f"{b.slots} slot{'s' if b.slots != 1 else ''}"]
        if len(b.children) > 1:
            extra.append(f"fork x{len(b.children)}")
        extra.append(f"R={b.reward:+.2f} {b.status}" if b.reward is not None else f"V={b.value:+.2f}")
        lines.append(f"{text}  ({', '.join(extra)})")
        for k in b.children:
            visit(k)

    for k in root.children:
        visit(k)
    return "\n".join(lines)


def draw_turn_tree(tree: Any, tokenizer: Any, *, prompt_text: str | None = None, max_chars: int = 24,
                   ax: Any = None, title: str | None = None, path: str | os.PathLike | None = None,
                   dpi: int = 120) -> Any:
    """Draws one prompt's tree of turns (a :class:`~treejax.sampling.turns.TurnTree`); returns the figure.

    Left to right by depth, as :func:`draw_tree` (x = depth, the prompt at 0; y = depth-first leaf order, a
    node at the mean height of its children). Each node is a box coloured by its kind (:data:`TURN_KINDS`:
    tool call ran / tool error / answer / no answer, :func:`turn_kind`) showing its id, the turn's action (the
    code of a ``<code>`` call or the answer line) after ``>``, the observation after ``<`` (tool output, or the
    error's end), both cut to ``max_chars`` characters (the prompt, in the root's box, to three such lines), and the slots (samples) through it with their mean
    reward ``V``, or at a leaf the episode's reward ``R`` and status. Edges go parent -> child; the edges out
    of a fork (a turn whose conversation was copied into several children) are thick and blue, and the box
    says ``fork xk``. Artists carry ids (``gid``): ``turn-node-<n>`` for node ``n``'s box,
    ``turn-edge-<parent>-<child>`` for each edge.

    ``ax``: draw into this matplotlib Axes (default: a new Figure, object API without pyplot, so the global
    backend is untouched); ``path``: also save the figure there (``.png`` or ``.svg``)."""
    if path is not None:
        path = os.fspath(path)
        if os.path.splitext(path)[1].lower() not in (".png", ".svg"):
            raise ValueError(f"draw_turn_tree: path must end in .png or .svg, got {path!r}")
    boxes = turn_boxes(tree, tokenizer, max_chars, where="draw_turn_tree")
    forks = int(getattr(tree, "forks", 0))
    pos, rows = _turn_layout(boxes)
    depth = max(b.depth for b in boxes)
    col_in = 0.062 * (max_chars + 6) + 0.5  # inches per depth column (7-point monospace, ~0.062 inch a character)
    row_in = 0.78  # inches per leaf row (up to 4 text lines)
    own = ax is None
    if own:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(col_in * (depth + 1) + 0.4, row_in * rows + 1.6 + (0.3 if title else 0.0)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
    fig = ax.figure
    _draw_turn_boxes(ax, boxes, pos, prompt_text, forks, max_chars)
    ax.set_xlim(-0.5, depth + 0.5)
    ax.set_ylim(rows - 0.4, -0.6)
    ax.set_axis_off()
    ax.set_title(title or f"tree of turns: {boxes[0].slots} slots, {len(boxes) - 1} turns, {forks} "
                          f"fork{'s' if forks != 1 else ''}", fontsize=9)
    with warnings.catch_warnings():  # a model's text may hold characters the font lacks: drawn as boxes
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        if own:
            fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=dpi, format=os.path.splitext(path)[1][1:].lower())
    return fig


def _turn_layout(boxes: list[TurnBox]) -> tuple[dict[int, tuple[float, float]], float]:
    """``({node: (x, y)}, rows)``: the tree's own shape (children by node id), x = depth, leaves on consecutive rows
    ``y = 0, 1, ...`` in depth-first order, a node at the mean height of its children; ``rows`` leaf rows."""
    pos: dict[int, tuple[float, float]] = {}
    next_row = [0.0]

    def place(n: int) -> float:
        kids = boxes[n].children
        y = float(np.mean([place(k) for k in kids])) if kids else next_row[0]
        if not kids:
            next_row[0] += 1.0
        pos[n] = (float(boxes[n].depth), y)
        return y

    place(0)
    return pos, next_row[0]


def _draw_turn_boxes(ax: Any, boxes: list[TurnBox], pos: dict, prompt_text: str | None, forks: int,
                     max_chars: int) -> None:
    """The edges (thick and blue out of a fork), one box per node coloured by its kind (a leaf's border thicker),
    and the legend of the kinds drawn (artist ids: :func:`draw_turn_tree`)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    for b in boxes[1:]:
        (px, py), (x, y) = pos[b.parent], pos[b.node]
        fork = b.parent != 0 and len(boxes[b.parent].children) > 1
        ax.add_line(Line2D([px, px + 0.5, px + 0.5, x], [py, py, y, y], color="tab:blue" if fork else "0.55",
                           lw=2.2 if fork else 1.0, zorder=1, gid=f"turn-edge-{b.parent}-{b.node}"))
    for b in boxes:
        x, y = pos[b.node]
        colour = TURN_KINDS[b.kind][0]
        leaf = b.reward is not None
        ax.text(x, y, _box_label(b, prompt_text, boxes[0].slots, forks, max_chars), ha="center", va="center",
                fontsize=7, family="monospace", zorder=3, gid=f"turn-node-{b.node}",
                bbox=dict(boxstyle="round,pad=0.35", fc=colour, ec="k", lw=1.6 if leaf else 0.7))
    kinds = [k for k in TURN_KINDS if k != "root" and any(b.kind == k for b in boxes)]
    handles = [Patch(fc=TURN_KINDS[k][0], ec="k", lw=0.7, label=TURN_KINDS[k][1]) for k in kinds]
    handles.append(Line2D([], [], color="tab:blue", lw=2.2, label="fork (conversation copied)"))
    handles.append(Patch(fc="white", ec="k", lw=1.6, label="leaf: R = episode reward"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7,
              frameon=False)
