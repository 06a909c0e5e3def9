"""Task chains (treejax.envs.task_chain, treejax.envs.task_chain_task): chains deterministic from the seed, of one
family, train and eval disjoint; the reset/step/clone contract (a clone's future equals a fresh replay) on a
reasoning-gym task, with the skill library, and with an inner environment (the shell world: a scripted oracle with
the reference actions solves every problem of every chain); the one-line errors for bad options and configs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from treejax.data import get_task
from treejax.envs import env_names, get_env
from treejax.envs.task_chain import HEADER, TaskChainEnv, feedback_text, parse_skill
from treejax.envs.task_chain_task import TaskChain, cut_chains
from treejax.errors import ConfigError, DataError
from treejax.testing.envs import run_shipped_multiturn


@pytest.fixture(scope="module")
def sums():
    return get_task("task_chain", inner="chain_sum_2x1", chain_length=3, size=6, eval_size=2, seed=1)


@pytest.fixture(scope="module")
def shells():
    return get_task("task_chain", inner="shell_files", chain_length=2, size=8, eval_size=4, seed=2,
                    inner_environment="shell", inner_options={"seed": 5})


def _result(r):
    return (r.observation, r.reward, r.done, {k: v for k, v in r.info.items() if k != "tool_seconds"})


def _answer(ex):
    return f"Adding up.\n<answer>{ex.ground_truth}</answer>"


def test_chains_are_deterministic_of_one_family_and_disjoint(sums, shells):
    again = get_task("task_chain", inner="chain_sum_2x1", chain_length=3, size=6, eval_size=2, seed=1)
    assert sums.records("train") == again.records("train") and len(sums.records("train")) == 6
    other = get_task("task_chain", inner="chain_sum_2x1", chain_length=3, size=6, eval_size=2, seed=2)
    assert other.records("train") != sums.records("train")
    assert sums.inner.size == 18 and sums.inner.eval_size == 6  # chain_length x the chains' sizes by default
    ex = next(sums.examples("train"))
    links = sums.link_examples(ex)
    assert len(links) == 3 and ex.ground_truth == links[0].ground_truth
    assert ex.prompt_messages[-1]["content"] == HEADER.format(length=3) + links[0].metadata["question"]
    assert ex.prompt_messages[0] == links[0].prompt_messages[0]  # the inner task's system prompt
    uids = lambda t, s: {l["uid"] for r in t.records(s) for l in json.loads(r["metadata"])["links"]}  # noqa: E731
    for t in (sums, shells):
        assert not uids(t, "train") & uids(t, "eval")
        assert len(uids(t, "train")) == t.size * t.chain_length  # no problem twice
    fams = [next(iter({l.metadata["template"] for l in shells.link_examples(e)})) for e in shells.examples("train")]
    assert all(len({l.metadata["template"] for l in shells.link_examples(e)}) == 1 for e in shells.examples("train"))
    assert len(set(fams[:4])) == 4  # the families' chains interleaved in turn (4 templates)
    # the cut by hand: families a (0, 2, 4) and b (1, 3); a permutation per family, remainders dropped, interleaved
    rng = np.random.default_rng(0)
    pa, pb = rng.permutation(3), rng.permutation(2)
    chains = cut_chains(["a", "b", "a", "b", "a"], 2, np.random.default_rng(0))
    assert chains == [[[0, 2, 4][pa[0]], [0, 2, 4][pa[1]]], [[1, 3][pb[0]], [1, 3][pb[1]]]]


def test_reset_step_and_clone_contract(sums):
    ex = next(sums.examples("train"))
    links = sums.link_examples(ex)
    env = get_env("task_chain").from_config(_Turns(3), sums, None)
    assert isinstance(env, TaskChainEnv) and env.make_inner is None and env.stop_strings == ()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")
    assert env.reset(ex) == ""
    first = env.step(_answer(links[0]))
    assert first.observation == ("\n<feedback>Correct.</feedback>\n\nProblem 2 of 3: "
                                 f"{links[1].metadata['question']}\n")
    assert (first.reward, first.done) == (pytest.approx(1 / 3), False)
    assert first.info == {"chain_link": 0, "chain_length": 3, "chain_outcome": 1.0, "skill": True,
                          "episode_score": pytest.approx(1 / 3)}
    fork = env.clone()
    fresh = TaskChainEnv(sums)
    fresh.reset(ex)
    fresh.step(_answer(links[0]))
    actions = ["<answer>999</answer>", _answer(links[2])]
    rest = [[_result(e.step(a)) for a in actions] for e in (env, fork, fresh)]
    assert rest[0] == rest[1] == rest[2]
    wrong, last = rest[0]
    assert wrong[0].startswith(f"\n<feedback>Wrong; the answer was {links[1].ground_truth}.</feedback>\n\nProblem 3")
    assert wrong[1] == 0.0 and wrong[3]["chain_outcome"] == 0.0
    assert last[:3] == ("", pytest.approx(1 / 3), True)
    assert last[3]["answered"] and last[3]["episode_score"] == pytest.approx(2 / 3)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("x")
    assert feedback_text("verdict", 0.0, "7") == "\n<feedback>Wrong.</feedback>" and feedback_text("none", 1, "") == ""


def test_the_skill_library_is_carried_and_cloned(sums):
    task = TaskChain(inner=sums.inner, chain_length=3, size=2, eval_size=0, skills=True, feedback="none",
                     max_skill_chars=12)
    ex = next(task.examples("train"))
    links = task.link_examples(ex)
    env = TaskChainEnv(task)
    env.reset(ex)
    r = env.step("<skill>count  the digits first</skill>" + _answer(links[0]))
    assert r.info["skill"] and env.skills == ("count  the d",)  # cut at max_skill_chars
    assert r.observation == f"\nSkills so far:\n- count  the d\n\nProblem 2 of 3: {links[1].metadata['question']}\n"
    fork = env.clone()
    r2 = env.step("<skill> </skill><answer>0</answer>")  # an empty skill is none
    assert not r2.info["skill"] and env.skills == ("count  the d",)
    env2 = env.clone()
    env.step("<skill>b</skill>")
    assert env.skills == ("count  the d", "b") and env2.skills == fork.skills == ("count  the d",)
    assert parse_skill("<skill>a</skill> <skill> b </skill>", 5) == "b" and parse_skill("none", 5) is None


class _Turns:
    """The part of MultiTurnConfig the environments' from_config reads."""

    def __init__(self, max_turns):
        self.max_turns = max_turns


def _oracle_actions(env, actions):
    """Run the reference ``actions`` of the current problem; the answer is the first word of the last output."""
    body = None
    for a in actions:
        r = env.step(f"<shell>{a}</shell>")
        assert not r.done and r.info["chain_link"] == env.link and "tool_call" in r.info
        body = re.search(r"<output>\n(.*)\n</output>", r.observation, flags=re.S).group(1)
    return env.step(f"Answer: {body.split()[0]}")


def test_chains_of_an_inner_environment(shells):
    env = TaskChainEnv.from_config(_Turns(6), shells, None)
    assert env.stop_strings == ("</shell>",) and env.make_inner is not None
    for ex in list(shells.examples("train")) + list(shells.examples("eval")):
        links = shells.link_examples(ex)
        env.reset(ex)
        r = _oracle_actions(env, links[0].metadata["reference_actions"])
        assert not r.done and r.info["chain_outcome"] == 1.0 and "answered" not in r.info
        assert r.observation.endswith(f"Problem 2 of 2: {links[1].metadata['question']}\n")
        last = _oracle_actions(env, links[1].metadata["reference_actions"])
        assert last.done and last.info["answered"] and last.info["episode_score"] == 1.0
    # a clone in the middle of a problem's tool calls: its future equals the original's and a fresh replay's
    ex = next(shells.examples("train"))
    links = shells.link_examples(ex)
    env.reset(ex)
    first = f"<shell>{links[0].metadata['reference_actions'][0]}</shell>"
    env.step(first)
    fork = env.clone()
    fresh = TaskChainEnv.from_config(_Turns(6), shells, None)
    fresh.reset(ex)
    fresh.step(first)
    actions = ["<shell>cd /var</shell>", "Answer: 3", "<shell>pwd</shell>", "Answer: /"]
    rest = [[_result(e.step(a)) for a in actions] for e in (env, fork, fresh)]
    assert rest[0] == rest[1] == rest[2]
    assert rest[0][2][0] == "\n<output>\n/\n</output>\n"  # problem 2's shell starts fresh at /, not /var


def test_option_and_config_errors_name_the_fix(sums):
    with pytest.raises(DataError, match=r"chain_length must be >= 2.*fix: RunConfig.task_options\['chain_length'\]"):
        TaskChain(inner=sums.inner, chain_length=1)
    with pytest.raises(DataError, match="feedback must be one of .*fix"):
        TaskChain(inner=sums.inner, feedback="loud")
    with pytest.raises(DataError, match="the inner task is itself a chain; fix"):
        get_task("task_chain", inner="task_chain")
    with pytest.raises(DataError, match="inner_environment must be one of"):
        TaskChain(inner=sums.inner, inner_environment="chess")
    with pytest.raises(DataError, match="next_format"):
        TaskChain(inner=sums.inner, next_format="{problem}")
    with pytest.raises(DataError, match=r"family 'level' is not a metadata key.*fix: RunConfig.task_options\['family'"):
        TaskChain(inner=sums.inner, family="level", size=1, eval_size=0).records("train")
    with pytest.raises(DataError, match=r"make 6 chains of 3, and 7 are asked; fix: a larger inner size"):
        TaskChain(inner=sums.inner, chain_length=3, size=7).records("train")
    with pytest.raises(ConfigError, match="fix: RunConfig.task = 'task_chain'"):
        TaskChainEnv(sums.inner)
    with pytest.raises(ConfigError, match="needs at least 3 turns.*fix: MultiTurnConfig.max_turns = 3"):
        TaskChainEnv.from_config(_Turns(2), sums, None)


def test_registered_and_checked_by_the_run_config():
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    assert "task_chain" in env_names() and get_env("task_chain") is TaskChainEnv
    chains = tree.independent_config(4, 64, 16)
    world = dict(rollout=chains, task="task_chain", estimator="sage")
    RunConfig(rollouts=[MultiTurnConfig(environment="task_chain")], **world)
    with pytest.raises(ConfigError, match="not 'chain_sum_2x1'; fix: RunConfig.task = 'task_chain'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="task_chain")], rollout=chains, estimator="grpo")
    with pytest.raises(ConfigError, match="environment 'code_tool' does not run; fix: MultiTurnConfig.environment = "
                                          "'task_chain'"):
        RunConfig(rollouts=[MultiTurnConfig()], **world)
    with pytest.raises(ConfigError, match="does not supply; fix: .*MultiTurnConfig"):
        RunConfig(**world)


@pytest.mark.slow  # one RL step of the whole loop on a tiny random model (196 s on the shared 2-core machine); the
# default run covers its parts: tests/rl/test_sage.py::test_the_learner_trains_on_sage_advantages and this file
def test_the_shipped_sage_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_chain_sage.gin end to end (chains of reasoning-gym problems, the chain environment with
    chat-formatted observations, SAGE's inputs, the update, the evaluation with the environment) for one step on a
    tiny random model with SmolLM2's tokenizer."""
    last = run_shipped_multiturn("multiturn_chain_sage.gin", tiny_checkpoint, tmp_path / "run")
    assert 0.0 <= last["multiturn/chain_solved_mean"] <= 1.0
