"""Tree picture tests: node values by hand, layout, and valid PNG/SVG files for a forest from forest_from_paths."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from treejax.forest import NodeStatus, forest_from_paths
from treejax.viz import draw_tree, node_values, tree_layout

# One prompt, 5 leaves, depth <= 3, segment length 2.  Tree:  0 -> 1 -> 2 -> {4, 5};  1 -> 3;  0 -> 6 -> 7 -> 8
PATHS = np.array([[[0, 1, 2, 4], [0, 1, 2, 5], [0, 1, 3, -1], [0, 6, 7, 8], [0, 6, 9, -1]]])
LENGTHS = np.array([[6, 5, 4, 6, 3]])
STATUS = np.array([[NodeStatus.FINISHED, NodeStatus.EOS, NodeStatus.REPETITION, NodeStatus.TRUNCATED,
                    NodeStatus.PRUNED]])
REWARDS = np.array([[1.0, -1.0, 0.0, 1.0, 0.5]])


@pytest.fixture
def forest():
    return forest_from_paths(PATHS, LENGTHS, segment_length=2, leaf_status=STATUS)


def test_node_values_by_hand(forest):
    v = node_values(forest.leaf_path, forest.node_depth, REWARDS)[0]
    np.testing.assert_allclose(v[0], np.mean(REWARDS))
    np.testing.assert_allclose(v[1], (1.0 - 1.0 + 0.0) / 3)
    np.testing.assert_allclose(v[2], 0.0)
    np.testing.assert_allclose(v[6], 0.75)
    np.testing.assert_allclose([v[4], v[5], v[3], v[8], v[9]], [1.0, -1.0, 0.0, 1.0, 0.5])


def test_layout_is_depth_by_leaf_order(forest):
    pos = tree_layout(forest)
    assert set(pos) == set(range(10))
    assert all(pos[n][0] == float(forest.node_depth[0, n]) for n in pos)
    # leaves take consecutive rows in depth-first order; parents sit at the mean of their children
    assert [pos[n][1] for n in (4, 5, 3, 8, 9)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pos[2][1] == 0.5 and pos[1][1] == pytest.approx((0.5 + 2.0) / 2)


def test_writes_valid_png_and_svg(forest, tmp_path):
    png = draw_tree(forest, REWARDS, tmp_path / "tree.png")
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    from matplotlib import image as mpimg

    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert np.std(img[..., :3]) > 0.01  # something was drawn
    svg = draw_tree(forest, REWARDS[0], tmp_path / "tree.svg", title="t")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = open(svg).read()
    assert "+1.00" in text and "-1.00" in text  # rewards next to leaves (matplotlib keeps each text as an SVG comment)


def test_bad_arguments(forest, tmp_path):
    with pytest.raises(ValueError, match=".png or .svg"):
        draw_tree(forest, REWARDS, tmp_path / "tree.jpg")
    with pytest.raises(ValueError, match="rewards"):
        draw_tree(forest, np.zeros(3), tmp_path / "tree.png")
    with pytest.raises(ValueError, match="prompt"):
        draw_tree(forest, REWARDS, tmp_path / "tree.png", prompt=1)


def _svg_text(forest, tmp_path, rewards, **kw):
    return open(draw_tree(forest, rewards, tmp_path / "tree.svg", **kw)).read()


def test_fixed_colour_scale_draws_all_wrong_leaves_red(forest, tmp_path):
    """Every leaf at -1: with the run's range (-1, 1) the nodes are the scale's low end (red); a scale refitted
    to this picture alone (-2..0) would draw -1 in its neutral middle."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    red, middle = to_hex(colormaps["RdYlGn"](0.0)), to_hex(colormaps["RdYlGn"](0.5))
    fixed = _svg_text(forest, tmp_path, -np.ones(5), reward_range=(-1.0, 1.0))
    assert red in fixed and middle not in fixed
    refitted = _svg_text(forest, tmp_path, -np.ones(5))
    assert middle in refitted and red not in refitted


def test_leaf_labels_come_from_the_verifier(forest, tmp_path):
    """A leaf that stopped on EOS and scored +1 is marked correct; no label claims 'no answer'."""
    rewards = np.array([1.0, 1.0, -1.0, -1.0, -1.0])  # leaf 1 stopped with EOS and is correct
    text = _svg_text(forest, tmp_path, rewards, reward_range=(-1.0, 1.0),
                     correct=np.array([True, True, False, False, False]))
    assert text.count("+1.00 \u2713") == 2 and text.count("-1.00 \u2717") == 3
    assert "verifier says correct / wrong" in text and "no answer" not in text
    assert "stop token" in text  # the finish reason stays a finish reason


def test_picture_shows_the_prompt_and_each_leafs_answer(forest, tmp_path):
    """``prompt_text`` under the title, each leaf's answer (its last characters, one line) next to it; the figure
    widens for the text. SVG with text kept as text, so the strings can be found."""
    import matplotlib

    texts = ["The answer is 12", "so x = 7\n\nanswer: 7", "I think 3", "a" * 200 + " 42", ""]
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plain = draw_tree(forest, REWARDS, str(tmp_path / "plain.svg"))
        rich = draw_tree(forest, REWARDS, str(tmp_path / "rich.svg"), prompt_text="What is 5 + 7?\nAnswer briefly.",
                         leaf_texts=texts, text_chars=20)
    svg = open(rich, encoding="utf-8").read()
    assert "prompt: What is 5 + 7? Answer briefly." in svg
    assert "The answer is 12" in svg and "so x = 7 answer: 7" in svg  # whitespace collapsed to one line
    assert "\u2026" + "a" * 17 + " 42" in svg  # long answers: their last 20 characters
    width = lambda p: float(ET.parse(p).getroot().get("width").rstrip("pt"))  # noqa: E731
    assert width(rich) > width(plain)
    with pytest.raises(ValueError, match="leaf_texts must hold W=5 strings"):
        draw_tree(forest, REWARDS, str(tmp_path / "bad.png"), leaf_texts=texts[:2])
