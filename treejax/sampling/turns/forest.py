"""The :class:`~treejax.forest.Forest` of turn trees (:func:`turn_forest`): what the learner reads.

Nodes are token spans (:func:`treejax.forest.forest_from_spans`): node ``n`` of prompt ``p`` holds
``TurnNode.end - TurnNode.start`` response tokens (a policy turn, then the observation appended after it), and a
leaf slot's response is its episode's tokens, the spans of its path end to end. ``policy_mask`` (and so
``loss_mask``) is 0 on observation tokens. ``leaf_weight`` is 1 for every slot: each slot is one sample of the
policy (the paths' child counts are fixed before the children are drawn and no subtree is re-entered), so plain
means over the ``W`` slots are unbiased (the unbiased-tree rule of :mod:`treejax.forest`); a path that ended early
holding ``n`` slots is stored ``n`` times.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from treejax.forest import NodeStatus, forest_from_spans
from treejax.sampling.turns.state import Episode, TurnTree

def turn_forest(trees: list[TurnTree], max_length: int, status_of: Callable[[Episode], int] | None = None,
                max_depth: int | None = None, num_nodes: int | None = None):
    """The :class:`~treejax.forest.Forest` of turn trees (nodes as token spans, :func:`treejax.forest.
    forest_from_spans`): ``P = len(trees)`` prompts, ``W`` slots each, ``T = max_length`` response tokens, ``D`` =
    the deepest path, ``N`` = the most nodes; ``policy_mask`` (and so ``loss_mask``) 0 on observation tokens;
    ``leaf_weight`` 1 for every slot (each slot is one sample of the policy: the paths' child counts are fixed
    before the children are drawn and no subtree is re-entered). ``status_of(episode)``: a leaf's
    :class:`~treejax.forest.NodeStatus` code (default: EOS when the environment said done, else TRUNCATED).
    ``max_depth`` / ``num_nodes``: static capacities to pad ``D`` / ``N`` to (a trainer passes the limits'
    ``max_turns`` and ``1 + W max_turns`` so the shapes, and so the compiled update, do not change between steps)."""
    P, W = len(trees), len(trees[0].slot_path)
    D = max(len(sp) for t in trees for sp in t.slot_path) - 1
    N = max(len(t.nodes) for t in trees)
    if (max_depth is not None and D > max_depth) or (num_nodes is not None and N > num_nodes):
        raise ValueError(f"turn_forest: the trees hold depth {D} and {N} nodes, over the capacities "
                         f"max_depth={max_depth}, num_nodes={num_nodes}")
    D, N = max_depth or D, num_nodes or N
    path = np.full((P, W, D + 1), -1, np.int32)
    node_length = np.zeros((P, N), np.int32)
    tokens = np.zeros((P, W, max_length), np.int32)
    logp = np.zeros((P, W, max_length), np.float32)
    policy = np.zeros((P, W, max_length), np.float32)
    status = np.zeros((P, W), np.int32)
    status_of = status_of or (lambda ep: int(NodeStatus.EOS if ep.status == "done" else NodeStatus.TRUNCATED))
    for p, t in enumerate(trees):
        for n, node in enumerate(t.nodes):
            node_length[p, n] = node.end - node.start
        for w, (sp, ep) in enumerate(zip(t.slot_path, t.slot_episode)):
            if ep is None or len(sp) < 2:
                raise ValueError(f"turn_forest: slot {w} of prompt {p} holds no episode")
            k = len(ep.tokens)
            if k > max_length:
                raise ValueError(f"turn_forest: an episode of {k} tokens exceeds max_length={max_length}")
            path[p, w, :len(sp)] = sp
            tokens[p, w, :k], logp[p, w, :k], policy[p, w, :k] = ep.tokens, ep.logprobs, ep.policy_mask
            status[p, w] = status_of(ep)
    return forest_from_spans(path, node_length, tokens, logp, policy, status, max_length,
                             leaf_weight=np.ones((P, W), np.float32))


__all__ = ["turn_forest"]
