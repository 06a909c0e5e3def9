"""Task chains' per-link arrays on the host, from the multi-turn sampler's episodes (the chain environment's turn
infos, :mod:`treejax.envs.task_chain`), for SAGE (:mod:`treejax.rl.advantages.sage`).

For ``P`` turn trees of ``W`` leaf slots and turn depth ``D`` (``MultiTurnConfig.max_turns``):

* ``chain_link_PxWxD`` int32: the index of the problem (link) that slot ``w``'s turn at depth ``d + 1`` works on
  (``info["chain_link"]``), -1 where the turn does not exist;
* ``chain_outcome_PxWxD`` float32, indexed by **link** ``k`` (not by turn): the verifier's score ``o_k`` of the
  slot's problem ``k`` (``info["chain_outcome"]`` on the problem's last turn), 0 for a problem of the chain the
  episode did not finish (it ran out of turns or tokens), NaN for ``k >= K`` (past the chain's length);
* ``chain_skill_PxWxD`` float32, indexed by link: 1 when problem ``k`` passed a skill on (``info["skill"]``), 0
  otherwise (and for unfinished problems and ``k >= K``).

The chain length ``K`` is every turn's ``info["chain_length"]``; a chain longer than ``D`` is an error
(``TaskChainEnv.from_config`` refuses it first).
"""

from __future__ import annotations

import numpy as np

#: The estimator inputs this module supplies (their names).
CHAIN_INPUTS = ("chain_link_PxWxD", "chain_outcome_PxWxD", "chain_skill_PxWxD")


def chain_arrays(trees, depth: int) -> dict[str, np.ndarray]:
    """``{name: [P, W, D] array}`` of :data:`CHAIN_INPUTS` (module docstring). ``trees``: the multi-turn sampler's
    turn trees (``slot_episode`` per slot, ``infos`` per turn)."""
    W = len(trees[0].slot_episode) if trees else 0
    link = np.full((len(trees), W, depth), -1, np.int32)
    outcome = np.full((len(trees), W, depth), np.nan, np.float32)
    skill = np.zeros((len(trees), W, depth), np.float32)
    for p, tr in enumerate(trees):
        for w, ep in enumerate(tr.slot_episode):
            lengths = {int(i["chain_length"]) for i in ep.infos if "chain_length" in i}
            if len(lengths) > 1:
                raise ValueError(f"chain_arrays: slot {w} of prompt {p} has turns of chains of lengths "
                                 f"{sorted(lengths)}")
            if not lengths:
                continue
            K = lengths.pop()
            if K > depth:
                raise ValueError(f"chain_arrays: a chain of {K} problems does not fit {depth} turns; fix: "
                                 f"MultiTurnConfig.max_turns = {K}")
            outcome[p, w, :K] = 0.0
            for d, info in enumerate(ep.infos[:depth]):
                if "chain_link" not in info:
                    continue
                link[p, w, d] = int(info["chain_link"])
                if "chain_outcome" in info:
                    k = int(info["chain_link"])
                    outcome[p, w, k] = float(info["chain_outcome"])
                    skill[p, w, k] = float(bool(info.get("skill", False)))
    return {"chain_link_PxWxD": link, "chain_outcome_PxWxD": outcome, "chain_skill_PxWxD": skill}


__all__ = ["CHAIN_INPUTS", "chain_arrays"]
