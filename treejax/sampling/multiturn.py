"""Multi-turn episodes and trees of turns: the names of :mod:`treejax.sampling.turns` (where the sampler lives, in
stages over a typed state), re-exported here so that existing imports keep working."""

from treejax.sampling.turns import (Episode, ForkRequest, TurnLimits, TurnNode, TurnTree, TurnTreeConfig,
                                    chat_observation, run_episodes, run_turn_trees, turn_forest)

__all__ = ["Episode", "ForkRequest", "TurnLimits", "TurnNode", "TurnTree", "TurnTreeConfig", "chat_observation",
           "run_episodes", "run_turn_trees", "turn_forest"]
