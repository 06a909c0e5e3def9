"""Pseudo-labels without ground truth: each prompt's majority answer over its own leaves is the label (test-time RL).

TTRL (Zuo et al., "TTRL: Test-Time Reinforcement Learning", 2025) rewards each sample by whether its extracted
answer equals the majority answer of the prompt's samples; ETTRL (entropy-forked tree majority rollout) takes the
vote over the leaves of an entropy-branched tree. Here, for prompt ``p`` with leaves ``l = 1..W``::

    a_l      = key(extract(text_l))          the task's answer extraction, normalised (evaluation.answer_key);
                                             no answer -> no vote
    votes(a) = sum_{l : a_l = a} w_l          w_l = Forest.leaf_weight (1 per leaf slot; W x path mass for
                                             "transfer" trees, so the vote estimates the policy's modal answer)
    a*       = argmax_a votes(a)              ties: the answer whose first leaf comes first (evaluation.majority_vote,
                                             maj@k's vote with the leaves' weights)
    score_l  = 1[a_l = a*]                   (0 for every leaf when no leaf has an answer)

The pseudo-scores replace the verifier's scores in the reward (``RunConfig.reward_source = "majority"``); the
verifier's own scores are still computed, only for metrics: ``reward/accuracy`` (true accuracy of the samples) and
``reward/label_accuracy`` (the share of prompts whose majority label the verifier accepts: TTRL's label accuracy).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from treejax.rl.evaluation import answer_key, extract_answer, majority_vote

#: ``RunConfig.reward_source``: what a leaf's score (hence its reward) is measured against.
REWARD_SOURCES = ("verifier", "majority")


def majority_scores(task, texts_PxW: Sequence[Sequence[str]], weights_PxW) -> tuple[np.ndarray, np.ndarray]:
    """``(pseudo_scores [P, W], label_leaf [P])``: 1.0 for the leaves whose answer is their prompt's weighted
    majority answer (module docstring), and for each prompt the index of a leaf carrying that answer (``-1`` when
    no leaf has an answer)."""
    weights = np.asarray(weights_PxW, np.float64)
    if weights.shape != (len(texts_PxW), len(texts_PxW[0]) if texts_PxW else 0):
        raise ValueError(f"majority_scores: weights of shape {weights.shape} for {len(texts_PxW)} prompts x "
                         f"{len(texts_PxW[0]) if texts_PxW else 0} leaves")
    scores = np.zeros(weights.shape, np.float32)
    label_leaf = np.full(weights.shape[0], -1, np.int64)
    for p, row in enumerate(texts_PxW):
        answers = [extract_answer(task, t) for t in row]
        rep = majority_vote(answers, weights[p])
        if rep is None:
            continue
        label_leaf[p] = rep
        label = answer_key(answers[rep])
        scores[p] = [float(answer_key(a) == label) for a in answers]
    return scores, label_leaf


def label_accuracy(verifier_scores_PxW: np.ndarray, label_leaf_P: np.ndarray) -> float:
    """The share of prompts whose majority label the verifier accepts (no label counts as wrong)."""
    s = np.asarray(verifier_scores_PxW)
    ok = [label >= 0 and s[p, label] >= 1.0 for p, label in enumerate(np.asarray(label_leaf_P))]
    return float(np.mean(ok)) if ok else 0.0


__all__ = ["REWARD_SOURCES", "majority_scores", "label_accuracy"]
