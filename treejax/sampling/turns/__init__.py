"""Multi-turn episodes with an environment, as independent conversations or as trees of turns: turns alternate
between the policy (sampled tokens, KV written as they are decoded) and the environment (observation tokens
appended to the same cache rows in one chunk over the cached prefix; never re-prefilled).

Per path (one cache row each, all rows at once):

1. the prompt is prefilled; ``env.reset(example)``'s text, if any, is appended as an observation;
2. the policy decodes in jitted chunks of ``chunk`` tokens (stop tokens and the turn's token cap end a row inside
   the chunk); between chunks the host decodes each row's turn so far and looks for the environment's
   ``stop_strings``. A turn ends at the first token whose text ends with one (the tokens decoded after it in the
   same chunk are dropped: the row's pending token and position move back to it, and the slots past it are
   overwritten later, as the decode row protocol allows), at a stop token, or at ``turn_tokens``;
3. ``env.step(turn_text)`` gives the observation, the reward and ``done``; a non-final observation is formatted
   (``observation_format``: the text as is, or a chat turn of the model's template, :func:`chat_observation`),
   tokenized and appended (:func:`treejax.sampling.decode.append_tokens`);
4. an episode ends when the environment says ``done``, after ``max_turns`` policy turns (status ``"max_turns"``),
   or when the response capacity ``max_tokens`` (policy and observation tokens together) cannot hold the next
   observation or turn (``"max_tokens"``).

**Trees of turns** (:func:`run_turn_trees`, :class:`TurnTreeConfig`). A prompt has ``W`` leaf slots; ``roots``
episodes start from it, each owning a share of the slots. When a turn ends and the episode goes on, the turn (its
policy tokens and the observation appended after it) becomes a node; a path that owns ``n > 1`` slots and has
made at most ``fork_turns`` turns forks there into ``c <= n`` children: each new child gets a free cache row, a
copy of the parent's KV row (one gather, :func:`treejax.sampling.cache.fork_rows`: exact, nothing recomputed)
and a copy of the environment (``env.clone()``), and the slots are split among the children. A path that ends
owns its slots to the end: a slot is one sample of the policy (the child counts are fixed before the children are
drawn, and an ended subtree is never re-entered), so plain means over the ``W`` slots are unbiased (the
unbiased-tree rule of :mod:`treejax.forest`); a path that ended early holding ``n`` slots is stored ``n`` times.
:func:`turn_forest` makes the :class:`~treejax.forest.Forest` the learner reads: nodes as token spans,
``policy_mask`` 0 on observation tokens.

Each :class:`Episode` holds the response tokens after the prompt, ``policy_mask`` (True on sampled tokens: only
they may enter a loss), the policy's log-probs of the sampled tokens (0 elsewhere), the turn spans ``(start, end,
"policy" | "env")``, the rewards of the steps, and host counters. Randomness: token ``t`` of the response on cache
row ``r`` is drawn with ``decode.token_keys(key, r, 0, t)``.

The package, as the tree sampler's stages (:mod:`treejax.sampling.tree_stages`):

  * :mod:`~treejax.sampling.turns.config`  :class:`TurnLimits`, :class:`TurnTreeConfig`, :func:`chat_observation`;
  * :mod:`~treejax.sampling.turns.state`   the results (:class:`Episode`, :class:`TurnNode`, :class:`TurnTree`),
                                           :class:`ForkRequest`, the run's constants (``TurnContext``) and the
                                           rows in flight (``TurnRows``);
  * :mod:`~treejax.sampling.turns.stages`  one function per stage of a round (decode, end turns, step the
                                           environments, append observations, close nodes, fork);
  * :mod:`~treejax.sampling.turns.run`     :func:`run_turn_trees` (the stages in order) and :func:`run_episodes`;
  * :mod:`~treejax.sampling.turns.forest`  :func:`turn_forest`.
"""

from treejax.sampling.turns.config import TurnLimits, TurnTreeConfig, chat_observation
from treejax.sampling.turns.forest import turn_forest
from treejax.sampling.turns.run import run_episodes, run_turn_trees
from treejax.sampling.turns.state import Episode, ForkRequest, TurnNode, TurnTree

__all__ = ["Episode", "ForkRequest", "TurnLimits", "TurnNode", "TurnTree", "TurnTreeConfig", "chat_observation",
           "run_episodes", "run_turn_trees", "turn_forest"]
