"""Nothing lost (issue 24): --overwrite deletes only the run's files, --resume into a folder with no run is an
error, Ctrl-C saves and stops (and resumes exactly), a failed save is one line without a temporary folder, an
unusable log_dir is refused at start, treejax-eval checks its checkpoint before loading a model."""

import errno
import logging
import os
import signal

import jax
import jax.numpy as jnp
import pytest

from treejax import train
from treejax.checkpoint import Checkpointer, CheckpointSaveError, PreemptionHandler
from treejax.errors import ConfigError, UserFileError
from treejax.run_dir import check_log_dir, prepare_log_dir

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.fixture
def no_run(monkeypatch):
    """No model may load: ``build_run`` (which loads it) fails the test if reached."""
    from treejax.rl import loop

    def setup(*args, **kwargs):
        raise AssertionError("the run's set-up (model load) was reached")

    monkeypatch.setattr(loop, "build_run", setup)


def _cli_error(capsys, argv, code=2) -> str:
    with pytest.raises(SystemExit) as exit_:
        train.console_main(["--quiet", *argv])
    assert exit_.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treejax-train: "), err
    return err.split(": ", 2)[2][:-1] if err.startswith("treejax-train: error: ") else err[:-1]


def _tree(folder):
    return sorted(os.path.relpath(os.path.join(p, f), folder) for p, ds, fs in os.walk(folder) for f in fs + ds)


def _fake_run(d):
    """A finished run's top-level entries (as the loop writes them), plus the user's own files."""
    (d / "checkpoints" / "3" / "state").mkdir(parents=True)
    (d / "hf_export").mkdir()
    (d / "hf_export" / "config.json").write_text("{}")
    for name in ("summary.json", "operative_config.gin", "tree_step1.png", "tree_step3.png", "failure.json",
                 "events.out.tfevents.1700000000.host.123.0"):
        (d / name).write_text("x")
    (d / "thesis.tex").write_text("my thesis")
    (d / "notes").mkdir()
    (d / "notes" / "ideas.md").write_text("keep me")


def test_overwrite_deletes_only_what_treejax_wrote(tmp_path, caplog, monkeypatch):
    d = tmp_path / "run"
    d.mkdir()
    _fake_run(d)
    monkeypatch.setattr(logging.getLogger("treejax"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="treejax"):
        prepare_log_dir(str(d), "overwrite")
    assert _tree(d) == ["notes", "notes/ideas.md", "thesis.tex"]
    assert (d / "thesis.tex").read_text() == "my thesis"
    assert f"kept 2 it did not write: notes, thesis.tex" in caplog.text


def test_overwrite_of_a_folder_with_only_foreign_files_is_refused_in_one_line(no_run, capsys, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("my thesis")
    msg = _cli_error(capsys, ["--overwrite", "--gin_param", f"RunConfig.log_dir='{d}'"])
    assert msg.startswith(f"refusing to overwrite {d}: it does not look like a treejax run folder") and \
        "thesis.tex" in msg
    assert (d / "thesis.tex").read_text() == "my thesis"
    assert os.listdir(d) == ["thesis.tex"]  # nothing written, not even the lock


def test_resume_into_a_folder_with_no_run_names_the_runs_next_to_it(no_run, capsys, tmp_path):
    for name in ("quickstart", "other"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
    (tmp_path / "not_a_run").mkdir()
    typo = tmp_path / "quikstart"
    msg = _cli_error(capsys, ["--resume", "--gin_param", f"RunConfig.log_dir='{typo}'"])
    assert msg == (f"--resume: {typo} holds no run to resume (no checkpoints/ or summary.json); runs next to it: "
                   f"{tmp_path / 'quickstart'}, {tmp_path / 'other'}; fix the RunConfig.log_dir, or drop --resume "
                   "to start a new run there")
    assert not typo.exists() and sorted(os.listdir(tmp_path)) == ["not_a_run", "other", "quickstart"]


@pytest.mark.parametrize("kind", ["file", "under_a_file", "read_only"])
def test_unusable_log_dir_is_refused_at_start_in_one_line(no_run, capsys, tmp_path, monkeypatch, kind):
    (tmp_path / "afile").write_text("data")
    log_dir = {"file": tmp_path / "afile", "under_a_file": tmp_path / "afile" / "run",
               "read_only": tmp_path / "ro" / "run"}[kind]
    if kind == "read_only":
        (tmp_path / "ro").mkdir()
        real_access = os.access
        # root ignores permission bits: simulate a read-only folder where os.access asks
        monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path / "ro") else real_access(p, m))
    msg = _cli_error(capsys, ["--gin_param", f"RunConfig.log_dir='{log_dir}'"])
    expected = {"file": "is a file, not a folder", "under_a_file": f"cannot be created: {tmp_path / 'afile'} is a file",
                "read_only": f"{tmp_path / 'ro'} is not writable"}[kind]
    assert msg.startswith(f"RunConfig.log_dir='{log_dir}'") and expected in msg, msg
    assert (tmp_path / "afile").read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == (["afile", "ro"] if kind == "read_only" else ["afile"])
    if kind == "read_only":
        assert os.listdir(tmp_path / "ro") == []


def test_read_only_file_system_is_refused_by_a_write_probe(tmp_path, monkeypatch):
    """os.access says yes on a read-only mount for root: the check writes (and removes) a probe file."""
    import builtins

    real_open = builtins.open

    def open_(path, *a, **k):
        if ".treejax_write_test" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)
    with pytest.raises(ConfigError, match=r"^RunConfig.log_dir='.*' is not writable \(Read-only file system\)"):
        check_log_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_second_ctrl_c_aborts_at_once():
    handler = PreemptionHandler().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert handler.requested and handler.signal_received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        handler.uninstall()


def test_interrupt_before_the_step_loop_is_one_line(capsys, monkeypatch):
    from treejax.rl import loop

    def run(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "run", run)
    msg = _cli_error(capsys, [], code=130)
    assert msg.startswith("treejax-train: interrupted: stopped at once")


def _fail_json_writes(monkeypatch, err=errno.ENOSPC, text="No space left on device"):
    """Every orbax JSON item write fails as on a full disk (or a read-only file system), inside orbax's own save
    thread, after it made the step's temporary folder."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler

    async def fail(self, x, directory):
        raise OSError(err, text, str(directory))

    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", fail)


@pytest.mark.parametrize("err, text", [(errno.ENOSPC, "No space left on device"),
                                       (errno.EROFS, "Read-only file system")])
def test_failed_save_is_one_line_with_the_path_and_no_tmp_folder(tmp_path, monkeypatch, capfd, err, text):
    state = {"w": jnp.ones((64, 64), jnp.float32)}
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(1, state, {"step": 1}, force=True)
    ckpt.wait()
    capfd.readouterr()
    _fail_json_writes(monkeypatch, err, text)
    with pytest.raises(CheckpointSaveError) as info:
        ckpt.save(2, state, {"step": 2}, force=True)
        ckpt.wait()
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"could not save the checkpoint of step 2 to {tmp_path / 'checkpoints'}: {text} (the state "
                          f"needs about 16,384 bytes")
    assert "removed the partial 2.orbax-checkpoint-tmp" in msg
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]  # step 1 kept, no temporary folder
    ckpt.close()
    err_out = capfd.readouterr().err
    assert "Traceback" not in err_out and "ERROR:absl" not in err_out, err_out


def test_eval_checks_the_checkpoint_before_loading_a_model(tmp_path, monkeypatch):
    from treejax import evaluate as cli
    from treejax.models import registry

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(registry, "load_model", load_model)
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserFileError, match=r"^--checkpoint: no checkpoints in .*empty_run/checkpoints \(expected"):
        cli.main(["--checkpoint", str(empty), "--quiet"])
    run = tmp_path / "run"
    for step in (2, 4):
        (run / "checkpoints" / str(step) / "state").mkdir(parents=True)
    with pytest.raises(UserFileError, match=r"^--step 3: no checkpoint of that step in .*; saved steps: 2, 4$"):
        cli.main(["--checkpoint", str(run), "--step", "3", "--quiet"])
    assert _tree(run) == ["checkpoints", "checkpoints/2", "checkpoints/2/state", "checkpoints/4",
                          "checkpoints/4/state"]


def _tiny_params(tiny_checkpoint, log_dir, steps=2):
    return [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'",
            f"RunConfig.num_steps = {steps}", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
            "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
            "EvalConfig.max_new_tokens = 4", "OptimizerConfig.learning_rate = 1e-3",
            "LossConfig.entropy_coef = 0.01"]


def _main(params, *flags):
    return train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet", *flags]
                      + sum((["--gin_param", p] for p in params), []))


def _export_bytes(summary):
    with open(os.path.join(summary["hf_export"], "model.safetensors"), "rb") as f:
        return f.read()


@pytest.mark.slow  # four tiny runs: ~4 min on 2 CPU cores (the same path as the SIGTERM test in test_train_cli.py)
def test_ctrl_c_saves_and_resume_equals_uninterrupted(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """SIGINT (Ctrl-C) during step 1 -> the loop finishes the step, saves and returns; ``--resume`` then gives the
    same final parameters as an uninterrupted run, bit for bit (CPU). The user's file in the folder survives."""
    from treejax import viz

    straight = _main(_tiny_params(tiny_checkpoint, tmp_path / "straight"))
    original = viz.draw_tree
    calls = []

    def draw_and_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 1
        return original(*args, **kwargs)

    monkeypatch.setattr(viz, "draw_tree", draw_and_interrupt)
    (tmp_path / "resumed").mkdir()
    (tmp_path / "resumed" / "thesis.tex").write_text("my thesis")
    interrupted = _main(_tiny_params(tiny_checkpoint, tmp_path / "resumed"))
    assert interrupted["preempted_at"] == 1 and interrupted["stopped_by"] == "SIGINT"
    assert os.listdir(tmp_path / "resumed" / "checkpoints") == ["1"]
    monkeypatch.setattr(viz, "draw_tree", original)
    resumed = _main(_tiny_params(tiny_checkpoint, tmp_path / "resumed"), "--resume")
    assert [row["step"] for row in resumed["history"]] == [1, 2]
    assert _export_bytes(resumed) == _export_bytes(straight)
    assert (tmp_path / "resumed" / "thesis.tex").read_text() == "my thesis"
    # the failed final save of a later run: one line, the earlier checkpoints kept, no temporary folder
    _fail_json_writes(monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.console_main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet", "--resume"]
                           + sum((["--gin_param", p] for p in _tiny_params(tiny_checkpoint, tmp_path / "resumed",
                                                                           steps=3)), []))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treejax-train: error: could not save the checkpoint of step 3 to "
                                                   f"{tmp_path / 'resumed' / 'checkpoints'}: No space left"), err
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["1", "2"]
    assert (tmp_path / "resumed" / "thesis.tex").read_text() == "my thesis"
