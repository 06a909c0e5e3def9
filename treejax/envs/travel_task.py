"""The travel world's planning requests (:mod:`treejax.envs.travel`) as the treejax task ``"travel_plans"``: each
request on its own generated database (:func:`~treejax.envs.travel_world.generate_db` of its ``world_seed``), with
its reference plan as the ground truth (any feasible plan passes), the searches behind it as reference calls
(``metadata["reference_calls"]``: ``{"name": "flights" | "trains" | "hotels", "args": {"query": ...}}``) and the
trajectory-level verifier as the task's verifier."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Optional

import numpy as np

from treejax.data.splits import check_split
from treejax.data.task_base import Example, Task, check_generated_task_options, register_task
from treejax.envs.travel_world import check_feasibility, describe, generate_db, make_request, parse_plan
from treejax.errors import DataError

INSTRUCTION = ("You plan trips with tools over a travel database. Search with <flights>FROM TO DAY</flights>, "
               "<trains>FROM TO DAY</trains> or <hotels>CITY</hotels>; the results come back between <output> and "
               "</output>. Only state prices and times as the results show them. When you have a plan, reply without "
               "a tool call and end with the line 'Answer: go=<id>; back=<id>; hotel=<id>'.")
#: The request templates (one: every request has a budget, dates and cities; a third add a mode, a third a class).
TEMPLATES = ("trip",)


def reference_calls(record_request: dict, plan_ids: tuple[str, str], db) -> list[dict]:
    """The searches that list the reference plan's legs and hotel."""
    r, (go, back) = record_request, plan_ids
    return [{"name": db.legs[go].kind + "s", "args": {"query": f"{r['origin']} {r['dest']} {r['start']}"}},
            {"name": db.legs[back].kind + "s", "args": {"query": f"{r['dest']} {r['origin']} {r['end']}"}},
            {"name": "hotels", "args": {"query": r["dest"]}}]


class TravelTask(Task):
    """The planning requests (module docstring). ``size`` / ``eval_size``: requests per split (each on its own
    database; train and eval seeds are disjoint); ``seed``; ``inconsistent_credit``: the reward ``c`` in [0, 1) of
    a feasible plan the turn-level verifier rejects (:func:`~treejax.envs.travel_world.hierarchical_reward`);
    ``extraction``: ``"answer_line"`` (the only mode)."""

    eval_options = "give task_options eval_size=N (> 0) for N held-out requests"
    world = "travel"  # the environment 'travel' runs on this task's databases

    def __init__(self, *, size: int = 512, eval_size: int = 64, seed: int = 0, templates: Optional[tuple] = None,
                 inconsistent_credit: float = 0.0, system_prompt: Optional[str] = None,
                 instruction: Optional[str] = INSTRUCTION, extraction: str = "answer_line", name: str = "travel_plans"):
        self.templates = check_generated_task_options("travel_plans", templates, TEMPLATES, size, eval_size, extraction)
        if not (isinstance(inconsistent_credit, (int, float)) and 0.0 <= inconsistent_credit < 1.0):
            raise DataError(f"travel_plans: inconsistent_credit must be in [0, 1), got {inconsistent_credit!r}; fix: "
                            "RunConfig.task_options['inconsistent_credit'] = 0.0")
        self.size, self.eval_size, self.seed = size, eval_size, seed
        self.inconsistent_credit = float(inconsistent_credit)
        self.system_prompt, self.instruction, self.name = system_prompt, instruction, name

    @functools.lru_cache(maxsize=2)
    def records(self, split: str) -> list[dict[str, str]]:
        train = check_split(split) == "train"
        out = []
        for i in range(self.size if train else self.eval_size):
            world_seed = int(np.random.default_rng([self.seed, 0 if train else 1, i]).integers(2 ** 31))
            req, plan = make_request(world_seed)
            request = dataclasses.asdict(req)
            meta = {"world_seed": world_seed, "request": request, "template": "trip",
                    "reference_calls": reference_calls(request, (plan.go, plan.back), generate_db(world_seed))}
            question = describe(req)
            uid = hashlib.sha256(f"travel-v1\0{world_seed}\0{question}".encode()).hexdigest()[:16]
            out.append({"uid": uid, "question": question, "answer": plan.text(), "metadata": json.dumps(meta)})
        return out

    def score(self, response_text: str, example: Example) -> float:
        """1.0 when the plan of the last ``Answer:`` line passes the trajectory-level verifier (single-turn: there
        are no tool outputs for the turn-level verifier; the environment's reward adds it)."""
        from treejax.envs.travel import example_world

        req, db = example_world(example)
        return float(check_feasibility(parse_plan(response_text), req, db).feasible)


register_task("travel_plans", TravelTask)

__all__ = ["INSTRUCTION", "TEMPLATES", "TravelTask", "reference_calls"]
