"""Multi-turn tool-use rollouts as the loop's source (issue 26, first part: independent conversations, no tree yet).

:class:`MultiTurnRollouts` draws the step's ``P`` prompts and runs ``W`` episodes of each with the Python code tool
(:class:`treejax.envs.code_tool.CodeToolEnv`) through :func:`treejax.sampling.multiturn.run_episodes`: the model
writes ``<code>...</code>``, the sandbox's output is appended as ``<output>...</output>`` over the cached prefix,
and a turn without code is the answer, scored by the task's verifier. The task's instruction should describe the
protocol (``treejax.envs.code_tool.INSTRUCTIONS``; see ``configs/multiturn_code_tool.gin``).

What the learner sees: each episode is one leaf of a chain forest (:func:`treejax.forest.chain_forest`) whose tokens
are the whole response, policy turns and observations alike (they are all in the KV and in the trainer's forward),
with ``loss_mask`` 0 on the observation tokens: they never enter the loss, the old-log-prob pass's statistics or the
importance weights. ``logprobs`` are the policy's on sampled tokens (0 on observations). The verifier's score of the
answer turn is the episode's score (0 when the episode ended without an answer), shaped by ``RunConfig.reward_style``
like any other rollout. Segments are cut every ``S`` tokens of the response as for single-turn chains; turn-level
nodes (spans) and branching at turns are the next part of the issue.

Metrics: ``multiturn/turns_mean`` (policy turns per episode), ``tool_calls_mean``, ``tool_error_frac`` (calls whose
code failed or timed out), ``answered_frac`` (episodes that gave an answer), ``appended_tokens`` (observation
tokens, not decoded), ``env_s`` (host seconds in the environments), and the episode end statuses
``multiturn/status/<done|max_turns|max_tokens>``.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from treejax.envs.code_tool import CodeToolEnv
from treejax.envs.sandbox import SandboxConfig
from treejax.errors import ConfigError
from treejax.forest import NodeStatus, chain_forest
from treejax.sampling.multiturn import TurnLimits, run_episodes
from treejax.sampling.partial import check_chains


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """Code-tool episodes (module docstring): ``max_turns`` policy turns, ``turn_tokens`` tokens per turn, ``chunk``
    tokens decoded between host checks, the sandbox's ``tool_timeout_s`` / ``tool_memory_mb`` per call, at most
    ``max_turns - 1`` tool calls (the last turn is for the answer). The response capacity (policy and observation
    tokens together) is ``TreeConfig.max_length``."""

    max_turns: int = 3
    turn_tokens: int = 128
    chunk: int = 16
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 1024

    def __post_init__(self):
        if self.max_turns < 1 or self.turn_tokens < 1 or self.chunk < 1 or self.tool_timeout_s <= 0:
            raise ConfigError(f"MultiTurnConfig: max_turns, turn_tokens, chunk >= 1 and tool_timeout_s > 0 required, "
                              f"got {self}")

    def check(self, tree_config) -> None:
        try:
            check_chains(tree_config)
        except ValueError as e:
            raise ConfigError(f"RunConfig.multiturn: {e}") from None


class MultiTurnRollouts:
    """The loop's source with code-tool episodes (module docstring). ``base``: :class:`TaskRollouts`;
    ``make_env``: a factory of the episodes' environment (default: the code tool on the base's task)."""

    def __init__(self, base, config: MultiTurnConfig, make_env=None):
        self.base, self.config = base, config
        self.make_env = make_env or (lambda: CodeToolEnv(base.task, sandbox=self.sandbox,
                                                         max_calls=config.max_turns - 1))
        self.pipeline = base.pipeline
        self.estimator_inputs = ()
        self.tree_config = base.rollout.tree_config
        config.check(self.tree_config)
        if base.sampler_fns.extend is None:
            raise ConfigError(f"RunConfig.multiturn: the sampler fns {base.sampler_fns.name!r} cannot append "
                              "observations (no extend)")
        self.sandbox = SandboxConfig(timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb)

    def sample(self, params, key, step):
        from treejax.rl.rollouts import RolloutCounters, Rollouts

        b, tc, cfg = self.base, self.tree_config, self.config
        examples, prompts, lens = b.draw()
        P, W, T, S = len(examples), tc.num_leaves, tc.response_capacity, tc.segment_length
        idx = np.repeat(np.arange(P), W)
        envs = [self.make_env() for _ in idx]
        limits = TurnLimits(max_turns=cfg.max_turns, turn_tokens=cfg.turn_tokens, max_tokens=tc.max_length,
                            chunk=cfg.chunk)
        t = time.perf_counter()
        eps = run_episodes(params, b.sampler_fns, b.tokenizer, envs, [examples[i] for i in idx], prompts[idx],
                           lens[idx], key, tc.strategy, limits, stop_ids=tuple(tc.stop_ids or ()))
        episode_s = time.perf_counter() - t
        tokens = np.zeros((P * W, T), np.int32)
        logp = np.zeros((P * W, T), np.float32)
        policy = np.zeros((P * W, T), np.float32)
        length = np.ones(P * W, np.int32)  # an empty episode keeps one masked token (a chain needs one)
        status = np.zeros(P * W, np.int32)
        scores = np.zeros(P * W, np.float32)
        for r, ep in enumerate(eps):
            n = len(ep.tokens)
            tokens[r, :n], logp[r, :n], policy[r, :n] = ep.tokens, ep.logprobs, ep.policy_mask
            length[r] = max(n, 1)
            answered = bool(ep.infos) and ep.infos[-1].get("answered", False)
            scores[r] = ep.rewards[-1] if answered else 0.0
            status[r] = int(NodeStatus.TRUNCATED if ep.status != "done" else
                            NodeStatus.FINISHED if answered else NodeStatus.EOS)
        forest = chain_forest(length.reshape(P, W), S, tc.max_depth, tc.num_nodes, status.reshape(P, W),
                              tokens.reshape(P, W, T), logp.reshape(P, W, T))
        forest = forest.replace(loss_mask=forest.loss_mask * jnp.asarray(policy.reshape(P, W, T)))
        scores = scores.reshape(P, W)
        decoded = int(policy.sum())
        appended = int(sum(len(e.tokens) for e in eps)) - decoded
        calls = [sum(1 for i in e.infos if "tool_seconds" in i) for e in eps]
        errors = sum(1 for e in eps for i in e.infos if i.get("tool_error"))
        t_score = sum(e.env_seconds for e in eps)
        stops = {name: int(np.sum(status == int(code))) for name, code in zip(NodeStatus.names(), NodeStatus)}
        counters = RolloutCounters(decoded_tokens=decoded, prefilled_tokens=int(np.sum(lens[idx] - 1)),
                                   segments=int(sum(-(-len(e.tokens) // S) for e in eps)), stops=stops,
                                   scoring_s=t_score)
        metrics = {"multiturn/turns_mean": float(np.mean([e.policy_turns for e in eps])),
                   "multiturn/tool_calls_mean": float(np.mean(calls)),
                   "multiturn/tool_error_frac": errors / max(sum(calls), 1),
                   "multiturn/answered_frac": float(np.mean([bool(e.infos) and e.infos[-1].get("answered", False)
                                                             for e in eps])),
                   "multiturn/appended_tokens": appended, "multiturn/env_s": t_score,
                   "multiturn/episode_s": episode_s}
        metrics.update({f"multiturn/status/{s}": sum(e.status == s for e in eps)
                        for s in ("done", "max_turns", "max_tokens")})
        return Rollouts(forest=forest, rewards_PxW=jnp.asarray(b.rewards(scores, length.reshape(P, W)), jnp.float32),
                        scores_PxW=scores, prompts_PxLp=np.asarray(prompts), lengths_P=np.asarray(lens),
                        counters=counters, examples=list(examples), reward_scores_PxW=scores, extra_metrics=metrics)


__all__ = ["MultiTurnConfig", "MultiTurnRollouts"]
