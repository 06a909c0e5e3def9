"""The turn sampler's types: what it returns (:class:`Episode`, :class:`TurnNode`, :class:`TurnTree`), what a fork
rule sees (:class:`ForkRequest`), the run's constants (:class:`TurnContext`), the rows in flight
(:class:`TurnRows`, host state the stages of :mod:`treejax.sampling.turns.stages` change in place) and one decode
round's output (:class:`Decoded`).

Shapes: ``P`` prompts, ``W`` leaf slots per prompt, ``B = P W`` cache rows (prompt ``p`` owns rows ``p W .. p W +
W - 1``), ``C`` tokens per decode chunk. Row ``b`` belongs to prompt ``b // W``; a path owning slots ``[lo, hi)``
of its prompt decodes on row ``p W + lo``, so the rows ``p W + a`` for ``lo < a < hi`` are free until one of the
path's forks takes them (a path's slots only ever shrink, so no two paths share a row).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from treejax.sampling import attention as attention_lib
from treejax.sampling import decode
from treejax.sampling.strategies import Strategy
from treejax.sampling.turns.config import TurnLimits, TurnTreeConfig


@dataclasses.dataclass
class Episode:
    """One conversation's response: the ``tokens`` after the prompt, ``policy_mask`` (True on sampled tokens: only
    they may enter a loss), the policy's ``logprobs`` of the sampled tokens (0 elsewhere), the ``turns`` as spans
    ``(start, end, "policy" | "env")`` of ``tokens``, the ``rewards`` and ``infos`` of the environment's steps,
    the ``status`` (``"running"``, ``"done"``, ``"max_turns"`` or ``"max_tokens"``) and the seconds spent in the
    environment. Invariant: the spans tile ``tokens`` in order, and ``policy_mask`` is True exactly on the policy
    spans."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    policy_mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    infos: list[dict] = dataclasses.field(default_factory=list)
    status: str = "running"
    env_seconds: float = 0.0

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def policy_turns(self) -> int:
        return sum(1 for t in self.turns if t[2] == "policy")

    def _add(self, toks, logps, policy: bool) -> None:
        start = len(self.tokens)
        self.tokens += [int(t) for t in toks]
        self.logprobs += [float(x) for x in logps] if policy else [0.0] * len(toks)
        self.policy_mask += [policy] * len(toks)
        self.turns.append((start, len(self.tokens), "policy" if policy else "env"))


@dataclasses.dataclass
class TurnNode:
    """A node of a turn tree: response tokens ``[start, end)`` of the paths through it (its policy turn and the
    observation appended after it; the first node of a path also holds the reset observation before its turn),
    its ``parent`` node and ``depth`` (the root, node 0, is the prompt: depth 0, no tokens)."""

    parent: int
    depth: int
    start: int
    end: int


@dataclasses.dataclass
class TurnTree:
    """One prompt's tree of turns: ``nodes`` (node 0 the root), and per leaf slot its ``slot_path`` (node ids from
    the root to its last node) and ``slot_episode`` (the :class:`Episode` of that path: its tokens, masks,
    log-probs, rewards, status; the slots of one path share the object). Node ``n`` at depth ``d`` holds the
    episode's ``d``-th policy turn: its reward is ``slot_episode[s].rewards[d - 1]`` on any slot through it."""

    nodes: list[TurnNode]
    slot_path: list[list[int]]
    slot_episode: list[Episode]
    forks: int = 0


@dataclasses.dataclass(frozen=True)
class ForkRequest:
    """A path that may fork at a turn boundary: its ``prompt`` index, its :class:`Episode` so far (the conversation
    through the observation just appended) and the number of leaf ``slots`` it owns (>= 2)."""

    prompt: int
    episode: Episode
    slots: int


@dataclasses.dataclass(frozen=True, eq=False)
class TurnContext:
    """What every stage reads and none changes: the prepared sampler ``params``, ``model`` (sampler fns with
    ``extend``), ``tokenizer``, ``make_env(p)``, the ``examples``, the validated prompts ``tokens_PxLp`` /
    ``lengths_P``, the rollout ``key``, ``strategy``, ``limits``, ``tree``, ``stop_ids``, the observation
    formatter ``fmt`` and ``fork_rule(requests) -> child counts``; ``bucket`` (the prompts' padded width) and
    ``cache_length`` (``bucket + max_tokens``, rounded for the attention kernels)."""

    params: Any
    model: decode.ModelFns
    tokenizer: Any
    make_env: Callable[[int], Any]
    examples: list
    tokens_PxLp: np.ndarray
    lengths_P: np.ndarray
    key: jax.Array
    strategy: Strategy
    limits: TurnLimits
    tree: TurnTreeConfig
    stop_ids: tuple[int, ...]
    fmt: Callable[[str], str]
    fork_rule: Callable[[list[ForkRequest]], list[int]]
    bucket: int
    cache_length: int

    @property
    def P(self) -> int:
        return self.tokens_PxLp.shape[0]

    @property
    def W(self) -> int:
        return self.tree.num_slots

    @property
    def B(self) -> int:
        return self.P * self.W

    def text(self, ids) -> str:
        """The text of token ``ids`` (special tokens skipped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @classmethod
    def create(cls, params, model: decode.ModelFns, tokenizer, make_env: Callable[[int], Any], examples: list,
               prompts, prompt_lengths, key: jax.Array, strategy: Strategy, limits: TurnLimits, tree: TurnTreeConfig,
               stop_ids: tuple[int, ...], observation_format: Callable[[str], str] | None,
               fork_rule: Callable[[list[ForkRequest]], list[int]] | None) -> TurnContext:
        """Checks the inputs (prompts, one example per prompt, a model that can append observations) and
        prepares the sampler's parameters. Defaults: observations as is, ``min(branch_factor, slots)`` children."""
        tokens, lens = decode.validate_prompts(prompts, prompt_lengths)
        P = tokens.shape[0]
        if len(examples) != P:
            raise ValueError(f"run_turn_trees: {P} prompts and {len(examples)} examples")
        if model.extend is None:
            raise ValueError(f"ModelFns {model.name!r} cannot append observations (no extend)")
        bucket = decode.bucket_length(tokens.shape[1])
        length = attention_lib.round_cache_length(bucket + limits.max_tokens, model.cache_multiple)
        return cls(model.prepare(params), model, tokenizer, make_env, examples, tokens, lens, key, strategy, limits,
                   tree, tuple(stop_ids), observation_format or (lambda text: text),
                   fork_rule or (lambda reqs: [min(tree.branch_factor, r.slots) for r in reqs]), bucket, length)


@dataclasses.dataclass
class TurnRows:
    """The ``B`` cache rows in flight (host; the stages change them in place). Per row ``b``:

    ``pending_B`` / ``position_B``: the decode row protocol (:mod:`treejax.sampling.decode`): the token whose KV is
    not written yet and its position; ``active_B``: the row holds an episode that goes on; ``slots_Bx2``: the leaf
    slots ``[lo, hi)`` of its prompt the row's path owns; ``episode_B`` / ``env_B``: its :class:`Episode` and
    environment (``None`` on a free row); ``path_B``: the node ids of its path below the root; ``node_start_B``: the
    response length where its open node began; ``turn_B``: the ``(token, log-prob)`` pairs of the policy turn
    being decoded (not yet in the episode). Response token ``t`` of row ``b`` is ``len(episode_B[b].tokens) +
    len(turn_B[b])`` when it is drawn."""

    pending_B: np.ndarray
    position_B: np.ndarray
    active_B: np.ndarray
    slots_Bx2: np.ndarray
    node_start_B: np.ndarray
    episode_B: list
    env_B: list
    path_B: list[list[int]]
    turn_B: list[list]

    @classmethod
    def empty(cls, B: int) -> TurnRows:
        return cls(np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, bool), np.zeros((B, 2), np.int64),
                   np.zeros(B, np.int64), [None] * B, [None] * B, [[] for _ in range(B)], [[] for _ in range(B)])

    def copy_row(self, src: int, dst: int, slots: tuple[int, int]) -> None:
        """Row ``dst`` becomes a copy of row ``src`` owning ``slots``: its protocol state, a deep copy of the
        episode, a ``clone()`` of the environment, the path so far; an empty turn (a fork happens between turns)."""
        self.pending_B[dst], self.position_B[dst], self.active_B[dst], self.slots_Bx2[dst] = (
            self.pending_B[src], self.position_B[src], True, slots)
        self.episode_B[dst] = copy.deepcopy(self.episode_B[src])
        self.env_B[dst] = self.env_B[src].clone()
        self.path_B[dst], self.node_start_B[dst], self.turn_B[dst] = list(self.path_B[src]), self.node_start_B[src], []


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One decode round (host copies): ``live_B`` the rows decoded, their new ``pending_B`` / ``position_B``, the
    tokens ``tokens_BxC`` and log-probs ``logp_BxC`` (the first ``count_B`` of each row are real) and ``stopped_B``
    (the row sampled a stop token)."""

    live_B: np.ndarray
    pending_B: np.ndarray
    position_B: np.ndarray
    tokens_BxC: np.ndarray
    logp_BxC: np.ndarray
    count_B: np.ndarray
    stopped_B: np.ndarray


__all__ = ["Decoded", "Episode", "ForkRequest", "TurnContext", "TurnNode", "TurnRows", "TurnTree"]
