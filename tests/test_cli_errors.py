"""User mistakes found by issue 50's audit, each driven through the command a user types: one line naming the
cause and the fix, exit status 2, never a traceback."""

import os
import shutil

import pytest

from treejax import evaluate, train


def _one_line_error(capsys, console_main, argv, prog) -> str:
    """Runs ``console_main(argv)``; asserts exit status 2 and a single ``prog: error: ...`` line; returns the
    message after ``error: ``."""
    with pytest.raises(SystemExit) as exit_:
        console_main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    return err[len(f"{prog}: error: "):-1]


@pytest.fixture
def run_folder(tmp_path):
    """A training run's folder as ``treejax-eval --checkpoint`` finds it (one step folder; no model is read
    before the errors below)."""
    (tmp_path / "run" / "checkpoints" / "3" / "state").mkdir(parents=True)
    return str(tmp_path / "run")


@pytest.fixture
def no_model_load(monkeypatch):
    """treejax-eval must report these before any model loads."""
    from treejax.models import registry

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(registry, "load_model", load_model)


def test_eval_unknown_split(capsys, run_folder, no_model_load):
    msg = _one_line_error(capsys, evaluate.console_main, ["--checkpoint", run_folder, "--split", "bogus", "--quiet"],
                          "treejax-eval")
    assert msg == "--split: unknown split 'bogus'; valid splits: ['train', 'eval']"


@pytest.mark.parametrize("flag, value, message", [
    ("--num_problems", "0", "--num_problems 0: EvalConfig.num_problems must be >= 1, got 0"),
    ("--temperature", "0", "--temperature 0.0: EvalConfig.temperature must be a finite number > 0, got 0.0"),
])
def test_eval_flag_out_of_range(capsys, run_folder, no_model_load, flag, value, message):
    msg = _one_line_error(capsys, evaluate.console_main, ["--checkpoint", run_folder, flag, value, "--quiet"],
                          "treejax-eval")
    assert msg == message


def _train_model_error(capsys, tmp_path, model_folder) -> str:
    argv = ["--quiet", "--gin_param", f"RunConfig.model='{model_folder}'",
            "--gin_param", f"RunConfig.log_dir='{tmp_path / 'log'}'"]
    return _one_line_error(capsys, train.console_main, argv, "treejax-train")


def test_train_model_folder_without_tokenizer(capsys, tmp_path, tiny_checkpoint):
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_checkpoint, folder)
    os.remove(folder / "tokenizer.json")
    msg = _train_model_error(capsys, tmp_path, folder)
    assert msg == f"missing file {folder / 'tokenizer.json'} (only fast tokenizers / tokenizer.json are supported)"


def test_train_hf_folder_without_config(capsys, tmp_path, tiny_checkpoint):
    folder = tmp_path / "no_config"
    shutil.copytree(tiny_checkpoint, folder)
    os.remove(folder / "config.json")
    msg = _train_model_error(capsys, tmp_path, folder)
    assert msg == f"missing file {folder / 'config.json'} (an HF checkpoint folder needs config.json)"
