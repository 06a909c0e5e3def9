"""The travel-planning world (DeepTravel, Ning et al. 2025, arXiv 2509.21842): an offline, deterministic sandbox of
flights, trains and hotels generated from each request's seed (:mod:`treejax.envs.travel_world`), searched with
tools, and a plan scored by the hierarchical reward of a trajectory-level feasibility verifier and a turn-level
consistency verifier. The requests are the task ``"travel_plans"`` (:mod:`treejax.envs.travel_task`).

The protocol follows the code tool's: a turn that ends with a call runs it, the output comes back between
``<output>`` and ``</output>``; a turn without a call is the answer, its last line ``Answer: go=<id>; back=<id>;
hotel=<id>`` (the values below are illustrative)::

    env = TravelEnv(task)
    env.reset(example)                         # -> ""
    env.step("<trains>Oshal Halav 3</trains>")
        # -> "\\n<output>\\nTR087 Oshal->Halav day 3 dep 07:10 arr 11:25 $96\\n..."
    env.step("<hotels>Halav</hotels>")         # -> "\\n<output>\\nHT004 Halav 3 stars $135/night\\n...</output>\\n"
    env.step("TR087 at $96 is the cheapest. Answer: go=TR087; back=TR017; hotel=HT004")
        # -> StepResult("", 1.0, True, {"answered": True, "travel_level": "ok", ...})

**Tools** (:data:`TOOLS`): ``<flights>FROM TO DAY</flights>`` and ``<trains>FROM TO DAY</trains>`` list that
day's legs (``id from->to day d dep HH:MM arr HH:MM $price``, by departure), ``<hotels>CITY</hotels>`` a city's
hotels (``id city n stars $price/night``); cities match without case. A malformed call or an unknown city is an
``[error]`` line (``tool_error``). At most ``max_calls`` calls per episode (``MultiTurnConfig.max_turns - 1``).

**The reward** of the answer turn is :func:`~treejax.envs.travel_world.hierarchical_reward` over the episode's
turns and the outputs they saw (the task's ``inconsistent_credit``); a call past the limit ends the episode with
that turn scored the same way. The answer turn's info holds ``travel_level`` (``no_plan``, ``infeasible``,
``inconsistent``, ``ok``), ``travel_reason``, ``travel_cost`` and ``turn_consistent``.

**State.** The example, the call count and two tuples, the turns' texts and the outputs they got; the database is
built once per seed and shared, read-only. ``clone()`` is ``dataclasses.replace(self)``: a clone's future equals a
fresh replay of the same actions.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, ClassVar, Optional

from treejax.envs.base import StepResult, register_env, tool_step
from treejax.envs.travel_world import Request, TravelDB, generate_db, hhmm, hierarchical_reward
from treejax.errors import ConfigError

#: The tools and their argument forms.
TOOLS = {"flights": "FROM TO DAY", "trains": "FROM TO DAY", "hotels": "CITY"}
_CALL = re.compile(r"<(flights|trains|hotels)>(.*?)</\1>\s*$", re.S)


def parse_call(action: str) -> Optional[dict]:
    """The call that ends ``action`` as ``{"name": tool, "args": {"query": text}}`` (MatchTIR's call shape), else
    ``None`` (the answer turn)."""
    m = _CALL.search(action.rstrip())
    if m is None:
        return None
    body = m.group(2)
    opener = f"<{m.group(1)}>"
    body = body[body.rfind(opener) + len(opener):] if opener in body else body
    return {"name": m.group(1), "args": {"query": " ".join(body.split())}}


def run_tool(db: TravelDB, call: dict) -> tuple[str, bool]:
    """``(output, error)`` of one call on the database (module docstring)."""
    name, words = call["name"], call["args"]["query"].split()
    usage = f"[error] usage: <{name}>{TOOLS[name]}</{name}>"
    by_name = {c.lower(): c for c in db.cities}
    if len(words) != len(TOOLS[name].split()):
        return usage, True
    unknown = [w for w in (words if name == "hotels" else words[:2]) if w.lower() not in by_name]
    if unknown:
        return f"[error] unknown city {unknown[0]!r} (cities: {', '.join(db.cities)})", True
    if name == "hotels":
        rows = [f"{h.id} {h.city} {h.stars} stars ${h.price}/night" for h in db.find_hotels(by_name[words[0].lower()])]
        return "\n".join(rows), False
    if not words[2].isdigit():
        return usage, True
    origin, dest, day = by_name[words[0].lower()], by_name[words[1].lower()], int(words[2])
    legs = db.find_legs(name[:-1], origin, dest, day)
    if not legs:
        return f"no {name} from {origin} to {dest} on day {day}", False
    return "\n".join(f"{g.id} {g.origin}->{g.dest} day {g.day} dep {hhmm(g.dep)} arr {hhmm(g.arr)} ${g.price}"
                     for g in legs), False


def example_world(example) -> tuple[Request, TravelDB]:
    """An example's request and database (its metadata's ``world_seed`` and ``request``)."""
    meta = example.metadata
    return Request(**meta["request"]), generate_db(int(meta["world_seed"]))


@register_env("travel")
@dataclasses.dataclass
class TravelEnv:
    """The travel-planning world (module docstring). ``task``: a :class:`~treejax.envs.travel_task.TravelTask`;
    ``max_calls``: tool calls per episode."""

    task: Any
    max_calls: int = 5
    stop_strings: tuple[str, ...] = ("</flights>", "</trains>", "</hotels>")
    example: Any = None
    calls: int = 0
    done: bool = False
    turns: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    #: The task whose world this environment runs (MultiTurnConfig's check refuses others).
    tasks: ClassVar[tuple[str, ...]] = ("travel_plans",)
    #: Its examples ship reference calls (the searches behind the reference plan), for MatchTIR.
    reference_calls: ClassVar[bool] = True
    #: It can replay an expert trajectory (``parse_action`` / ``render_call``): expert-episode SFT
    #: (:mod:`treejax.sft_episodes`) and UI-S1's semi-online rollout (:class:`treejax.envs.semi_online.SemiOnlineEnv`).
    expert_steps: ClassVar[bool] = True
    parse_action = staticmethod(parse_call)

    @staticmethod
    def render_call(call: dict) -> str:
        """The action text of a call (``<flights>Oshal Halav 3</flights>``), which :func:`parse_call` reads back as
        the same call."""
        if call.get("name") not in TOOLS:
            raise ValueError(f"the travel world's tools are {sorted(TOOLS)}; got a call to {call.get('name')!r}")
        return f"<{call['name']}>{call['args']['query']}</{call['name']}>"

    def __post_init__(self):
        if self.max_calls < 0:
            raise ValueError(f"TravelEnv: max_calls >= 0 required, got {self.max_calls}")
        if getattr(self.task, "world", None) != "travel":
            raise ConfigError(f"environment 'travel' runs on its task's travel databases, and task {self.task!r} has "
                              "none; fix: RunConfig.task = 'travel_plans'")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "TravelEnv":
        """One episode's world: ``config.max_turns - 1`` calls (the last turn is for the answer)."""
        return cls(task, max_calls=config.max_turns - 1)

    def reset(self, example) -> str:
        self.example, self.calls, self.done, self.turns, self.outputs = example, 0, False, (), ()
        example_world(example)  # the database is built (and cached) now, not inside the first step
        return ""

    def step(self, action: str) -> StepResult:
        if self.example is not None and not self.done and (parse_call(action) is None or self.calls >= self.max_calls):
            return self.finish(action)
        result = tool_step(self, action, parse_call, self._run)
        self.turns, self.outputs = self.turns + (action,), self.outputs + (result.observation,)
        return result

    def finish(self, action: str) -> StepResult:
        """The episode's last turn (the answer, or a call past the limit), scored by the hierarchical reward."""
        self.done, self.turns = True, self.turns + (action,)
        req, db = example_world(self.example)
        reward, verdict = hierarchical_reward(self.turns, self.outputs, req, db,
                                              getattr(self.task, "inconsistent_credit", 0.0))
        info = {"tool_calls": self.calls, "answered": parse_call(action) is None, "travel_level": verdict.level,
                "travel_reason": verdict.reason, "travel_cost": verdict.cost,
                "turn_consistent": verdict.turn_consistent}
        if parse_call(action) is not None:
            info["call_limit"] = True
            obs = f"\n<output>\n[error] no tool calls left ({self.max_calls} per episode)\n</output>\n"
            return StepResult(obs, reward, True, info)
        return StepResult("", reward, True, info)

    def _run(self, call: dict) -> tuple[str, dict]:
        t = time.perf_counter()
        body, error = run_tool(example_world(self.example)[1], call)
        return body, {"tool_seconds": time.perf_counter() - t, "tool_error": error, "tool_call": call}

    def clone(self) -> "TravelEnv":
        return dataclasses.replace(self)  # plain immutable state; the database is shared, read-only


__all__ = ["TOOLS", "TravelEnv", "example_world", "parse_call", "run_tool"]
