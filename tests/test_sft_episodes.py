"""treejax-sft on expert episodes (treejax.sft_episodes): the row is the prompt, each reference call and the world's
observation after it (raw or as a chat turn, the sampler's own formatting), the answer and EOS; the loss mask holds
exactly the actions; the refusals; and the CLI end to end on a tiny checkpoint with the held-out tool evaluation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from treejax.errors import ConfigError, DataError

OPTIONS = {"size": 16, "eval_size": 8, "seed": 0, "system_prompt": None, "extraction": "answer_line"}


@pytest.fixture(scope="module")
def world():
    """``(cfg, task, tokenizer, make_env)``: the retrieval world's expert episodes with SmolLM2's tokenizer."""
    from treejax.data import get_task
    from treejax.envs import get_env
    from treejax.models.registry import load_tokenizer
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sft import SFTConfig

    mt = MultiTurnConfig(environment="retrieval", max_turns=4, turn_tokens=64)
    cfg = SFTConfig(task="retrieval_multihop", task_options=OPTIONS, multiturn=mt, demonstration="Answer: {answer}",
                    max_demo_tokens=768)
    task = get_task(cfg.task, **OPTIONS)
    return cfg, task, load_tokenizer(cfg.model), lambda c=mt: get_env(c.environment).from_config(c, task, None)


def _batch(world, cfg=None, records=None):
    from treejax.sft_episodes import episode_batch

    c, task, tok, make_env = world
    cfg = cfg or c
    return episode_batch(tok, task, records or task.records("train")[:3], cfg, 0,
                         lambda: make_env(cfg.multiturn), tuple(tok.eos_ids))


@pytest.mark.parametrize("fmt", ["raw", "chat"])
def test_the_row_is_the_prompt_then_each_call_its_observation_and_the_answer(world, fmt):
    from treejax.data.prompts import encode_prompts
    from treejax.envs.retrieval import RetrievalEnv
    from treejax.sampling.turns import chat_observation

    cfg, task, tok, make_env = world
    cfg = dataclasses.replace(cfg, multiturn=dataclasses.replace(cfg.multiturn, observation_format=fmt))
    recs = task.records("train")[:3]
    tokens, targets, mask = _batch(world, cfg, recs)
    examples, prompts = encode_prompts(tok, task, recs, None, None)
    for i, (ex, prompt) in enumerate(zip(examples, prompts)):
        calls = ex.metadata["reference_calls"]
        env, want, actions = make_env(cfg.multiturn), list(prompt), []
        assert env.reset(ex) == ""
        for call in calls:
            action = RetrievalEnv.render_call(call)
            obs = env.step(action).observation
            assert obs.startswith("\n<output>\n") and obs.endswith("\n</output>\n")
            text = chat_observation(tok)(obs) if fmt == "chat" else obs
            assert fmt == "raw" or text.startswith("<|im_end|>\n<|im_start|>user\n")  # no stop token after a call
            want += tok.encode(action) + tok.encode(text)
            actions.append(action)
        answer = f"Answer: {ex.ground_truth}"
        assert env.step(answer).reward == 1.0
        want += tok.encode(answer) + [tok.eos_ids[0]]
        assert tokens[i, :len(want)].tolist() == want and not tokens[i, len(want):].any()
        trained = targets[i][mask[i] > 0].tolist()  # exactly the actions' tokens and the final EOS
        assert trained == sum((tok.encode(a) for a in actions), []) + tok.encode(answer) + [tok.eos_ids[0]]


def test_refusals_name_the_record_and_the_fix(world):
    from treejax.data.task_base import Example
    from treejax.envs.retrieval import RetrievalEnv
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sft import SFTConfig
    from treejax.sft_episodes import expert_actions

    cfg, task, tok, _ = world
    with pytest.raises(ConfigError, match="cannot replay expert steps.*fix: MultiTurnConfig.environment = 'retrieval'"):
        SFTConfig(multiturn=MultiTurnConfig(environment="code_tool"))
    rec = task.records("train")[0]
    n = len(task.make_example(rec).metadata["reference_calls"])  # calls; the episode needs n + 1 turns
    short = dataclasses.replace(cfg, multiturn=dataclasses.replace(cfg.multiturn, max_turns=n))
    with pytest.raises(DataError, match=rf"turn {n} .* ended the episode before the answer.*max_turns >= {n + 1}"):
        _batch(world, short, [rec])
    with pytest.raises(DataError, match=r"turn_tokens=3"):
        _batch(world, dataclasses.replace(cfg, multiturn=dataclasses.replace(cfg.multiturn, turn_tokens=3)))
    with pytest.raises(DataError, match=r"max_demo_tokens=10"):
        _batch(world, dataclasses.replace(cfg, max_demo_tokens=10))
    with pytest.raises(DataError, match=r"scores 0.0, not 1"):
        _batch(world, dataclasses.replace(cfg, demonstration="Answer: nowhere"))
    bare = Example([{"role": "user", "content": "q"}], "x", {"uid": "u1", "question": "q"})
    with pytest.raises(DataError, match=r"record 'u1' ships no reference tool calls"):
        expert_actions(RetrievalEnv, bare, "Answer: {answer}")


def test_cli_trains_on_expert_episodes_and_evaluates_with_the_tools(tiny_checkpoint, tmp_path, capsys):
    from treejax import sft

    out = tmp_path / "sft"
    params = [f"SFTConfig.model = '{tiny_checkpoint}'", f"SFTConfig.log_dir = '{out}'", "SFTConfig.num_steps = 2",
              "SFTConfig.batch_size = 2", "SFTConfig.task_options = %s" % OPTIONS,
              "SFTConfig.eval = @EvalConfig()", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 48",
              "EvalConfig.batch_size = 2", "MultiTurnConfig.turn_tokens = 24", "SFTConfig.export_hf = False"]
    summary = sft.main(["--quiet", "configs/sft_retrieval_expert.gin"] + sum((["--gin_param", p] for p in params), []))
    assert [h["step"] for h in summary["history"]] == [1, 2]
    assert all(np.isfinite(h["sft/loss"]) and h["sft/tokens"] > 20 for h in summary["history"])
    after = summary["eval_after"]
    assert after["n"] == 2 and 0.0 <= after["tool_accuracy"] <= 1.0 and after["tool_turns_mean"] >= 1
    assert "with the tools (retrieval)" in capsys.readouterr().out


WORLDS = {  # world -> (task, its RL config, turns): the shell and travel worlds' expert episodes
    "shell": ("shell_files", "configs/efficacy_shell.gin", 4),
    "travel": ("travel_plans", "configs/multiturn_travel.gin", 6),
}


@pytest.mark.parametrize("world_name", sorted(WORLDS))
def test_shell_and_travel_expert_episodes_replay_and_solve(world_name):
    """Every reference call renders to an action the world parses back to the same call; the expert episode
    played in a fresh world solves the problem (reward 1) with exactly one call per turn; episode_batch's rows hold
    the prompt, then exactly those actions (trained) and the world's observations (not trained)."""
    from treejax.data import get_task
    from treejax.envs import get_env
    from treejax.models.registry import load_tokenizer
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sft import SFTConfig
    from treejax.sft_episodes import episode_batch, expert_actions

    task_name, rl_config, turns = WORLDS[world_name]
    opts = dict(size=12, eval_size=4, seed=3, system_prompt=None, extraction="answer_line")
    mt = MultiTurnConfig(environment=world_name, max_turns=turns, turn_tokens=64)
    cfg = SFTConfig(task=task_name, task_options=opts, multiturn=mt, demonstration="Answer: {answer}",
                    max_demo_tokens=1024)
    task, tok, env_cls = get_task(task_name, **opts), load_tokenizer(cfg.model), get_env(world_name)
    records = task.records("train")
    for rec in records:
        ex = task.make_example(rec)
        calls = ex.metadata["reference_calls"]
        assert all(env_cls.parse_action(env_cls.render_call(c)) == c for c in calls)
        actions = expert_actions(env_cls, ex, cfg.demonstration)
        assert env_cls.parse_action(actions[-1]) is None  # the answer turn makes no call
        env = env_cls.from_config(mt, task, None)
        env.reset(ex)
        results = [env.step(a) for a in actions]
        assert [r.done for r in results] == [False] * len(calls) + [True]
        assert [r.info.get("tool_call") for r in results[:-1]] == calls and results[-1].reward == 1.0
    tokens, targets, mask = (np.asarray(x) for x in episode_batch(
        tok, task, records, cfg, 0, lambda: env_cls.from_config(mt, task, None), tuple(tok.eos_ids)))
    for i, rec in enumerate(records):
        actions = expert_actions(env_cls, task.make_example(rec), cfg.demonstration)
        trained = targets[i][mask[i] > 0].tolist()
        assert trained == sum((tok.encode(a) for a in actions), []) + [tok.eos_ids[0]]
        assert (tokens[i] != 0).sum() > len(trained)  # the prompt and the observations are there, untrained


def test_render_call_refuses_another_worlds_tool():
    from treejax.envs.shell import ShellEnv
    from treejax.envs.travel import TravelEnv

    with pytest.raises(ValueError, match="one tool, 'shell'; got a call to 'search'"):
        ShellEnv.render_call({"name": "search", "args": {"query": "x"}})
    with pytest.raises(ValueError, match="tools are .*got a call to 'shell'"):
        TravelEnv.render_call({"name": "shell", "args": {"command": "ls"}})


@pytest.mark.parametrize("config", ["configs/sft_shell_expert.gin", "configs/sft_travel_expert.gin"])
def test_shipped_expert_configs_parse_and_their_episodes_fit(config):
    """The shipped shell / travel SFT configs parse, and the expert episodes of their first 64 training records fit
    SFTConfig.max_demo_tokens and MultiTurnConfig.turn_tokens (episode_batch refuses any that does not)."""
    from treejax.data import get_task
    from treejax.envs import get_env
    from treejax.gin_surface import parse
    from treejax.models.registry import load_tokenizer
    from treejax.sft_episodes import episode_batch

    cfg = parse([config], [], check_mesh=False, root="SFTConfig")
    task, tok = get_task(cfg.task, **cfg.task_options), load_tokenizer(cfg.model)
    mt = cfg.multiturn
    tokens, _, mask = episode_batch(tok, task, task.records("train")[:64], cfg, 0,
                                    lambda: get_env(mt.environment).from_config(mt, task, None), tuple(tok.eos_ids))
    assert np.asarray(tokens).shape[0] == 64 and np.asarray(mask).sum(1).min() > 0
