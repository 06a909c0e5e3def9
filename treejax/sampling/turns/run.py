"""The turn sampler's drivers: :func:`run_turn_trees` (trees of turns, the stages of
:mod:`treejax.sampling.turns.stages` in order) and :func:`run_episodes` (one independent episode per row).

Cache rows: prompt ``p``'s slots are rows ``p W .. p W + W - 1``; a path owning slots ``[lo, hi)`` decodes on row
``p W + lo``. Token ``t`` of the response on row ``r`` is drawn with ``decode.token_keys(key, r, 0, t)``, so
``roots = W`` (independent episodes) draws exactly what one-row-per-episode decoding draws, and a fork's children
continue with the keys of their own rows.
"""

from __future__ import annotations

from typing import Callable

import jax

from treejax.sampling import decode
from treejax.sampling.strategies import Strategy
from treejax.sampling.turns import stages
from treejax.sampling.turns.config import TurnLimits, TurnTreeConfig
from treejax.sampling.turns.state import Episode, ForkRequest, TurnContext, TurnNode, TurnTree


def run_turn_trees(params, model: decode.ModelFns, tokenizer, make_env: Callable[[int], object], examples: list,
                   prompts, prompt_lengths, key: jax.Array, strategy: Strategy, limits: TurnLimits = TurnLimits(),
                   tree: TurnTreeConfig = TurnTreeConfig(), stop_ids: tuple[int, ...] = (),
                   observation_format: Callable[[str], str] | None = None,
                   fork_rule: Callable[[list[ForkRequest]], list[int]] | None = None) -> list[TurnTree]:
    """A tree of turns per prompt (:mod:`treejax.sampling.turns`): ``examples[p]`` after prompt ``prompts[p,
    :prompt_lengths[p]]``, ``tree.roots`` episodes each with its own environment ``make_env(p)``, forks at turn
    boundaries copying the KV row and the environment (``env.clone()``). ``model``: sampler fns with ``extend``;
    ``tokenizer``: ``encode`` / ``decode``; ``observation_format``: observation text -> appended text (default: as
    is). ``fork_rule(requests)``: for the paths that may fork at this round's turn boundaries (one
    :class:`ForkRequest` each), the number of children of each, ``1..slots`` (default ``min(branch_factor,
    slots)``); it sees only the paths so far, so each leaf slot stays one sample of the policy, weight 1 (e.g.
    :class:`treejax.rl.trace.TraceRule`). Rows and keys: the module docstring."""
    ctx = TurnContext.create(params, model, tokenizer, make_env, examples, prompts, prompt_lengths, key, strategy,
                             limits, tree, stop_ids, observation_format, fork_rule)
    roots, root_rows = stages.root_paths(ctx)
    cache, rows = stages.prefill_roots(ctx, root_rows)
    trees = [TurnTree([TurnNode(-1, 0, 0, 0)], [[] for _ in range(ctx.W)], [None] * ctx.W) for _ in range(ctx.P)]
    cache = stages.append_obs(ctx, cache, rows, stages.reset_roots(ctx, rows, roots, root_rows))
    while rows.active_B.any():
        cache, decoded = stages.decode_round(ctx, cache, rows)
        observations = stages.step_envs(ctx, rows, trees, stages.end_turns(ctx, rows, decoded))
        cache = stages.append_obs(ctx, cache, rows, observations)
        going_on = list(observations)  # the rows whose episode goes on, in row order
        stages.close_turns(ctx, rows, trees, going_on)
        cache = stages.fork(ctx, cache, rows, trees, stages.fork_counts(ctx, rows, going_on))
    return trees


def run_episodes(params, model: decode.ModelFns, tokenizer, envs: list, examples: list, prompts, prompt_lengths,
                 key: jax.Array, strategy: Strategy, limits: TurnLimits = TurnLimits(),
                 stop_ids: tuple[int, ...] = (), observation_format: Callable[[str], str] | None = None
                 ) -> list[Episode]:
    """Runs one independent episode per row: ``envs[b]`` (an :class:`~treejax.envs.base.Environment`) on
    ``examples[b]`` after prompt ``prompts[b, :prompt_lengths[b]]`` (:func:`run_turn_trees` with one slot per
    prompt). Returns the :class:`Episode` of each row."""
    tokens, _ = decode.validate_prompts(prompts, prompt_lengths)
    if not (len(envs) == len(examples) == tokens.shape[0]):
        raise ValueError(f"run_episodes: {tokens.shape[0]} prompts, {len(envs)} environments and {len(examples)} "
                         "examples")
    trees = run_turn_trees(params, model, tokenizer, lambda b: envs[b], examples, prompts, prompt_lengths, key,
                           strategy, limits, TurnTreeConfig(), stop_ids, observation_format)
    return [t.slot_episode[0] for t in trees]


__all__ = ["run_episodes", "run_turn_trees"]
