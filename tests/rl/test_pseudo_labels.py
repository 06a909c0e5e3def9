"""Pseudo-label rewards (test-time RL): each prompt's weighted majority answer over its leaves, against a slow
reference written from the definition, on hand-made answers."""

import collections

import numpy as np
import pytest

from treejax.rl import pseudo_labels
from treejax.rl.evaluation import majority_vote


class _Task:
    extraction = "last_number"


def _reference(texts_PxW, weights_PxW):
    """Straight from the definition: numbers vote with their leaf's weight; the heaviest answer wins, ties to the
    answer seen first; a leaf scores 1 iff its number is the winner."""
    import re

    out = []
    for row, weights in zip(texts_PxW, weights_PxW):
        answers = []
        for t in row:
            nums = re.findall(r"-?\d+(?:\.\d+)?", t.replace(",", ""))
            answers.append(float(nums[-1]) if nums else None)
        votes, order = collections.defaultdict(float), []
        for a, w in zip(answers, weights):
            if a is not None:
                if a not in votes:
                    order.append(a)
                votes[a] += w
        if not votes:
            out.append([0.0] * len(row))
            continue
        best = max(order, key=lambda a: (votes[a], -order.index(a)))
        out.append([float(a == best) for a in answers])
    return np.array(out, np.float32)


CASES = [
    # plain majority; "1,000" and "1000.0" vote together
    ([["so 12", "it is 12", "7", "no idea"]], [[1, 1, 1, 1]]),
    ([["1,000", "1000.0", "999", "999"]], [[1, 1, 1, 1]]),
    # a tie goes to the answer whose first leaf comes first
    ([["3", "4", "4", "3"]], [[1, 1, 1, 1]]),
    # weights (W x path mass of a "transfer" tree): one heavy leaf outvotes two light ones
    ([["5", "6", "6", "x"]], [[2.5, 0.5, 0.5, 0.5]]),
    # no answers at all: no label, every leaf scores 0; several prompts at once
    ([["none", "nothing", "-", "?"], ["8", "8", "9", "8"]], [[1, 1, 1, 1], [1, 1, 1, 1]]),
]


@pytest.mark.parametrize("texts, weights", CASES)
def test_majority_scores_match_the_reference(texts, weights):
    scores, label_leaf = pseudo_labels.majority_scores(_Task(), texts, weights)
    np.testing.assert_array_equal(scores, _reference(texts, weights))
    for p, leaf in enumerate(label_leaf):
        assert (leaf == -1) == (scores[p].sum() == 0)
        if leaf >= 0:
            assert scores[p, leaf] == 1.0


def test_label_accuracy_counts_prompts_whose_label_the_verifier_accepts():
    verifier = np.array([[0, 1, 1], [0, 0, 1], [1, 1, 1]], np.float32)
    assert pseudo_labels.label_accuracy(verifier, np.array([1, 0, -1])) == pytest.approx(1 / 3)


def test_weighted_majority_ignores_non_votes_and_breaks_ties_by_order():
    answers = [None, "2", "3", "3.0", "2"]
    assert majority_vote(answers, [9, 1, 1, 1, 1]) == 1
    assert majority_vote(answers, [9, 1, 1, 1, 0.5]) == 2
    assert majority_vote([None, None], [1, 1]) is None
    with pytest.raises(ValueError, match="weights of shape"):
        pseudo_labels.majority_scores(_Task(), [["1", "2"]], [[1.0, 1.0, 1.0]])


def test_test_time_split_trains_on_the_evaluated_problems_with_pseudo_labels_only():
    from treejax.errors import ConfigError
    from treejax.rl.config import RunConfig
    from treejax.rl.setup import load_task_data

    with pytest.raises(ConfigError, match="reward_source = 'majority'"):
        RunConfig(train_split="eval")
    with pytest.raises(ConfigError, match="train_split"):
        RunConfig(train_split="test", reward_source="majority")
    cfg = RunConfig(train_split="eval", reward_source="majority")
    task, train, evals = load_task_data(cfg)
    assert len(train) == len(evals) == cfg.eval.num_problems
    # the same problems, in the evaluation's order: training reads no other split
    assert [r["question"] for r in train] == [e.metadata["question"] for e in evals]
