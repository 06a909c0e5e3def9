"""What a new user hits: log folders (refuse / resume / overwrite / lock), over-long prompts measured at start,
divergence detection, and RunConfig's defaults equal to the quickstart."""

import dataclasses
import json
import os
import re
import socket

import numpy as np
import pytest

from treejax.errors import ConfigError, DataError, DivergenceError
from treejax.rl import loop
from treejax.run_dir import RunLock, prepare_log_dir

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def test_finished_run_is_refused_unless_resume_or_overwrite(tmp_path):
    d = tmp_path / "run"
    prepare_log_dir(str(d), "new")  # nothing there yet
    (d / "checkpoints").mkdir(parents=True)
    prepare_log_dir(str(d), "new")  # unfinished (preempted) run: resumes
    (d / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="finished run; pass --resume .* --overwrite"):
        prepare_log_dir(str(d), "new")
    prepare_log_dir(str(d), "resume")
    assert (d / "summary.json").exists()
    prepare_log_dir(str(d), "overwrite")
    assert os.listdir(d) == []


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match="does not look like a treejax run folder"):
        prepare_log_dir(str(tmp_path), "overwrite")
    assert (tmp_path / "thesis.tex").exists()


def test_second_run_in_one_folder_fails_at_once(tmp_path):
    with RunLock(str(tmp_path)):
        holder = re.escape(f"(pid {os.getpid()} on {socket.gethostname()})")
        with pytest.raises(ConfigError, match=f"another treejax run {holder}"):
            RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire().release()  # released: free again


def test_run_config_defaults_are_the_quickstart():
    from treejax import train

    parsed = train.parse([os.path.join(CONFIGS, "quickstart.gin")], [])
    assert parsed == loop.RunConfig(), [f.name for f in dataclasses.fields(parsed)
                                        if getattr(parsed, f.name) != getattr(loop.RunConfig(), f.name)]


class _Tok:
    """Whitespace tokenizer with a trivial chat template (enough for prompt measurement)."""

    eos_ids = (0,)

    def encode(self, text):
        return [1] * len(text.split())

    def apply_chat_template(self, messages, **kw):
        return " ".join(m["content"] for m in messages)


def _task(tmp_path, lengths):
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"question": " ".join(["w"] * n) + f" q{i}", "answer": f"#### {i}"}) + "\n")
    from treejax.data import get_task

    return get_task("gsm8k_file", path=str(path), instruction="", system_prompt=None)


def test_overlong_prompts_are_filtered_with_a_count_or_refused(tmp_path, caplog, monkeypatch):
    from treejax.data import prompts

    monkeypatch.setattr(prompts, "format_prompt", lambda tok, msgs, **kw: " ".join(m["content"] for m in msgs))
    task = _task(tmp_path, [50, 60, 55, 1000, 291, 57])
    cfg = loop.RunConfig(task="gsm8k_file", max_prompt_length=128, prompts_per_step=2)
    records, evals, width = loop.filter_prompts(_Tok(), task, task.records("train"), [], cfg)
    assert len(records) == 4 and width == 64  # the 291- and 1000-word questions are gone; the width follows
    assert "2 of 6 training" in caplog.text
    with pytest.raises(DataError, match="2 of 6 training .* longer than max_prompt_length=128"):
        loop.filter_prompts(_Tok(), task, task.records("train"), [],
                             dataclasses.replace(cfg, overlong_prompts="error"))


def test_divergence_rules():
    V = 49152
    assert loop.divergence({"update/entropy": 2.0, "update/param_norm": 100.0}, 100.5, V) is None
    assert "uniform" in loop.divergence({"update/entropy": 0.99 * np.log(V)}, None, V)
    assert "jumped" in loop.divergence({"update/param_norm": 400.0}, 100.0, V)
    assert "norm is nan" in loop.divergence({"update/param_norm": float("nan")}, 100.0, V)


def test_invalid_sampled_ids_stop_the_run():
    from treejax.testing.forests import random_forest

    forest = random_forest(np.random.default_rng(0), 2, 4, 2, 3)
    loop.check_sampled_ids(forest, 10**6, 0)
    valid = np.argwhere(np.asarray(forest.segment_index) >= 0)[0]
    bad = forest.replace(tokens=forest.tokens.at[tuple(valid)].set(10**6 + 5))
    with pytest.raises(DivergenceError, match="outside the vocabulary"):
        loop.check_sampled_ids(bad, 10**6, 0)
    nan = forest.replace(logprobs=forest.logprobs.at[tuple(valid)].set(np.nan))
    with pytest.raises(DivergenceError, match="1 non-finite log-probs"):
        loop.check_sampled_ids(nan, 10**6, 0)
