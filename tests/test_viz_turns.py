"""Pictures of trees of turns (treejax.viz.draw_turn_tree / turn_tree_text) on a TurnTree written by hand: a tool call
that forks into a tool error (then a right answer) and a wrong answer. No model."""

from __future__ import annotations

import copy

import pytest

from treejax.sampling.multiturn import Episode, TurnNode, TurnTree
from treejax.viz import TURN_KINDS, draw_turn_tree, turn_boxes, turn_tree_text


class _Chars:
    """One token per character (``ord``); id 0 is a special end-of-turn token dropped by ``skip_special_tokens``."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)


TOK = _Chars()
CALL = "Let me add.\n<code>print(2+3)</code>"
OUT = "\n<output>\n5\n</output>\n"
BAD_CALL = "<code>print(2+x)</code>"
ERROR = "\n<output>\n[error] NameError: name 'x' is not defined\n</output>\n"


def _turn(ep, action, observation, reward, info):
    ep._add(TOK.encode(action) + [0], [-1.0] * (len(action) + 1), policy=True)
    if observation:
        ep._add(TOK.encode(observation), [], policy=False)
    ep.rewards.append(reward)
    ep.infos.append(info)


def make_tree() -> TurnTree:
    """root -> [1] tool ok (4 slots) -> fork: [2] tool error -> [4] answer 5 (R=1, slots 0-1);
    [3] answer 6 (R=0, slots 2-3)."""
    first = Episode()
    _turn(first, CALL, OUT, 0.0, {"tool_calls": 1, "tool_error": False})
    n1 = TurnNode(0, 1, 0, len(first.tokens))
    a, b = first, copy.deepcopy(first)
    _turn(a, BAD_CALL, ERROR, 0.0, {"tool_calls": 2, "tool_error": True})
    n2 = TurnNode(1, 2, n1.end, len(a.tokens))
    _turn(b, "The sum is 6.\nAnswer: 6", "", 0.0, {"tool_calls": 1, "answered": True})
    n3 = TurnNode(1, 2, n1.end, len(b.tokens))
    _turn(a, "So it is 5.\nAnswer: 5", "", 1.0, {"tool_calls": 2, "answered": True})
    n4 = TurnNode(2, 3, n2.end, len(a.tokens))
    a.status = b.status = "done"
    return TurnTree([TurnNode(-1, 0, 0, 0), n1, n2, n3, n4], [[0, 1, 2, 4]] * 2 + [[0, 1, 3]] * 2, [a, a, b, b],
                    forks=1)


def test_text_outline():
    text = turn_tree_text(make_tree(), TOK, prompt_text="What is 2+3?\nUse the tool.", max_chars=24)
    assert text.splitlines() == [
        "prompt: What is 2+3? Use the tool.  (4 slots, 1 fork)",
        "  [1] tool ok: print(2+3) => 5  (4 slots, fork x2, V=+0.50)",
        "    [2] tool error: print(2+x) => \u2026 name 'x' is not defined  (2 slots, V=+1.00)",
        "      [4] answer: Answer: 5  (2 slots, R=+1.00 done)",
        "    [3] answer: Answer: 6  (2 slots, R=+0.00 done)",
    ]


def test_boxes_kinds_and_counts():
    boxes = turn_boxes(make_tree(), TOK)
    assert [b.kind for b in boxes] == ["root", "tool ok", "tool error", "answer", "answer"]
    assert [b.slots for b in boxes] == [4, 4, 2, 2, 2]
    assert [b.children for b in boxes] == [(1,), (2, 3), (4,), (), ()]
    assert [b.reward for b in boxes] == [None, None, None, 0.0, 1.0]
    # a path that stopped at the turn cap without an answer
    tree = make_tree()
    tree.slot_episode[2].status = "max_turns"
    tree.slot_episode[2].infos[-1] = {}
    assert turn_boxes(tree, TOK)[3].kind == "no answer"


def test_figure_has_a_box_per_node_and_an_edge_per_child(tmp_path):
    from matplotlib.colors import to_rgba

    tree = make_tree()
    svg = tmp_path / "turns.svg"
    fig = draw_turn_tree(tree, TOK, prompt_text="What is 2+3?", title="t", path=svg)
    ax = fig.axes[0]
    boxes = {t.get_gid(): t for t in ax.texts if (t.get_gid() or "").startswith("turn-node-")}
    assert sorted(boxes) == [f"turn-node-{n}" for n in range(5)]
    kinds = ["root", "tool ok", "tool error", "answer", "answer"]
    for n, kind in enumerate(kinds):
        patch = boxes[f"turn-node-{n}"].get_bbox_patch()
        assert patch is not None and patch.get_facecolor() == to_rgba(TURN_KINDS[kind][0])
    assert "R=+1.00 done" in boxes["turn-node-4"].get_text() and "fork x2" in boxes["turn-node-1"].get_text()
    assert "< \u2026" in boxes["turn-node-2"].get_text()  # the error's end
    edges = {ln.get_gid(): ln for ln in ax.lines if (ln.get_gid() or "").startswith("turn-edge-")}
    assert sorted(edges) == ["turn-edge-0-1", "turn-edge-1-2", "turn-edge-1-3", "turn-edge-2-4"]
    thick = sorted(g for g, ln in edges.items() if ln.get_linewidth() > 2)
    assert thick == ["turn-edge-1-2", "turn-edge-1-3"]  # the fork's edges
    assert svg.read_text().lstrip().startswith("<?xml") and "turn-node-4" in svg.read_text()


def test_draws_into_a_given_axes():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    assert draw_turn_tree(make_tree(), TOK, ax=right) is fig
    assert not left.texts and len([t for t in right.texts if t.get_gid()]) == 5


def _broken(change):
    tree = make_tree()
    change(tree)
    return tree


@pytest.mark.parametrize("change, message", [
    (lambda t: setattr(t.nodes[2], "parent", 3), "parent must be an earlier node"),
    (lambda t: setattr(t.nodes[3], "depth", 3), "node 3 has depth 3"),
    (lambda t: t.slot_path.__setitem__(2, [0, 2, 3]), "does not follow the nodes' parents"),
    (lambda t: t.slot_episode.__setitem__(0, None), "slot 0 holds no episode"),
    (lambda t: t.slot_path.pop(), "4 slot episodes"),
    (lambda t: t.nodes.append(TurnNode(1, 2, 0, 0)), r"nodes \[5\] lie on no slot's path"),
    (lambda t: setattr(t.nodes[0], "parent", 0), "node 0 must be the root"),
    (lambda t: setattr(t.nodes[4], "end", 10_000), "past its episode's"),
])
def test_malformed_trees_are_errors(change, message):
    with pytest.raises(ValueError, match=message):
        turn_tree_text(_broken(change), TOK)
    with pytest.raises(ValueError, match="draw_turn_tree: .*" + message):
        draw_turn_tree(_broken(change), TOK)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="expected a TurnTree"):
        turn_tree_text([1, 2], TOK)
    with pytest.raises(ValueError, match=".png or .svg"):
        draw_turn_tree(make_tree(), TOK, path=tmp_path / "t.jpg")
    with pytest.raises(ValueError, match="max_chars"):
        draw_turn_tree(make_tree(), TOK, max_chars=2)
