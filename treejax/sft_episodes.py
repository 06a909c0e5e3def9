"""Supervised fine-tuning on *expert episodes*: demonstrations that use a world's tools, the warm start of agent RL
(``treejax-sft`` with ``SFTConfig.multiturn = @MultiTurnConfig()``; docs/sft.md, "Expert episodes").

A policy that never calls a tool gives an agent RL run no signal (in the retrieval, shell and user worlds
SmolLM2-135M called a tool in at most 3% of its episodes, every reward -1, a zero gradient: docs/worlds.md). The
usual fix (Search-R1's and ToolRL's cold starts, ReTool's SFT stage) is a short supervised stage on trajectories
that act. For a world whose environment can replay expert steps (``expert_steps = True``: ``render_call``; the
retrieval, shell and travel worlds) and a task whose records ship their reference tool calls
(``metadata["reference_calls"]``: ``retrieval_multihop``, ``shell_files``, ``travel_plans``), a record's expert
episode is::

    a_1 .. a_n   = render_call(g_1) .. render_call(g_n)       one reference call per turn (``<search>q</search>``)
    a_{n+1}      = SFTConfig.demonstration of the record        the answer turn (e.g. "Answer: {answer}"), then EOS
    o_i          = the world's observation after a_i (i <= n)   played in a fresh environment, as in RL

and its row is exactly what the multi-turn sampler would hold had the policy written those actions: the prompt as
RL encodes it (chat template, system prompt, instruction), then ``a_1 o_1 a_2 o_2 ... a_{n+1} EOS``, each
observation formatted by ``MultiTurnConfig.observation_format`` (raw, or a user turn of the chat template) with
the template's end-of-turn marker not repeated after a stop token
(:func:`treejax.sampling.turns.stages.observation_ids`, the sampler's own rule). The loss mask holds the action
tokens and the final EOS; the prompt and the observations are context only. The cross-entropy (or OTR) of
:mod:`treejax.sft` then trains on those tokens.

Refused with a :class:`~treejax.errors.DataError` naming the record: a record without reference calls, more calls
than the episode allows (``MultiTurnConfig.max_turns - 1``), an action longer than ``MultiTurnConfig.turn_tokens``
(the policy could not write it in RL), an episode longer than ``SFTConfig.max_demo_tokens`` (actions and
observations), and an expert episode that does not end with the world's reward 1 (an expert that does not solve
its own problem would teach the wrong thing). A world without expert steps is a ConfigError naming those that have.

Held-out evaluation with the tools (:func:`tool_evaluate`): one greedy episode per problem through the multi-turn
sampler (:func:`treejax.sampling.turns.run_episodes`) with the same limits, observation format and stop tokens as
``treejax-train``'s ``eval_with_tools`` (``tool_accuracy``: episodes scoring 1, ``tool_calls_mean``,
``tool_turns_mean``), next to the plain greedy answer without tools that every SFT run reports.
"""

from __future__ import annotations

import numpy as np

from treejax.errors import DataError
from treejax.sft_config import check_expert_world, format_demonstration


def expert_actions(env_cls, example, demonstration: str) -> list[str]:
    """``[a_1 .. a_n, a_{n+1}]``: the rendered reference calls of ``example`` and its answer turn (module
    docstring)."""
    meta = example.metadata or {}
    calls, uid = meta.get("reference_calls"), meta.get("uid")
    if not isinstance(calls, list) or not calls:
        raise DataError(f"record {uid!r} ships no reference tool calls (metadata['reference_calls']), so it has no "
                        "expert episode; fix: a task that ships them (SFTConfig.task = 'retrieval_multihop', "
                        "'shell_files' or 'travel_plans')")
    answer = format_demonstration(demonstration, dict(meta, answer=example.ground_truth), uid)
    return [env_cls.render_call(c) for c in calls] + [answer]


def episode_row(tokenizer, env, example, prompt_ids: list[int], actions: list[str], fmt, stop_ids: tuple,
                turn_tokens: int) -> tuple[list[int], list[float]]:
    """``(ids, policy_mask)`` of one expert episode played in ``env`` after ``prompt_ids`` (module docstring): the
    mask is 1 on action tokens and the final EOS. ``fmt``: the sampler's observation formatter (None: raw)."""
    from treejax.sampling.turns.stages import observation_ids

    uid = example.metadata.get("uid")
    eos = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
    ids, mask = list(prompt_ids), [0.0] * len(prompt_ids)

    def observe(text):
        last = ids[-1] if len(ids) > len(prompt_ids) and mask[-1] else None
        obs = observation_ids(tokenizer, fmt, stop_ids, last, text)
        ids.extend(obs)
        mask.extend([0.0] * len(obs))

    observe(env.reset(example))
    result = None
    for i, action in enumerate(actions):
        final = i == len(actions) - 1
        turn = tokenizer.encode(action) + ([eos] if final and eos is not None else [])
        if len(turn) > turn_tokens:
            raise DataError(f"record {uid!r}: expert turn {i + 1} has {len(turn)} tokens > MultiTurnConfig."
                            f"turn_tokens={turn_tokens}, which the policy could not write in one turn")
        ids.extend(turn)
        mask.extend([1.0] * len(turn))
        result = env.step(action)
        if result.done != final:
            what = "ended the episode before the answer" if result.done else "did not end the episode"
            raise DataError(f"record {uid!r}: expert turn {i + 1} ({action[:60]!r}) {what} (a world that allows "
                            f"{len(actions) - 1} calls is needed: MultiTurnConfig.max_turns >= {len(actions)})")
        if not final:
            observe(result.observation)
    if result is None or result.reward < 1.0:
        raise DataError(f"record {uid!r}: its expert episode scores {None if result is None else result.reward}, "
                        "not 1 (the reference calls and the answer do not solve the problem in this world)")
    return ids, mask


def episode_batch(tokenizer, task, records: list[dict], cfg, pad_id: int, make_env, stop_ids: tuple):
    """``(tokens [B, Lb], targets [B, Lb], mask [B, Lb])`` of the records' expert episodes, right-padded to a power
    of two (the layout of :func:`treejax.sft.sft_batch`: ``targets[t] = tokens[t + 1]``, ``mask[t]`` 1 where that
    target is an action token)."""
    from treejax.data.prompts import encode_prompts
    from treejax.sampling.decode import bucket_length
    from treejax.sampling.turns import chat_observation

    mt = cfg.multiturn
    env_cls = check_expert_world(mt)
    fmt = chat_observation(tokenizer) if mt.observation_format == "chat" else None
    examples, prompts = encode_prompts(tokenizer, task, records, cfg.system_prompt, cfg.instruction)
    rows = []
    for ex, p in zip(examples, prompts):
        ids, m = episode_row(tokenizer, make_env(), ex, p, expert_actions(env_cls, ex, cfg.demonstration), fmt,
                             stop_ids, mt.turn_tokens)
        if len(ids) - len(p) > cfg.max_demo_tokens:
            raise DataError(f"the expert episode of record {ex.metadata.get('uid')!r} has {len(ids) - len(p)} "
                            f"tokens after the prompt > SFTConfig.max_demo_tokens={cfg.max_demo_tokens}")
        rows.append((ids, m))
    width = bucket_length(max(len(r) for r, _ in rows) + 1)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (r, m) in enumerate(rows):
        tokens[i, :len(r)] = r
        mask[i, :len(r) - 1] = m[1:]  # position t predicts token t + 1: trained where t + 1 is an action token
    targets = np.concatenate([tokens[:, 1:], np.full((len(rows), 1), pad_id, np.int32)], axis=1)
    return tokens, targets, mask


def tool_evaluate(params, model_fns, tokenizer, examples: list, cfg, make_env, stop_ids: tuple, prompt_width: int,
                  max_tokens: int, batch_size: int) -> dict:
    """Greedy held-out episodes with the world (module docstring): ``tool_accuracy``, ``tool_score``,
    ``tool_calls_mean``, ``tool_turns_mean`` over ``examples``."""
    from treejax.rl.multiturn import greedy_tool_episodes, tool_metrics
    from treejax.sampling.turns import TurnLimits, chat_observation

    mt = cfg.multiturn
    fmt = chat_observation(tokenizer) if mt.observation_format == "chat" else None
    limits = TurnLimits(max_turns=mt.max_turns, turn_tokens=mt.turn_tokens, max_tokens=max_tokens, chunk=mt.chunk)
    eps = greedy_tool_episodes(params, model_fns, tokenizer, make_env, list(examples), cfg.system_prompt,
                               cfg.instruction, prompt_width, limits, stop_ids, fmt, batch_size)
    return tool_metrics(eps)


__all__ = ["episode_batch", "episode_row", "expert_actions", "tool_evaluate"]
