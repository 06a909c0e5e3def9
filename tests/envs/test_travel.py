"""The travel-planning world (treejax.envs.travel, travel_world, travel_task): the generated databases and
requests, the tools, the reset/step/clone contract (a clone's future equals a fresh replay), the two verifiers and
the hierarchical reward on hand-made plans, and that the tools are needed (the reference searches solve every
request; a plan without them earns nothing)."""

from __future__ import annotations

import dataclasses

import pytest

from treejax.data.tasks import get_task
from treejax.envs.travel import TravelEnv, example_world, parse_call, run_tool
from treejax.envs.travel_world import (MODES, NUM_DAYS, Hotel, Leg, Plan, Request, TravelDB, check_consistency,
                                       check_feasibility, claims, generate_db, hierarchical_reward, make_request,
                                       parse_plan, plan_cost)
from treejax.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def task():
    return get_task("travel_plans", size=40, eval_size=8, seed=0)


def examples(task, split="train"):
    return [task.make_example(r) for r in task.records(split)]


def call(c: dict) -> str:
    return f"<{c['name']}>{c['args']['query']}</{c['name']}>"


# ------------------------------------------------------------------------------------------------- the data
def test_databases_are_deterministic_and_complete():
    a, b = generate_db(5), generate_db.__wrapped__(5)  # a cached and a fresh build of the same seed
    assert a.cities == b.cities and a.legs == b.legs and a.hotels == b.hotels
    assert generate_db(6).cities != a.cities
    assert len(set(a.legs) | set(a.hotels)) == len(a.legs) + len(a.hotels)  # ids unique in the world
    for o in a.cities:
        for d in a.cities:
            for day in range(1, NUM_DAYS + 1):
                for kind in MODES:
                    legs = a.find_legs(kind, o, d, day) if o != d else [None]
                    assert 1 <= len(legs) <= 2
    assert all(0 <= g.dep < g.arr <= 23 * 60 + 55 for g in a.legs.values())


def test_requests_have_a_feasible_reference_and_disjoint_splits(task):
    train, held = task.records("train"), task.records("eval")
    assert task.records("train") == get_task("travel_plans", size=40, eval_size=8, seed=0).records("train")
    assert not {r["uid"] for r in train} & {r["uid"] for r in held}
    for ex in examples(task) + examples(task, "eval"):
        req, db = example_world(ex)
        plan = parse_plan("Answer: " + ex.ground_truth)
        assert check_feasibility(plan, req, db).level == "ok"
        assert plan_cost(db, plan, req.nights) <= req.budget
        assert 1 <= req.nights <= 2 and req.end <= NUM_DAYS
    kinds = [(r.mode is not None, r.min_stars > 0) for r in (example_world(e)[0] for e in examples(task))]
    assert {(False, False), (True, False), (False, True)} <= set(kinds)


def test_the_tools_answer_from_the_database():
    db = generate_db(3)
    o, d = db.cities[0], db.cities[1]
    out, err = run_tool(db, {"name": "trains", "args": {"query": f"{o.lower()} {d} 2"}})
    legs = db.find_legs("train", o, d, 2)
    assert not err and out.splitlines() == [
        f"{g.id} {o}->{d} day 2 dep {g.dep // 60:02d}:{g.dep % 60:02d} arr {g.arr // 60:02d}:{g.arr % 60:02d} "
        f"${g.price}" for g in legs]
    out, err = run_tool(db, {"name": "hotels", "args": {"query": d}})
    assert not err and len(out.splitlines()) == 4 and all(f" {d} " in line for line in out.splitlines())
    assert run_tool(db, {"name": "flights", "args": {"query": f"{o} {d} 9"}}) == (
        f"no flights from {o} to {d} on day 9", False)
    assert run_tool(db, {"name": "flights", "args": {"query": f"{o} {d}"}}) == (
        "[error] usage: <flights>FROM TO DAY</flights>", True)
    out, err = run_tool(db, {"name": "hotels", "args": {"query": "Atlantis"}})
    assert err and out.startswith("[error] unknown city 'Atlantis'")
    assert parse_call("I will look. <hotels> Loos </hotels>") == {"name": "hotels", "args": {"query": "Loos"}}
    assert parse_call("Answer: go=FL001; back=FL002; hotel=HT001") is None


# ---------------------------------------------------------------------------------- reset / step / clone
def test_reset_step_clone_and_fresh_replay_agree(task):
    ex = examples(task)[0]
    ref = [call(c) for c in ex.metadata["reference_calls"]]
    env = TravelEnv(task, max_calls=5)
    assert env.reset(ex) == ""
    first = env.step(ref[0])
    assert not first.done and first.reward == 0.0 and first.info["tool_call"]["name"] in ("flights", "trains")
    twin = env.clone()
    rest = ref[1:] + ["Answer: " + ex.ground_truth]
    a = [env.step(x) for x in rest]
    b = [twin.step(x) for x in rest]
    fresh = TravelEnv(task, max_calls=5)
    fresh.reset(ex)
    c = [fresh.step(x) for x in ref[:1] + rest][1:]
    strip = lambda rs: [dataclasses.replace(r, info={k: v for k, v in r.info.items() if k != "tool_seconds"})  # noqa
                        for r in rs]
    assert strip(a) == strip(b) == strip(c)
    assert a[-1].done and a[-1].reward == 1.0 and a[-1].info["travel_level"] == "ok"
    assert env.turns == twin.turns == fresh.turns and env.outputs == twin.outputs == fresh.outputs
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("Answer: x")
    with pytest.raises(RuntimeError, match="before reset"):
        TravelEnv(task).step(ref[0])


def test_the_call_limit_ends_the_episode(task):
    ex = examples(task)[1]
    env = TravelEnv(task, max_calls=1)
    env.reset(ex)
    env.step(call(ex.metadata["reference_calls"][0]))
    last = env.step(call(ex.metadata["reference_calls"][1]))
    assert last.done and last.reward == 0.0 and last.info["call_limit"] and not last.info["answered"]
    assert "no tool calls left" in last.observation


def test_the_tools_are_needed(task):
    """Replaying each request's reference searches and stating its reference plan solves all 40; the same plan
    without the searches passes the trajectory verifier (and the task's single-turn verifier) but not the turn
    verifier (its ids were never shown), so it earns 0."""
    solved = blind = 0
    for ex in examples(task):
        env = TravelEnv(task, max_calls=5)
        env.reset(ex)
        for c in ex.metadata["reference_calls"]:
            assert not env.step(call(c)).info["tool_error"]
        solved += env.step("Answer: " + ex.ground_truth).reward
        env = TravelEnv(task, max_calls=5)
        env.reset(ex)
        r = env.step("Answer: " + ex.ground_truth)
        blind += r.reward
        assert r.info["travel_level"] == "inconsistent" and task.score("Answer: " + ex.ground_truth, ex) == 1.0
    assert (solved, blind) == (40, 0)


# ------------------------------------------------------------------------------------- the verifiers by hand
def hand_db() -> TravelDB:
    legs = [Leg("FL001", "flight", "Avel", "Borin", 1, 8 * 60, 9 * 60 + 30, 200),
            Leg("TR001", "train", "Avel", "Borin", 1, 7 * 60, 11 * 60, 60),
            Leg("FL002", "flight", "Borin", "Avel", 3, 18 * 60, 19 * 60 + 15, 180),
            Leg("TR002", "train", "Borin", "Avel", 3, 9 * 60, 13 * 60 + 5, 70),
            Leg("TR003", "train", "Borin", "Avel", 2, 9 * 60, 13 * 60, 50)]
    hotels = [Hotel("HT001", "Borin", 3, 100), Hotel("HT002", "Borin", 5, 220), Hotel("HT003", "Avel", 4, 90)]
    return TravelDB(0, ("Avel", "Borin"), {g.id: g for g in legs}, {h.id: h for h in hotels})


REQ = Request("Avel", "Borin", 1, 3, budget=400)


@pytest.mark.parametrize("plan, level, reason", [
    ("go=TR001; back=TR002; hotel=HT001", "ok", "feasible"),                        # 60 + 70 + 2 x 100 = 330
    ("go=TR001; back=TR002", "no_plan", "no 'Answer:"),
    ("go=TR001; back=TR009; hotel=HT001", "infeasible", "back: no item TR009"),
    ("go=FL002; back=TR002; hotel=HT001", "infeasible", "go: FL002 is Borin->Avel on day 3"),
    ("go=TR001; back=TR003; hotel=HT001", "infeasible", "back: TR003 is Borin->Avel on day 2, not Borin->Avel on "
                                                        "day 3"),
    ("go=TR001; back=TR002; hotel=HT003", "infeasible", "hotel: HT003 is in Avel"),
    ("go=FL001; back=FL002; hotel=HT001", "infeasible", "budget: the plan costs $580, over $400"),
])
def test_the_trajectory_verifier_on_hand_made_plans(plan, level, reason):
    v = check_feasibility(parse_plan("Some text.\nAnswer: " + plan), REQ, hand_db())
    assert v.level == level and v.reason.startswith(reason), v


def test_mode_and_class_constraints():
    db, plan = hand_db(), parse_plan("answer: GO=tr001; back = FL002; hotel=HT002")
    assert plan == Plan("TR001", "FL002", "HT002")
    big = dataclasses.replace(REQ, budget=1000)
    assert check_feasibility(plan, big, db).level == "ok"  # 60 + 180 + 440 = 680
    assert check_feasibility(plan, dataclasses.replace(big, mode="train"), db).reason == \
        "mode: both legs must be by train"
    assert check_feasibility(Plan("TR001", "TR002", "HT001"), dataclasses.replace(big, min_stars=4), db).reason == \
        "hotel: HT001 has 3 stars, fewer than 4"


def test_the_turn_verifier_on_hand_made_turns():
    db = hand_db()
    out1 = "\n<output>\nTR001 Avel->Borin day 1 dep 07:00 arr 11:00 $60\nFL001 ...\n</output>\n"
    out2 = "\n<output>\nHT001 Borin 3 stars $100/night\n</output>\n"
    assert claims("TR001 at $60, FL001 $200 dep 08:00\nnone here") == [("TR001", " at $60, "),
                                                                       ("FL001", " $200 dep 08:00")]
    turns = ("<trains>Avel Borin 1</trains>",                          # no claims: agrees
             "TR001 leaves 7:00 for $60. <hotels>Borin</hotels>",        # shown, price and time right
             "HT001 is $100/night, TR002 back. Answer: go=TR001; back=TR002; hotel=HT001")  # TR002 never shown
    assert check_consistency(turns, (out1, out2), db) == (True, True, False)
    assert check_consistency(("TR001 is $65 <x>",), (), db) == (False,)            # not shown before turn 1
    assert check_consistency(("a", "TR001 is $65"), (out1,), db) == (True, False)   # wrong price
    assert check_consistency(("a", "TR001 arrives 11:30"), (out1,), db) == (True, False)  # wrong time
    assert check_consistency(("a", "HT001 TR001 at 11:00"), (out1,), db) == (True, False)  # HT001 shown only later


def test_the_hierarchical_reward_runs_the_turn_verifier_only_on_feasible_plans():
    db = hand_db()
    out = ("\n<output>\nTR001 Avel->Borin day 1 dep 07:00 arr 11:00 $60\n</output>\n",
           "\n<output>\nTR002 Borin->Avel day 3 dep 09:00 arr 13:05 $70\n</output>\n",
           "\n<output>\nHT001 Borin 3 stars $100/night\n</output>\n")
    searches = ("<trains>Avel Borin 1</trains>", "<trains>Borin Avel 3</trains>", "<hotels>Borin</hotels>")
    good = searches + ("TR001 $60, TR002 $70, HT001 $100. Answer: go=TR001; back=TR002; hotel=HT001",)
    r, v = hierarchical_reward(good, out, REQ, db)
    assert (r, v.level, v.cost, v.turn_consistent) == (1.0, "ok", 330, (True,) * 4)
    lying = searches + ("TR002 is only $40. Answer: go=TR001; back=TR002; hotel=HT001",)
    assert hierarchical_reward(lying, out, REQ, db)[0] == 0.0
    r, v = hierarchical_reward(lying, out, REQ, db, inconsistent_credit=0.5)
    assert (r, v.level, v.turn_consistent) == (0.5, "inconsistent", (True, True, True, False))
    assert v.reason == "turn 4 states what no earlier output showed"
    over = searches + ("TR001 $60. Answer: go=TR001; back=TR002; hotel=HT002",)  # 60 + 70 + 440 > 400
    r, v = hierarchical_reward(over, out, REQ, db, inconsistent_credit=0.5)
    assert (r, v.level, v.turn_consistent) == (0.0, "infeasible", ())  # the turn verifier did not run


# ------------------------------------------------------------------------------------------- config errors
def test_config_errors_name_the_fix(task):
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    RunConfig(rollouts=[MultiTurnConfig(environment="travel")], rollout=chains, task="travel_plans")
    with pytest.raises(ConfigError, match="not 'shell_files'; fix: RunConfig.task = 'travel_plans'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="travel")], rollout=chains, task="shell_files")
    with pytest.raises(ConfigError, match="has none; fix: RunConfig.task = 'travel_plans'"):
        TravelEnv(get_task("shell_files", size=2, eval_size=0))
    with pytest.raises(DataError, match=r"inconsistent_credit must be in \[0, 1\), got 1.0; fix: "
                                        r"RunConfig.task_options\['inconsistent_credit'\] = 0.0"):
        get_task("travel_plans", size=2, inconsistent_credit=1.0)
    with pytest.raises(DataError, match="fix: RunConfig.task_options\\['extraction'\\] = 'answer_line'"):
        get_task("travel_plans", size=2, extraction="last_number")
    assert make_request(11) == make_request(11)
