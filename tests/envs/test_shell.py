"""The shell world (treejax.envs.shell_lang, treejax.envs.shell, treejax.envs.shell_task): the parser on hand-written
commands (valid ones into their AST, invalid ones into one-line errors), the interpreter's commands on a
hand-written file system, the sandbox (no disk, no process), the reset/step/clone contract, and the questions
needing their actions (a scripted oracle with the reference actions answers every one, with one action fewer or
none it does not)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess

import numpy as np
import pytest

from treejax.data import get_task
from treejax.envs import env_names, get_env
from treejax.envs.shell import (SYNTAX_ERROR, TEMPLATES, ShellEnv, final_answer, generate_fs, parse_command,
                                question_fs)
from treejax.envs.shell_lang import (Command, FileSystem, Pipeline, Script, ShellSyntaxError, Word, execute, parse,
                                     signature)
from treejax.envs.shell_task import ShellTask
from treejax.errors import ConfigError, DataError
from treejax.testing.envs import run_shipped_multiturn


@pytest.fixture(scope="module")
def task():
    return get_task("shell_files", size=48, eval_size=16, seed=5)


def _result(r):
    return (r.observation, r.reward, r.done, {k: v for k, v in r.info.items() if k != "tool_seconds"})


# ------------------------------------------------------------------------------------------------- the parser
def test_parser_builds_the_ast():
    assert parse("ls") == Script((Pipeline((Command("ls"),)),))
    assert parse("  find /srv -name '*.log' | wc -l ") == Script((Pipeline((
        Command("find", (Word("/srv"), Word("-name"), Word("*.log", quoted=True))),
        Command("wc", (Word("-l"),)))),))
    s = parse('cd /data && grep -c "two words" a\\ b.txt|wc -l')
    assert [[c.name for c in p.commands] for p in s.pipelines] == [["cd"], ["grep", "wc"]]
    assert s.pipelines[1].commands[0].argv == ("-c", "two words", "a b.txt")
    assert parse("grep a'b c'\"d\" x").pipelines[0].commands[0].argv == ("ab cd", "x")  # adjacent parts join
    assert parse('grep "say \\"hi\\"" f').pipelines[0].commands[0].argv == ('say "hi"', "f")
    assert parse("grep '$HOME; rm' f").pipelines[0].commands[0].argv == ("$HOME; rm", "f")  # quoted: literal
    assert [signature(parse(c)) for c in ("ls /", "find . | wc -l", "cd x && ls && cat a | grep b")] == [
        "ls", "find|wc", "cd && ls && cat|grep"]


@pytest.mark.parametrize("text, message", [
    ("", "empty command"),
    ("   ", "empty command"),
    ("ls |", "a command is missing at the end"),
    ("| wc -l", "'|' at the start has no command before it"),
    ("ls && && pwd", "'&&' after '&&' has no command before it"),
    ("ls | | wc", "'|' after '|' has no command before it"),
    ("ls; pwd", "';' (sequencing: use &&) at column 3 is not supported"),
    ("ls || pwd", "'||' at column 4 is not supported (only | and &&)"),
    ("cat a > b", "'>' (redirection) at column 7 is not supported"),
    ("ls &", "'&' (background jobs) at column 4 is not supported"),
    ("echo $HOME", "'$' (expansion) at column 6 is not supported"),
    ("cat `ls`", "'`' (substitution) at column 5 is not supported"),
    ("grep 'abc f", "unterminated single quote at column 6"),
    ('grep "abc f', "unterminated double quote at column 6"),
    ("ls \\", "a trailing backslash escapes nothing"),
    ("rm -rf /", "unknown command 'rm' (known: ls, cd, pwd, cat, grep, find, wc)"),
])
def test_parser_refuses_bad_syntax_in_one_line(text, message):
    with pytest.raises(ShellSyntaxError) as e:
        parse(text)
    assert str(e.value) == message and "\n" not in str(e.value)


# -------------------------------------------------------------------------------------------- the interpreter
FS = FileSystem({"/srv/app/a.log": "INFO up\nERROR disk\nWARN slow\nERROR net\n", "/srv/app/b.txt": "hello\nHello\n",
                 "/srv/notes.md": "one two three\n", "/home/x.csv": "1,2\n"}, dirs=["/tmp"])


def _run(text, cwd="/"):
    r, cwd = execute(parse(text), FS, cwd)
    return r.out, r.err, r.status, cwd


def test_commands_on_a_hand_written_file_system():
    assert _run("ls") == ("home/\nsrv/\ntmp/\n", "", 0, "/")
    assert _run("ls app notes.md /tmp", cwd="/srv")[0] == "notes.md\n\napp:\na.log\nb.txt\n\n/tmp:\n"
    assert _run("ls /srv/notes.md")[0] == "/srv/notes.md\n"
    assert _run("cd /srv/app && pwd") == ("/srv/app\n", "", 0, "/srv/app")
    assert _run("cd .. && pwd", cwd="/srv/app")[0] == "/srv\n"
    assert _run("cd /srv | pwd") == ("/\n", "", 0, "/")  # a cd inside a pipeline runs in a subshell
    assert _run("cat /srv/app/b.txt | grep -i hello | wc -l")[0] == "2\n"
    assert _run("grep -c ERROR /srv/app/a.log")[0] == "2\n"
    assert _run("grep -n ERROR app/a.log", cwd="/srv")[0] == "2:ERROR disk\n4:ERROR net\n"
    assert _run("grep -v ERROR /srv/app/a.log")[0] == "INFO up\nWARN slow\n"
    assert _run("grep -rl ERROR /")[0] == "/srv/app/a.log\n"
    assert _run("grep -r two .", cwd="/srv")[0] == "./notes.md:one two three\n"
    assert _run("grep -c l /srv/app/a.log /srv/app/b.txt")[0] == "/srv/app/a.log:1\n/srv/app/b.txt:2\n"
    assert _run("grep E.ROR /srv/app/a.log")[2] == 1  # a fixed string, not a regular expression
    assert _run("find /srv -type f -name '*.log'")[0] == "/srv/app/a.log\n"
    assert _run("find . -maxdepth 1", cwd="/srv")[0] == ".\n./app\n./notes.md\n"
    assert _run("find / -type d")[0] == "/\n/home\n/srv\n/srv/app\n/tmp\n"
    assert _run("wc -l /srv/app/a.log")[0] == "4 /srv/app/a.log\n"
    assert _run("wc /srv/notes.md /home/x.csv")[0] == "1 3 14 /srv/notes.md\n1 1 4 /home/x.csv\n2 4 18 total\n"
    assert _run("find / -name '*.md' | wc -l")[0] == "1\n"


def test_errors_and_and_lists():
    assert _run("cat /nope") == ("", "cat: /nope: No such file or directory", 1, "/")
    assert _run("cat /srv")[1] == "cat: /srv: Is a directory"
    assert _run("cd /srv/notes.md")[1:3] == ("cd: /srv/notes.md: Not a directory", 1)
    assert _run("grep -z x /srv")[1:3] == ("grep: invalid option -- 'z'", 2)
    assert _run("grep x /srv")[1:3] == ("grep: /srv: Is a directory", 2)
    assert _run("find / -size 3")[1] == "find: unknown predicate '-size' (known: -name, -type, -maxdepth)"
    assert _run("find / -type x")[1] == "find: -type takes f or d, got 'x'"
    assert _run("grep zzz /srv/notes.md && ls") == ("", "", 1, "/")  # && stops after a failure
    assert _run("cd /srv && cd app && pwd") == ("/srv/app\n", "", 0, "/srv/app")
    assert _run("ls /nope | wc -l")[:3] == ("0\n", "ls: cannot access '/nope': No such file or directory", 0)


def test_the_interpreter_touches_no_disk_and_starts_no_process(task, monkeypatch):
    """Every way to the real system raises while commands run; they still work (the sandbox is the in-memory
    file system), and the real root's files are not there."""
    ex = next(task.examples("train"))
    env = ShellEnv(task, max_calls=10)
    env.reset(ex)

    def refuse(*a, **k):
        raise AssertionError("the shell world touched the real system")

    for mod, name in ((os, "listdir"), (os, "scandir"), (os, "stat"), (os, "open"), (os, "system"), (os, "walk"),
                      (subprocess, "Popen"), (subprocess, "run")):
        monkeypatch.setattr(mod, name, refuse)
    monkeypatch.setattr("builtins.open", refuse)
    for cmd in ex.metadata["reference_actions"] + ["ls /", "find / -name '*.txt' | wc -l"]:
        assert not env.step(f"<shell>{cmd}</shell>").info["tool_error"], cmd
    assert "cat: /etc/passwd: No such file or directory" in env.step("<shell>cat /etc/passwd</shell>").observation
    assert "grep: /etc: No such file or directory" in env.step("<shell>grep -r root /etc</shell>").observation


# ------------------------------------------------------------------------------------------------- the world
def test_file_systems_are_deterministic_and_codes_are_planted_once(task):
    assert generate_fs(7) == generate_fs(7) and generate_fs(7) != generate_fs(8)
    assert len(generate_fs(7, num_files=30).files) == 30
    for ex in task.examples("train"):
        fs = question_fs(ex.metadata)
        if "plant" in ex.metadata:
            code = ex.metadata["plant"]["code"]
            assert [p for p, t in fs.files.items() if code in t] == [ex.metadata["plant"]["path"]]
            assert code in ex.metadata["question"] and ex.metadata["plant"]["path"] not in ex.metadata["question"]
        assert ex.metadata["reference_calls"] == [{"name": "shell", "args": {"command": c}}
                                                  for c in ex.metadata["reference_actions"]]
    train, held = task.records("train"), task.records("eval")
    seeds = lambda recs: {json.loads(r["metadata"])["fs_seed"] for r in recs}  # noqa: E731
    assert not seeds(train) & seeds(held) and len(train) == 48 and len(held) == 16
    assert train == get_task("shell_files", size=48, eval_size=16, seed=5).records("train")
    assert collections.Counter(json.loads(r["metadata"])["template"] for r in train) == {t: 12 for t in TEMPLATES}


def test_task_option_errors_and_the_verifier(task):
    with pytest.raises(DataError, match="extraction must be 'answer_line'.*fix"):
        get_task("shell_files", extraction="last_number")
    with pytest.raises(DataError, match="templates must be"):
        ShellTask(templates=("largest_file",))
    with pytest.raises(DataError, match="num_files must be >= 4"):
        ShellTask(num_files=2)
    ex = next(e for e in task.examples("train") if e.metadata["template"] == "match_path")
    assert task.score(f"Found it.\nAnswer: `{ex.ground_truth}`.", ex) == 1.0
    assert task.score(f"Answer: {ex.ground_truth.upper()}", ex) == 0.0  # a path is case-sensitive
    assert final_answer("x\nanswer: '17'") == "17" and final_answer("just 17.") == "just 17"


# ------------------------------------------------------------------------------------------ the environment
def test_reset_step_and_clone_contract(task):
    ex = next(task.examples("train"))
    actions = ["First look around.\n<shell>cd /srv && ls</shell>", "<shell>find . -type f | wc -l</shell>",
               f"<shell>{ex.metadata['reference_actions'][0]}</shell>", "Answer: 3"]
    env = ShellEnv(task, max_calls=3)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("Answer: x")
    assert env.reset(ex) == ""
    first = env.step(actions[0])
    assert not first.done and first.reward == 0.0 and env.cwd == "/srv"
    assert first.observation.startswith("\n<output>\n") and first.observation.endswith("\n</output>\n")
    assert first.info["tool_call"] == {"name": "shell", "args": {"command": "cd /srv && ls"}}
    assert first.info["action_signature"] == "cd && ls" and not first.info["tool_error"]
    fork = env.clone()
    fresh = ShellEnv(task, max_calls=3)
    fresh.reset(ex)
    fresh.step(actions[0])
    rest = [[_result(e.step(a)) for a in actions[1:]] for e in (env, fork, fresh)]
    assert rest[0] == rest[1] == rest[2]
    assert rest[0][0][3]["action_signature"] == "find|wc" and rest[0][-1][2] and rest[0][-1][3]["answered"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("Answer: x")


def test_a_clone_is_independent_and_the_call_limit_ends_the_episode(task):
    ex = next(task.examples("train"))
    env = ShellEnv(task, max_calls=1)
    env.reset(ex)
    fork = env.clone()
    env.step("<shell>cd /home</shell>")
    assert env.cwd == "/home" and fork.cwd == "/" and fork.calls == 0
    last = env.step("<shell>ls</shell>")
    assert last.done and last.info["call_limit"] and "no commands left" in last.observation
    assert fork.step(f"Answer: {ex.ground_truth}").reward == 1.0


def test_errors_come_back_as_observations(task):
    env = ShellEnv(task, max_calls=5, max_output_chars=60)
    env.reset(next(task.examples("train")))
    bad = env.step("<shell>ls | </shell>")
    assert bad.info["tool_error"] and bad.info["action_signature"] == SYNTAX_ERROR
    assert "[error] syntax: a command is missing at the end" in bad.observation and not bad.done
    miss = env.step("<shell>cat /nowhere</shell>")
    assert "cat: /nowhere: No such file or directory\n[exit status 1]" in miss.observation and miss.info["tool_error"]
    cut = env.step("<shell>find /</shell>")
    assert "[output cut at 60 characters]" in cut.observation and not cut.info["tool_error"]
    assert parse_command("think <shell>a</shell> then <shell> ls -F </shell>\n") == "ls -F"
    assert parse_command("Answer: 3") is None and parse_command("<shell>ls") is None


def test_registered_and_built_from_the_multiturn_config(task):
    from treejax.rl.multiturn import MultiTurnConfig

    assert "shell" in env_names() and get_env("shell") is ShellEnv and ShellEnv.ast_actions
    env = ShellEnv.from_config(MultiTurnConfig(environment="shell", max_turns=4), task, None)
    assert env.max_calls == 3 and env.task is task and env.max_output_chars == task.max_output_chars == 800
    with pytest.raises(ConfigError, match="fix: RunConfig.task = 'shell_files'"):
        ShellEnv.from_config(MultiTurnConfig(environment="shell"), object(), None)


# ------------------------------------------------------------------------------------ the questions need actions
def _oracle(env: ShellEnv, example, actions: list[str], guess: str = "unknown") -> float:
    """Run ``actions``; answer with the first word of the last output (a count, or a path), else ``guess``. It
    reads only the observations, never the truth."""
    env.reset(example)
    body = None
    for a in actions:
        obs = env.step(f"<shell>{a}</shell>").observation
        body = re.search(r"<output>\n(.*)\n</output>", obs, flags=re.S).group(1)
    answer = body.split()[0] if body and body.split() else guess
    return env.step(f"Answer: {answer}").reward


def test_the_questions_need_their_actions(task):
    examples = list(task.examples("train")) + list(task.examples("eval"))
    env = ShellEnv(task, max_calls=3)
    assert all(_oracle(env, ex, ex.metadata["reference_actions"]) == 1.0 for ex in examples)
    # match_lines needs both of its actions: the grep alone gives the path, not its number of lines
    two = [ex for ex in examples if len(ex.metadata["reference_actions"]) == 2]
    assert two and all(_oracle(env, ex, ex.metadata["reference_actions"][:1]) == 0.0 for ex in two)
    # no action: the best fixed answer per template (chosen knowing these questions' answers)
    by = collections.defaultdict(list)
    for ex in examples:
        by[ex.metadata["template"]].append(ex.ground_truth)
    guesses = {t: max(sorted(set(a)), key=a.count) for t, a in by.items()}
    blind = float(np.mean([_oracle(env, ex, [], guesses[ex.metadata["template"]]) for ex in examples]))
    best = sum(max(a.count(g) for g in set(a)) for a in by.values()) / len(examples)
    assert blind == pytest.approx(best) and blind < 0.35


@pytest.mark.slow  # one RL step of the whole loop on a tiny random model: ~150 s on the shared 2-core machine
def test_the_shipped_a3_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_shell_a3.gin end to end (task, file systems, environment, trees of turns, signatures,
    A³, update, evaluation with the environment) for one step on a tiny random model with SmolLM2's tokenizer."""
    last = run_shipped_multiturn("multiturn_shell_a3.gin", tiny_checkpoint, tmp_path / "run",
                                 ("MultiTurnConfig.roots = 2",))
    assert "multiturn/action_signatures_mean" in last
