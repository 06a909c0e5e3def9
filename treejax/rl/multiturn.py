"""Multi-turn tool-use rollouts as the loop's source: independent episodes or trees of turns.

:class:`MultiTurnRollouts` draws the step's ``P`` prompts and runs ``W`` leaf slots of each with the Python code
tool (:class:`treejax.envs.code_tool.CodeToolEnv`) through :func:`treejax.sampling.multiturn.run_turn_trees`: the
model writes ``<code>...</code>``, the sandbox's output is appended as ``<output>...</output>`` over the cached
prefix, and a turn without code is the answer, scored by the task's verifier. The task's instruction should
describe the protocol (``treejax.envs.code_tool.INSTRUCTIONS``; see ``configs/multiturn_code_tool.gin``).

Independent episodes (``MultiTurnConfig.roots = None``: ``W`` roots) or trees of turns (``roots < W``): a path
owning several slots forks at the end of each of its first ``fork_turns`` turns into ``branch_factor`` children,
copying the KV row and the environment (``clone()``; the code tool's state is plain data), so the turns
before the fork are decoded once. Every slot is one sample of the policy (weight 1; a path that ends early holding
``n`` slots is stored ``n`` times), so any estimator's group statistics over the ``W`` slots stay unbiased.

What the learner sees: the turn forest (:func:`treejax.sampling.multiturn.turn_forest`): one node per turn (the
policy's tokens and the observation appended after it, a token span), its tokens the whole conversation (policy
turns and observations alike: they are all in the KV and in the trainer's forward), ``policy_mask`` and
``loss_mask`` 0 on the observation tokens: they never enter the loss, the old-log-prob pass's statistics or the
importance weights. ``logprobs`` are the policy's on sampled tokens (0 on observations). The verifier's score of
the answer turn is the leaf's score (0 when the episode ended without an answer), shaped by
``RunConfig.reward_style`` like any other rollout. Tree estimators (``treepo``, the agentic ones) read the turn
nodes as their segments.

Metrics: ``multiturn/turns_mean`` (policy turns per leaf slot), ``tool_calls_mean``, ``tool_error_frac`` (calls
whose code failed or timed out), ``answered_frac`` (slots whose episode gave an answer), ``appended_tokens``
(observation tokens appended, each shared node counted once), ``forks``, ``env_s`` (host seconds in the
environments), ``episode_s``, and the end statuses ``multiturn/status/<done|max_turns|max_tokens>`` (per slot).
``Rollouts.tool_calls_PxW``: each slot's tool calls that ran cleanly (SPEAR's tool-call bonus,
:mod:`treejax.rl.spear`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from treejax.envs import env_names, get_env
from treejax.envs.sandbox import ISOLATION, SandboxConfig, check_isolation
from treejax.envs.semi_online import SemiOnlineConfig, SemiOnlineEnv, semi_online_arrays
from treejax.errors import ConfigError
from treejax.rl.chains import CHAIN_INPUTS, chain_arrays
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import NO_SHAPERS, SYNCHRONOUS, VERIFIER
from treejax.forest import NodeStatus
from treejax.sampling.multiturn import TurnLimits, TurnTreeConfig, chat_observation, run_turn_trees, turn_forest
from treejax.sampling.partial import check_chains


#: Estimator inputs only multi-turn rollouts supply (module docstring).
MULTITURN_INPUTS = ("truth_logp_PxN", "tool_success_PxN", "state_cluster_PxN", "tool_match_PxWxD",
                    "action_signature_PxWxD", "chain_link_PxWxD", "chain_outcome_PxWxD", "chain_skill_PxWxD",
                    "feedback_gain_PxN", "step_reward_PxWxD", "step_match_PxWxD",
                    "safety_verdict_PxWxC")
#: The inputs of UI-S1's semi-online rollout (``MultiTurnConfig.semi_online``; :mod:`treejax.envs.semi_online`).
SEMI_ONLINE_INPUTS = ("step_reward_PxWxD", "step_match_PxWxD")


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig(Stage):
    """Code-tool episodes (module docstring): ``max_turns`` policy turns, ``turn_tokens`` tokens per turn, ``chunk``
    tokens decoded between host checks, the sandbox's ``tool_timeout_s`` / ``tool_memory_mb`` per call and its
    ``tool_isolation`` (``"bwrap"``, or ``"none"``: the loudly logged opt-out for a container of one's own,
    :mod:`treejax.envs.sandbox`), at most
    ``max_turns - 1`` tool calls (the last turn is for the answer). The response capacity (policy and observation
    tokens together) is ``TreeConfig.max_length``. Trees of turns: ``roots`` episodes per prompt (``None``: one per
    leaf slot, independent episodes), forks into ``branch_factor`` children at a path's first ``fork_turns`` turns;
    ``fork_rule``: ``"uniform"`` (every path that may fork does) or ``"trace"`` (TRACE: the ``trace_fraction`` of each
    round's paths whose predicted success is the most mixed fork, :class:`treejax.rl.trace.TraceRule`).
    ``environment``: ``"code_tool"`` (:class:`~treejax.envs.code_tool.CodeToolEnv` on the task) or
    ``"guess_number"`` (:class:`~treejax.envs.guess.GuessNumberEnv`, ``max_turns`` guesses, its hidden number a
    hash of the problem's question); ``observation_format``: ``"raw"`` (the text as is) or ``"chat"`` (a user turn
    of the model's chat template, :func:`~treejax.sampling.multiturn.chat_observation`); ``eval_with_tools``: the
    held-out evaluation also runs greedy episodes with the environment (``eval/tool_accuracy``, ...);
    ``state_similarity``: the ``difflib`` ratio at which two observations are one anchor state for ``gigpo_similar``
    (:func:`state_clusters`). ``environment = "retrieval"`` (:class:`~treejax.envs.retrieval.RetrievalEnv`: BM25
    search and a calculator over the world of ``RunConfig.task = "retrieval_multihop"``); its questions ship
    reference tool calls, which MatchTIR (``matchtir``) matches against each slot's calls with
    ``tool_match_name_weight`` the per-call score's weight of the tool name, ``tool_match_assignment`` ``"hard"``
    (Kuhn-Munkres) or ``"soft"`` (entropic optimal transport with ``tool_match_epsilon``;
    :mod:`treejax.rl.tool_match`). ``environment = "shell"`` (:class:`~treejax.envs.shell.ShellEnv`: a small
    shell language, parsed to an AST, over the generated file systems of ``RunConfig.task = "shell_files"``); its
    command turns carry their AST's command-name chain, which A³ (``a3``) reads as ``action_signature_PxWxD``
    (:func:`action_signatures`). ``environment = "task_chain"`` (:class:`~treejax.envs.task_chain.TaskChainEnv`:
    the related problems of ``RunConfig.task = "task_chain"`` in one episode, each verified); its turns carry
    their problem's index, outcome and skill, which SAGE (``sage``) reads as ``chain_link_PxWxD``,
    ``chain_outcome_PxWxD`` and ``chain_skill_PxWxD`` (:func:`treejax.rl.chains.chain_arrays`).
    ``environment = "simulated_user"`` (:class:`~treejax.envs.simulated_user.SimulatedUserEnv`: a user with a
    persona and a hidden goal, played by a model or by rules, for the goals of ``RunConfig.task = "user_goals"``);
    InfoPO (``infopo``) reads each turn's counterfactual feedback gain ``feedback_gain_PxN`` (any environment whose
    turns get observations). ``environment = "guarded_user"``
    (:class:`~treejax.envs.guarded_user.GuardedUserEnv`: the same users, some of whose requests must be refused,
    turns in plan -> check -> act-or-refuse format); MOSAIC (``mosaic``) reads each episode's verdict
    ``safety_verdict_PxWxC`` (:func:`treejax.envs.guarded_user.safety_verdicts`).
    ``semi_online`` (a :class:`~treejax.envs.semi_online.SemiOnlineConfig`, default ``None``: off): UI-S1's
    semi-online rollout on the environment's expert trajectories (its examples' reference
    calls; an environment with ``expert_steps``, the retrieval world): a matched step continues from the expert's
    next state, a mismatch is patched (up to ``patch_limit``) or ends the episode; each turn's step reward and
    match are the estimator inputs ``step_reward_PxWxD`` / ``step_match_PxWxD`` (``ui_s1``)."""

    max_turns: int = 3
    turn_tokens: int = 128
    chunk: int = 16
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 1024
    tool_isolation: str = "bwrap"
    roots: int | None = None
    branch_factor: int = 2
    fork_turns: int = 1
    fork_rule: str = "uniform"
    trace_fraction: float = 0.5
    environment: str = "code_tool"
    observation_format: str = "raw"
    eval_with_tools: bool = True
    state_similarity: float = 0.95
    tool_match_name_weight: float = 0.5
    tool_match_assignment: str = "hard"
    tool_match_epsilon: float = 0.1
    semi_online: SemiOnlineConfig | None = None

    def __post_init__(self):
        if self.max_turns < 1 or self.turn_tokens < 1 or self.chunk < 1 or self.tool_timeout_s <= 0:
            raise ConfigError(f"MultiTurnConfig: max_turns, turn_tokens, chunk >= 1 and tool_timeout_s > 0 required, "
                              f"got {self}")
        if (self.roots is not None and self.roots < 1) or self.branch_factor < 1 or self.fork_turns < 0:
            raise ConfigError(f"MultiTurnConfig: roots >= 1 (or None), branch_factor >= 1, fork_turns >= 0 "
                              f"required, got {self}")
        if self.environment not in env_names() or self.observation_format not in ("raw", "chat"):
            raise ConfigError(f"MultiTurnConfig: environment must be one of {tuple(env_names())} and "
                              f"observation_format "
                              f"'raw' or 'chat', got {self.environment!r}, {self.observation_format!r}")
        if self.tool_isolation not in ISOLATION:
            raise ConfigError(f"MultiTurnConfig.tool_isolation must be one of {ISOLATION}, got "
                              f"{self.tool_isolation!r}")
        if not 0.0 < self.state_similarity <= 1.0:
            raise ConfigError(f"MultiTurnConfig.state_similarity must be in (0, 1], got {self.state_similarity}")
        if not 0.0 <= self.tool_match_name_weight <= 1.0 or not self.tool_match_epsilon > 0:
            raise ConfigError(f"MultiTurnConfig: tool_match_name_weight must be in [0, 1] and tool_match_epsilon > 0, "
                              f"got {self.tool_match_name_weight}, {self.tool_match_epsilon}")
        if self.tool_match_assignment not in ("hard", "soft"):
            raise ConfigError(f"MultiTurnConfig.tool_match_assignment must be 'hard' (Kuhn-Munkres) or 'soft' "
                              f"(optimal transport), got {self.tool_match_assignment!r}")
        if self.fork_rule not in FORK_RULES or not 0.0 < self.trace_fraction <= 1.0:
            raise ConfigError(f"MultiTurnConfig: fork_rule must be one of {FORK_RULES} and 0 < trace_fraction <= 1, "
                              f"got {self.fork_rule!r}, {self.trace_fraction}")

    role: ClassVar[str] = "planner"  # episodes of turns with an environment, on the task's prompts
    requires: ClassVar[tuple] = (VERIFIER, SYNCHRONOUS, NO_SHAPERS)
    provides: ClassVar[frozenset[str]] = frozenset({"turn_forest"})
    supplies: ClassVar[frozenset[str]] = frozenset(MULTITURN_INPUTS)

    def check(self, facts) -> None:
        self.check_tree(facts.tree)
        self.check_world(facts)
        self.check_semi_online(facts)

    def check_semi_online(self, facts) -> None:
        """The semi-online rollout runs on an environment that replays expert steps (``expert_steps``), and an
        estimator that reads its step rewards (``ui_s1``) has it switched on."""
        env = get_env(self.environment)
        if self.semi_online is not None and not getattr(env, "expert_steps", False):
            with_steps = [n for n in env_names() if getattr(get_env(n), "expert_steps", False)]
            raise ConfigError(f"MultiTurnConfig.semi_online replays expert trajectories, which environment "
                              f"{self.environment!r} cannot (no reference calls to replay); fix: "
                              f"MultiTurnConfig.environment = {with_steps[0] if with_steps else '?'!r} (with its task)")
        needs = [i for i in SEMI_ONLINE_INPUTS if i in facts.estimator_inputs]
        if needs and self.semi_online is None:
            raise ConfigError(f"MultiTurnConfig: estimator {facts.estimator!r} reads the semi-online rollout's "
                              f"{needs[0]}, which is off; fix: MultiTurnConfig.semi_online = @SemiOnlineConfig()")

    def check_world(self, facts) -> None:
        """The environment fits the run's task (an environment with ``tasks`` acts only on those tasks' worlds),
        an estimator that reads ``tool_match_PxWxD`` (MatchTIR) has an environment whose examples ship
        reference tool calls (``reference_calls``), and one that reads ``action_signature_PxWxD`` (A³) an
        environment whose actions parse to an AST (``ast_actions``)."""
        env = get_env(self.environment)
        tasks = tuple(getattr(env, "tasks", ()) or ())
        if tasks and facts.task and facts.task not in tasks:
            raise ConfigError(f"MultiTurnConfig.environment = {self.environment!r} acts on the world of task "
                              f"{' or '.join(map(repr, tasks))}, not {facts.task!r}; fix: RunConfig.task = {tasks[0]!r}")
        if "tool_match_PxWxD" in facts.estimator_inputs and not getattr(env, "reference_calls", False):
            with_calls = [n for n in env_names() if getattr(get_env(n), "reference_calls", False)]
            raise ConfigError(f"MultiTurnConfig: estimator {facts.estimator!r} matches tool calls against reference "
                              f"calls, which environment {self.environment!r} does not ship; fix: "
                              f"MultiTurnConfig.environment = {with_calls[0] if with_calls else '?'!r} (with its "
                              "task)")
        if "chain_outcome_PxWxD" in facts.estimator_inputs and not getattr(env, "chain_links", False):
            raise ConfigError(f"MultiTurnConfig: estimator {facts.estimator!r} reads the problems of a task chain, "
                              f"which environment {self.environment!r} does not run; fix: MultiTurnConfig.environment "
                              "= 'task_chain' (with RunConfig.task = 'task_chain')")
        if "safety_verdict_PxWxC" in facts.estimator_inputs and not getattr(env, "act_or_refuse", False):
            raise ConfigError(f"MultiTurnConfig: estimator {facts.estimator!r} compares act-or-refuse verdicts, which "
                              f"environment {self.environment!r} does not give; fix: MultiTurnConfig.environment = "
                              "'guarded_user' (with RunConfig.task = 'user_goals')")
        if "action_signature_PxWxD" in facts.estimator_inputs and not getattr(env, "ast_actions", False):
            with_ast = [n for n in env_names() if getattr(get_env(n), "ast_actions", False)]
            fix = with_ast[0] if with_ast else "?"
            tasks = tuple(getattr(get_env(fix), "tasks", ()) or ()) if with_ast else ()
            raise ConfigError(f"MultiTurnConfig: estimator {facts.estimator!r} groups turns by the AST of their "
                              f"actions, which environment {self.environment!r} does not parse; fix: "
                              f"MultiTurnConfig.environment = {fix!r}"
                              + (f" (with RunConfig.task = {tasks[0]!r})" if tasks else ""))

    def build(self, inner, ctx):
        base = ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i not in self.supplies))
        return MultiTurnRollouts(base, self, estimator_inputs=ctx.estimator_inputs, model_config=ctx.model_config,
                                 pad_id=ctx.pad_id)

    def check_tree(self, tree_config) -> None:
        try:
            check_chains(tree_config)
        except ValueError as e:
            raise ConfigError(f"MultiTurnConfig: {e} (the turn tree's shape is MultiTurnConfig.roots / "
                              "branch_factor / fork_turns)") from None
        if self.roots is not None and self.roots > tree_config.num_leaves:
            raise ConfigError(f"MultiTurnConfig.roots={self.roots} exceeds the {tree_config.num_leaves} leaf slots "
                              "(TreeConfig.num_leaves)")

    def tree(self, num_slots: int) -> TurnTreeConfig:
        """The sampler's :class:`TurnTreeConfig` for ``num_slots`` leaf slots per prompt."""
        return TurnTreeConfig(num_slots=num_slots, roots=num_slots if self.roots is None else self.roots,
                              branch_factor=self.branch_factor, fork_turns=self.fork_turns)


#: ``MultiTurnConfig.environment`` values.
#: ``MultiTurnConfig.fork_rule`` values.
FORK_RULES = ("uniform", "trace")


class MultiTurnRollouts:
    """The loop's source with code-tool episodes (module docstring). ``base``: :class:`TaskRollouts`;
    ``make_env``: a factory of the episodes' environment (default: the code tool on the base's task);
    ``estimator_inputs``: the estimator's declared inputs; ``truth_logp_PxN`` needs ``model_config`` (the
    learner's forward scores the ground truth, :func:`treejax.rl.info_gain.make_truth_scorer`) and
    ``truth_prefix``, the text before the answer in the environment's answer format (the code tool's ``Answer:``);
    ``feedback_gain_PxN`` (InfoPO) needs ``model_config`` too (two learner forwards per node slot,
    :func:`treejax.rl.info_gain.feedback_gains`), with ``feedback_placeholder`` the text that replaces a masked
    observation (default :data:`treejax.rl.info_gain.FEEDBACK_PLACEHOLDER`, the official code's)."""

    def __init__(self, base, config: MultiTurnConfig, make_env=None, estimator_inputs: tuple[str, ...] = (),
                 model_config=None, pad_id: int = 0, truth_prefix: str = "Answer: ",
                 feedback_placeholder: str | None = None):
        self.base, self.config, self.truth_prefix = base, config, truth_prefix
        self.draw = base.draw  # the step's prompt draw; a wrapper may filter it (RAPO's curriculum, rl/rapo.py)
        make = make_env or (lambda: get_env(config.environment).from_config(config, base.task, self.sandbox))
        self.make_env = make if config.semi_online is None else (lambda: SemiOnlineEnv(make(), config.semi_online))
        self.observation_format = chat_observation(base.tokenizer) if config.observation_format == "chat" else None
        self.pipeline = base.pipeline
        unknown = [i for i in estimator_inputs if i not in MULTITURN_INPUTS]
        if unknown:
            raise ConfigError(f"MultiTurnConfig: the estimator reads {unknown}; multi-turn rollouts supply only "
                              f"{MULTITURN_INPUTS}")
        self.estimator_inputs = tuple(estimator_inputs)
        self.scorer, self.model_config, self.pad_id = None, model_config, pad_id
        if config.fork_rule == "trace" and model_config is None:
            raise ConfigError("MultiTurnRollouts: fork_rule 'trace' needs the model_config to predict success")
        if "truth_logp_PxN" in self.estimator_inputs:
            if model_config is None:
                raise ConfigError("MultiTurnRollouts: truth_logp_PxN needs the model_config to score the ground truth")
            from treejax.rl.info_gain import make_truth_scorer

            self.scorer = make_truth_scorer(model_config, pad_id=pad_id)
        self.feedback_scorer = None
        if "feedback_gain_PxN" in self.estimator_inputs:
            if model_config is None:
                raise ConfigError("MultiTurnRollouts: feedback_gain_PxN needs the model_config to score the turns")
            from treejax.rl.info_gain import FEEDBACK_PLACEHOLDER, make_feedback_scorer

            text = FEEDBACK_PLACEHOLDER if feedback_placeholder is None else feedback_placeholder
            self.placeholder = np.asarray(base.tokenizer.encode(text), np.int32)
            if self.placeholder.size == 0:
                raise ConfigError(f"MultiTurnRollouts: the feedback placeholder {text!r} encodes to no tokens")
            # 2048-token chunks of the vocabulary projection: the pass runs 2 P N full rows (memory, not speed)
            self.feedback_scorer = make_feedback_scorer(model_config, pad_id=pad_id, chunk_size=2048)
        self.tree_config = base.rollout.tree_config
        config.check_tree(self.tree_config)
        if base.sampler_fns.extend is None:
            raise ConfigError(f"MultiTurnConfig: the sampler fns {base.sampler_fns.name!r} cannot append "
                              "observations (no extend)")
        self.sandbox = SandboxConfig(timeout_s=config.tool_timeout_s, memory_mb=config.tool_memory_mb,
                                     isolation=config.tool_isolation)
        if make_env is None and config.environment == "code_tool":
            check_isolation(self.sandbox)  # at start-up: one line saying what to install where no layer works

    def sample(self, params, key, step):
        return self.roll(params, key, *self.draw())

    def roll(self, params, key, examples, prompts, lens):
        """The episodes of ``examples`` (their right-padded ``prompts [P, Lp]`` and ``lengths [P]``) as one step's
        :class:`~treejax.rl.rollouts.Rollouts` (:meth:`sample` on the pipeline's next prompts; a wrapper may roll
        prompts of its own, e.g. :mod:`treejax.rl.deeptravel`'s failed ones)."""
        from treejax.rl.rollouts import RolloutCounters, Rollouts

        b, tc, cfg = self.base, self.tree_config, self.config
        P, W = len(examples), tc.num_leaves
        limits = TurnLimits(max_turns=cfg.max_turns, turn_tokens=cfg.turn_tokens, max_tokens=tc.max_length,
                            chunk=cfg.chunk)
        rule = self.trace_rule(params, examples, prompts, lens) if cfg.fork_rule == "trace" else None
        t = time.perf_counter()
        trees = run_turn_trees(params, b.sampler_fns, b.tokenizer, lambda p: self.make_env(), list(examples),
                               prompts, lens, key, tc.strategy, limits, cfg.tree(W), stop_ids=tuple(tc.stop_ids or ()),
                               observation_format=self.observation_format, fork_rule=rule)
        episode_s = time.perf_counter() - t

        forest = turn_forest(trees, tc.response_capacity, episode_status, max_depth=cfg.max_turns,
                             num_nodes=1 + W * cfg.max_turns)
        slots = [ep for tr in trees for ep in tr.slot_episode]
        scores = np.array([episode_score(ep) for ep in slots], np.float32).reshape(P, W)
        length = np.asarray(forest.leaf_length)
        # distinct work: each node's tokens were decoded / appended once, whatever the slots through it
        decoded = appended = segments = 0
        distinct = list({id(ep): ep for ep in slots}.values())  # a path's episode is shared by its slots
        for tr in trees:
            seen = set()
            for sp, ep in zip(tr.slot_path, tr.slot_episode):
                for n in sp[1:]:
                    if n in seen:
                        continue
                    seen.add(n)
                    node = tr.nodes[n]
                    k = sum(ep.policy_mask[node.start:node.end])
                    decoded, appended, segments = decoded + k, appended + (node.end - node.start - k), segments + 1
        calls = [sum(1 for i in e.infos if "tool_seconds" in i) for e in slots]
        clean = np.array([sum(1 for i in e.infos if "tool_seconds" in i and not i.get("tool_error")) for e in slots],
                         np.int32).reshape(P, W)
        errors = sum(1 for e in slots for i in e.infos if i.get("tool_error"))
        t_env = sum(e.env_seconds for e in distinct)
        status = np.asarray(forest.leaf_status)
        stops = {name: int(np.sum(status == int(code))) for name, code in zip(NodeStatus.names(), NodeStatus)}
        counters = RolloutCounters(decoded_tokens=decoded, prefilled_tokens=int(np.sum(lens - 1)) * cfg.tree(W).roots,
                                   segments=segments, forks=sum(tr.forks for tr in trees), stops=stops,
                                   scoring_s=t_env)
        metrics = {"multiturn/turns_mean": float(np.mean([e.policy_turns for e in slots])),
                   "multiturn/tool_calls_mean": float(np.mean(calls)),
                   "multiturn/tool_error_frac": errors / max(sum(calls), 1),
                   "multiturn/answered_frac": float(np.mean([answered(e) for e in slots])),
                   "multiturn/appended_tokens": appended, "multiturn/forks": sum(tr.forks for tr in trees),
                   "multiturn/env_s": t_env, "multiturn/episode_s": episode_s}
        metrics.update({f"multiturn/status/{s}": sum(e.status == s for e in slots)
                        for s in ("done", "max_turns", "max_tokens")})
        if rule is not None:
            p_hat = [h[0] for h in rule.history]
            metrics.update({"multiturn/trace_requests": len(p_hat),
                            "multiturn/trace_p_hat_mean": float(np.mean(p_hat)) if p_hat else 0.0,
                            "multiturn/trace_forked_frac": float(np.mean([h[1] > 1 for h in rule.history]))
                            if p_hat else 0.0})
        inputs = self.inputs(params, trees, forest, examples, prompts, lens, metrics)
        return Rollouts(forest=forest, rewards_PxW=jnp.asarray(b.rewards(scores, length), jnp.float32),
                        scores_PxW=scores, prompts_PxLp=np.asarray(prompts), lengths_P=np.asarray(lens),
                        counters=counters, estimator_inputs=inputs, examples=list(examples),
                        reward_scores_PxW=scores, extra_metrics=metrics, tool_calls_PxW=clean)

    def inputs(self, params, trees, forest, examples, prompts, lens, metrics: dict) -> dict:
        """The estimator's inputs this step (those it declared, of :data:`MULTITURN_INPUTS`); adds their metrics
        (``multiturn/truth_scoring_s``, ``multiturn/feedback_scoring_s`` / ``feedback_gain_mean`` /
        ``feedback_turns``: InfoPO's counterfactual pass, the mean gain and the number of nodes with one,
        ``multiturn/tool_match_mean``: the mean matched score of the tool calls,
        ``multiturn/action_signatures_mean``: distinct action sub-chains per prompt, ``multiturn/chain_solved_mean``
        / ``chain_skill_mean``: the mean score of a chain's problems, unfinished ones 0, and the share that passed a
        skill on)."""
        cfg, N = self.config, forest.node_parent.shape[1]
        inputs = {}
        if "tool_success_PxN" in self.estimator_inputs:
            inputs["tool_success_PxN"] = jnp.asarray(tool_success(trees, N))
        if "state_cluster_PxN" in self.estimator_inputs:
            inputs["state_cluster_PxN"] = jnp.asarray(state_clusters(trees, self.base.tokenizer, N,
                                                                     cfg.state_similarity))
        if "tool_match_PxWxD" in self.estimator_inputs:
            from treejax.rl.tool_match import tool_match_rewards

            match = tool_match_rewards(trees, list(examples), forest.leaf_path.shape[2] - 1,
                                       cfg.tool_match_name_weight, cfg.tool_match_assignment, cfg.tool_match_epsilon)
            inputs["tool_match_PxWxD"] = jnp.asarray(match)
            metrics["multiturn/tool_match_mean"] = float(np.nanmean(match)) if np.isfinite(match).any() else 0.0
        if any(i in self.estimator_inputs for i in SEMI_ONLINE_INPUTS):
            arrays = semi_online_arrays(trees, forest.leaf_path.shape[2] - 1)
            inputs.update({k: jnp.asarray(v) for k, v in arrays.items() if k in self.estimator_inputs})
            self.semi_online_metrics(trees, arrays, metrics)
        if "action_signature_PxWxD" in self.estimator_inputs:
            sig, names = action_signatures(trees, forest.leaf_path.shape[2] - 1)
            inputs["action_signature_PxWxD"] = jnp.asarray(sig)
            metrics["multiturn/action_signatures_mean"] = float(np.mean([len(n) for n in names])) if names else 0.0
        if any(i in self.estimator_inputs for i in CHAIN_INPUTS):
            chains = chain_arrays(trees, forest.leaf_path.shape[2] - 1)
            inputs.update({k: jnp.asarray(v) for k, v in chains.items() if k in self.estimator_inputs})
            done = np.isfinite(chains["chain_outcome_PxWxD"])
            metrics["multiturn/chain_solved_mean"] = (float(np.mean(chains["chain_outcome_PxWxD"][done]))
                                                      if done.any() else 0.0)
            metrics["multiturn/chain_skill_mean"] = (float(np.mean(chains["chain_skill_PxWxD"][done]))
                                                     if done.any() else 0.0)
        if "safety_verdict_PxWxC" in self.estimator_inputs:  # MOSAIC (treejax.envs.guarded_user)
            from treejax.envs.guarded_user import safety_verdicts

            inputs["safety_verdict_PxWxC"] = jnp.asarray(safety_verdicts(trees, metrics))
        if self.feedback_scorer is not None:
            t = time.perf_counter()
            gain = np.asarray(jax.device_get(self.feedback_scorer(params, jnp.asarray(prompts), jnp.asarray(lens),
                                                                  forest, jnp.asarray(self.placeholder))))
            inputs["feedback_gain_PxN"] = jnp.asarray(gain)
            metrics["multiturn/feedback_scoring_s"] = time.perf_counter() - t
            metrics["multiturn/feedback_gain_mean"] = float(np.nanmean(gain)) if np.isfinite(gain).any() else 0.0
            metrics["multiturn/feedback_turns"] = int(np.isfinite(gain).sum())
        if self.scorer is not None:
            t = time.perf_counter()
            inputs["truth_logp_PxN"] = self.truth_logp(params, examples, prompts, lens, forest)
            metrics["multiturn/truth_scoring_s"] = time.perf_counter() - t
        return inputs

    @staticmethod
    def semi_online_metrics(trees, arrays: dict, metrics: dict) -> None:
        """``multiturn/semi_online/step_reward_mean``, ``match_frac`` (turns matching the expert's step),
        ``patches_mean`` (patched turns per leaf slot)."""
        made = np.isfinite(arrays["step_reward_PxWxD"])
        slots = [ep for tr in trees for ep in tr.slot_episode]
        metrics["multiturn/semi_online/step_reward_mean"] = (float(np.mean(arrays["step_reward_PxWxD"][made]))
                                                            if made.any() else 0.0)
        metrics["multiturn/semi_online/match_frac"] = (float(np.mean(arrays["step_match_PxWxD"][made]))
                                                      if made.any() else 0.0)
        metrics["multiturn/semi_online/patches_mean"] = float(np.mean(
            [sum(bool(i.get("semi_online", {}).get("patched")) for i in ep.infos) for ep in slots])) if slots else 0.0

    def answer_rows(self, examples):
        """``(answer_PxLa, answer_lengths_P, answer_scored_PxLa)``: each prompt's ground truth written as the
        environment's answer line, ``truth_prefix + truth`` (only the truth's tokens scored), ``TRUTH_WIDTH`` wide
        (:func:`treejax.rl.info_gain.answer_tokens`)."""
        from treejax.rl.info_gain import answer_tokens

        return answer_tokens(self.base.tokenizer.encode, [ex.ground_truth for ex in examples],
                             prefix=self.truth_prefix, max_length=TRUTH_WIDTH)

    def trace_rule(self, params, examples, prompts, lens):
        """TRACE's fork rule for this step (:class:`treejax.rl.trace.TraceRule`): the policy's probability of each
        prompt's ground truth, written as ``truth_prefix + truth``, after a prefix predicts its success."""
        from treejax.rl.trace import TraceRule, cached_prefix_scorer

        answer, alen, scored = self.answer_rows(examples)
        prompts, lens = np.asarray(prompts), np.asarray(lens)
        return TraceRule(cached_prefix_scorer(self.model_config), params,
                         [prompts[p, :lens[p]] for p in range(len(lens))],
                         [answer[p, :alen[p]] for p in range(len(alen))], [scored[p, :alen[p]] for p in range(len(alen))],
                         width=prompts.shape[1] + self.tree_config.max_length + TRUTH_WIDTH,
                         branch_factor=self.config.branch_factor, fraction=self.config.trace_fraction,
                         pad_id=self.pad_id)

    def truth_logp(self, params, examples, prompts, lens, forest):
        """IGPO's teacher-forced scores ``[P, N]``: the mean log-prob of each prompt's ground truth, written as the
        answer line (``truth_prefix + truth``, the code tool's ``"Answer: <truth>"``; only the truth's tokens are scored), after every node
        (:func:`treejax.rl.info_gain.truth_logprobs`). The answer width is fixed (``TRUTH_WIDTH`` tokens) so the
        scorer compiles once."""
        answer, alen, scored = self.answer_rows(examples)
        truth = self.scorer(params, jnp.asarray(prompts), jnp.asarray(lens), forest, jnp.asarray(answer),
                            jnp.asarray(alen), jnp.asarray(scored))
        return jax.device_get(truth)


    def evaluate(self, params, examples, prompt_width: int, system_prompt=None, instruction=None,
                 batch_size: int = 64) -> dict:
        """The chain's held-out hook (:func:`treejax.rl.sources.base.chain_evaluate`): greedy episodes with the
        environment when ``MultiTurnConfig.eval_with_tools``, else nothing."""
        if not self.config.eval_with_tools:
            return {}
        return self.evaluate_episodes(params, examples, prompt_width, system_prompt, instruction, batch_size)

    def evaluate_episodes(self, params, examples, prompt_width: int, system_prompt=None, instruction=None,
                          batch_size: int = 64) -> dict:
        """Held-out evaluation with the environment: one greedy episode per problem (the same limits, observation
        format and stop tokens as training; batches of ``batch_size``). Returns ``tool_accuracy`` (episodes scoring
        1), ``tool_score`` (mean score), ``tool_calls_mean``, ``tool_turns_mean``."""
        b, tc, cfg = self.base, self.tree_config, self.config
        limits = TurnLimits(max_turns=cfg.max_turns, turn_tokens=cfg.turn_tokens, max_tokens=tc.max_length,
                            chunk=cfg.chunk)
        eps = greedy_tool_episodes(params, b.sampler_fns, b.tokenizer, self.make_env, list(examples), system_prompt,
                                   instruction, prompt_width, limits, tuple(tc.stop_ids or ()),
                                   self.observation_format, batch_size)
        return tool_metrics(eps)


def greedy_tool_episodes(params, model_fns, tokenizer, make_env, examples: list, system_prompt, instruction,
                         prompt_width: int, limits: TurnLimits, stop_ids: tuple, observation_format, batch_size: int
                         ) -> list:
    """One greedy episode per example with a fresh environment ``make_env()`` each (the held-out evaluation with
    tools of ``treejax-train`` and of ``treejax-sft``'s expert episodes), in batches of ``batch_size``."""
    from treejax.data.prompts import encode_examples, pad_token_lists
    from treejax.sampling.strategies import Greedy

    toks = encode_examples(tokenizer, examples, system_prompt, instruction)
    eps = []
    for i in range(0, len(toks), batch_size):
        prompts, lens = pad_token_lists(toks[i:i + batch_size], prompt_width)
        trees = run_turn_trees(params, model_fns, tokenizer, lambda p: make_env(), examples[i:i + batch_size],
                               prompts, lens, jax.random.key(0), Greedy(), limits, TurnTreeConfig(),
                               stop_ids=stop_ids, observation_format=observation_format)
        eps += [t.slot_episode[0] for t in trees]
    return eps


def tool_metrics(eps) -> dict:
    """``tool_accuracy`` (episodes scoring 1), ``tool_score`` (mean score), ``tool_calls_mean``, ``tool_turns_mean``
    of held-out episodes."""
    scores = np.array([episode_score(e) for e in eps])
    return {"tool_accuracy": float(np.mean(scores >= 1.0)), "tool_score": float(np.mean(scores)),
            "tool_calls_mean": float(np.mean([sum("tool_seconds" in i for i in e.infos) for e in eps])),
            "tool_turns_mean": float(np.mean([e.policy_turns for e in eps]))}


def answered(ep) -> bool:
    """The episode ended with an answer turn (the code tool's ``answered``; a game's ``found``)."""
    return bool(ep.infos) and bool(ep.infos[-1].get("answered", ep.infos[-1].get("found", False)))


def episode_score(ep) -> float:
    """An episode's score in [0, 1]: for environments that mark answer turns (the code tool's ``answered``), the
    verifier's score of the answer turn and 0 without one; otherwise (games) the episode's total reward, clipped;
    an environment that scores whole episodes puts the score in its last turn's ``info["episode_score"]`` (the
    task chain: the mean of its problems' scores, unfinished ones 0)."""
    if ep.infos and "episode_score" in ep.infos[-1]:  # the environment scores the whole episode (task chains)
        return float(ep.infos[-1]["episode_score"])
    if ep.infos and "answered" in ep.infos[-1]:
        return float(ep.rewards[-1]) if ep.infos[-1]["answered"] else 0.0
    return float(np.clip(sum(ep.rewards), 0.0, 1.0))


def episode_status(ep) -> int:
    """A leaf's :class:`~treejax.forest.NodeStatus`: FINISHED after an answer, EOS when the environment ended the
    episode otherwise, TRUNCATED at a turn or token limit."""
    return int(NodeStatus.TRUNCATED if ep.status != "done" else NodeStatus.FINISHED if answered(ep) else NodeStatus.EOS)


#: Token width of the ground-truth answer row of the IGPO scoring pass (a longer answer is an error).
TRUTH_WIDTH = 32


def state_clusters(trees, tokenizer, num_nodes: int, threshold: float = 0.95) -> np.ndarray:
    """int32[P, N]: per prompt, the nodes' observations (the text of a node's environment tokens) clustered
    greedily in node order: a node joins the first cluster whose first member's observation has a
    ``difflib.SequenceMatcher`` ratio >= ``threshold`` with its own (1.0: identical text only), else starts one;
    ``-1`` for the root, unused slots and nodes without observation tokens (GiGPO's similar anchor states,
    ``gigpo_similar``)."""
    import difflib

    out = np.full((len(trees), num_nodes), -1, np.int32)
    for p, tr in enumerate(trees):
        texts = {}
        for sp, ep in zip(tr.slot_path, tr.slot_episode):
            for n in sp[1:]:
                if n in texts:
                    continue
                node = tr.nodes[n]
                ids = [t for t, m in zip(ep.tokens[node.start:node.end], ep.policy_mask[node.start:node.end]) if not m]
                texts[n] = tokenizer.decode(ids, skip_special_tokens=True) if ids else None
        reps: list[str] = []
        for n in sorted(texts):
            if texts[n] is None:
                continue
            for k, rep in enumerate(reps):
                if rep == texts[n] or (threshold < 1.0 and
                                       difflib.SequenceMatcher(None, rep, texts[n]).ratio() >= threshold):
                    out[p, n] = k
                    break
            else:
                out[p, n] = len(reps)
                reps.append(texts[n])
    return out


def tool_success(trees, num_nodes: int) -> np.ndarray:
    """float32[P, N]: per turn node, 1 when its tool call ran cleanly, 0 when it failed or timed out, NaN when the
    turn made no call (PORTool's tool-success term, ``portool_tool``); NaN on the root and unused slots."""
    out = np.full((len(trees), num_nodes), np.nan, np.float32)
    for p, tr in enumerate(trees):
        for sp, ep in zip(tr.slot_path, tr.slot_episode):
            for d, n in enumerate(sp[1:]):
                info = ep.infos[d] if d < len(ep.infos) else {}
                if "tool_seconds" in info:
                    out[p, n] = 0.0 if info.get("tool_error") else 1.0
    return out


def action_signatures(trees, depth: int) -> tuple[np.ndarray, list[list[str]]]:
    """``(int32[P, W, D], names per prompt)``: per leaf slot, an id of its turn-``d + 1`` action's AST signature
    (``info["action_signature"]``, e.g. ``"find|wc"``; ids per prompt in order of first appearance, slot by slot),
    ``-1`` where the turn carries none (the answer turn, a refused call) or does not exist (A³'s sub-chains,
    :mod:`treejax.rl.advantages.a3`)."""
    W = len(trees[0].slot_episode) if trees else 0
    out = np.full((len(trees), W, depth), -1, np.int32)
    names = []
    for p, tr in enumerate(trees):
        ids: dict[str, int] = {}
        for w, ep in enumerate(tr.slot_episode):
            for d, info in enumerate(ep.infos[:depth]):
                if "action_signature" in info:
                    out[p, w, d] = ids.setdefault(str(info["action_signature"]), len(ids))
        names.append(list(ids))
    return out, names


__all__ = ["FORK_RULES", "MULTITURN_INPUTS", "SEMI_ONLINE_INPUTS", "action_signatures", "MultiTurnConfig", "MultiTurnRollouts", "answered",
           "episode_score", "episode_status", "state_clusters", "tool_success"]
