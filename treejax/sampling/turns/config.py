"""The static shape of a turn rollout: :class:`TurnLimits` (how long turns and episodes may run),
:class:`TurnTreeConfig` (how a prompt's leaf slots are shared by roots and forks) and :func:`chat_observation` (how an
observation becomes a user turn of a chat template)."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """``max_turns`` policy turns per episode, ``turn_tokens`` sampled tokens per turn, ``max_tokens`` response
    tokens in all (the cache's response capacity), ``chunk`` tokens decoded between host checks."""

    max_turns: int = 4
    turn_tokens: int = 256
    max_tokens: int = 1024
    chunk: int = 16

    def __post_init__(self):
        if min(self.max_turns, self.turn_tokens, self.max_tokens, self.chunk) < 1:
            raise ValueError(f"TurnLimits: every limit must be >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class TurnTreeConfig:
    """The shape of a tree of turns (:mod:`treejax.sampling.turns`): ``num_slots`` W leaf slots per prompt,
    ``roots`` episodes started from the prompt, each owning ``W / roots`` slots (split as evenly as possible); at
    the end of each of a path's first ``fork_turns`` policy turns (when the episode goes on), a row owning
    ``n > 1`` slots forks into ``min(branch_factor, n)`` children (``fork_rule`` may choose fewer), its slots split
    evenly among them. ``roots = num_slots``: independent episodes."""

    num_slots: int = 1
    roots: int = 1
    branch_factor: int = 2
    fork_turns: int = 1

    def __post_init__(self):
        if not 1 <= self.roots <= self.num_slots:
            raise ValueError(f"TurnTreeConfig: need 1 <= roots <= num_slots, got {self}")
        if self.branch_factor < 1 or self.fork_turns < 0:
            raise ValueError(f"TurnTreeConfig: branch_factor >= 1 and fork_turns >= 0 required, got {self}")


def chat_observation(tokenizer) -> Callable[[str], str]:
    """A formatter that wraps an observation as a user turn of ``tokenizer``'s chat template, ending with the
    assistant's opening, so the policy answers in a new turn. The template's text between an assistant message and
    the next user message's content is found by rendering a probe conversation; the assistant's end-of-turn marker
    is left out when the policy's turn already ended with it (its stop token)."""
    probe = [{"role": "user", "content": "\x00A"}, {"role": "assistant", "content": "\x00B"},
             {"role": "user", "content": "\x00C"}]
    text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    between = text[text.index("\x00B") + 2:]
    before, after = between.split("\x00C")
    return lambda obs: f"{before}{obs}{after}"


__all__ = ["TurnLimits", "TurnTreeConfig", "chat_observation"]
