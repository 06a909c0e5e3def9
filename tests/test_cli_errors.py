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


def test_train_model_folder_without_a_chat_template(capsys, tmp_path, tiny_checkpoint):
    """A folder holding only tokenizer.json (found by the audit's re-run: the prompts were formatted before the
    model's config.json was read, and the missing template was a ValueError traceback)."""
    folder = tmp_path / "tokenizer_only"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_checkpoint, "tokenizer.json"), folder / "tokenizer.json")
    msg = _train_model_error(capsys, tmp_path, folder)
    assert msg == (f"the tokenizer of {folder} has no chat template, and treejax formats every prompt with one: give a "
                   "model whose folder has tokenizer_config.json with a chat_template (or chat_template.jinja), as "
                   "transformers' save_pretrained writes for chat models")


@pytest.mark.parametrize("impl,why", [
    ("pallas_tpu", "the TPU decode kernel is a Pallas TPU (Mosaic) kernel, the backend is 'cpu'"),
    ("pallas_mgpu", "the Mosaic GPU decode kernel is a Pallas Mosaic GPU (Hopper) kernel, the backend is 'cpu'"),
])
def test_train_decode_kernel_this_backend_cannot_run(capsys, tmp_path, tiny_checkpoint, impl, why):
    """A forced decode kernel off its backend (the TPU kernel, the Mosaic GPU kernel on this CPU) is one line naming
    the fix, when the sampler is built (the kernel's limits need the model's head size and cache dtype)."""
    argv = ["--quiet", "--gin_param", f"RunConfig.model='{tiny_checkpoint}'",
            "--gin_param", f"RunConfig.log_dir='{tmp_path / 'log'}'",
            "--gin_param", f"RunConfig.decode_attention='{impl}'"]
    msg = _one_line_error(capsys, train.console_main, argv, "treejax-train")
    assert msg.startswith(f"attention='{impl}' cannot be used: {why}"), msg
    assert msg.endswith("fix: attention='auto' or 'ragged' (RunConfig.decode_attention = 'auto' for treejax-train "
                        "and treejax-eval)"), msg


# ----------------------------------------------------------------------------------------------- gin bindings
@pytest.mark.parametrize("value", ["/some/path", "./runs/a", "runs/a", "~/runs/a", "Qwen2.5-Math-1.5B/"])
def test_unquoted_path_says_quote_string_values(capsys, value):
    msg = _one_line_error(capsys, train.console_main, ["--quiet", f"--gin_param=RunConfig.log_dir={value}"],
                          "treejax-train")
    assert msg == (f"--gin_param: quote string values: RunConfig.log_dir='{value}' "
                   f"(in a shell: --gin_param=\"RunConfig.log_dir='{value}'\")")


# ----------------------------------------------------------------------------------------------- one gin surface
def test_sft_takes_gin_file_as_train_does(tmp_path, monkeypatch):
    """``treejax-sft --gin_file=FILE`` reads FILE (as ``treejax-train --gin_file``); positional files still work
    and come after the ``--gin_file`` ones."""
    from treejax import sft

    seen = []

    class Parsed(Exception):
        pass

    def run(cfg):
        seen.append(cfg)
        raise Parsed

    monkeypatch.setattr(sft, "run", run)
    first, second = tmp_path / "a.gin", tmp_path / "b.gin"
    first.write_text("SFTConfig.num_steps = 7\nSFTConfig.batch_size = 3\n")
    second.write_text("SFTConfig.num_steps = 9\n")
    with pytest.raises(Parsed):
        sft.console_main([f"--gin_file={first}", "--quiet"])
    with pytest.raises(Parsed):
        sft.console_main([str(second), "--gin_file", str(first), "--quiet"])
    assert [(c.num_steps, c.batch_size) for c in seen] == [(7, 3), (9, 3)]


def test_sft_gin_file_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.gin"
    bad.write_text("SFTConfig.num_stpes = 7\n")
    from treejax import sft

    msg = _one_line_error(capsys, sft.console_main, ["--gin_file", str(bad)], "treejax-sft")
    assert msg == f"{bad}:1: unknown gin binding 'SFTConfig.num_stpes'; did you mean SFTConfig.num_steps?"


def test_launch_says_trainer_arguments_go_after_the_separator(capsys):
    from treejax import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(["-n", "2", "--gin_param", "RunConfig.estimator='grpo'", "--devices_per_process", "2",
                     "--", "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("python -m treejax.launch: error: unrecognized arguments: --gin_param "
                       "\"RunConfig.estimator='grpo'\"; the trainer's arguments go after --: python -m treejax.launch "
                       "-n 2 --devices_per_process 2 -- --gin_param \"RunConfig.estimator='grpo'\" --quiet")


def test_train_model_folder_with_a_broken_tokenizer(capsys, tmp_path, tiny_checkpoint):
    """An empty (or truncated) tokenizer.json: one line naming the file, not a ValueError traceback."""
    folder = tmp_path / "broken_tok"
    shutil.copytree(tiny_checkpoint, folder)
    (folder / "tokenizer.json").write_text("")
    msg = _train_model_error(capsys, tmp_path, str(folder))
    assert msg.startswith(f"{folder / 'tokenizer.json'}: cannot parse tokenizer (") and "save_pretrained" in msg
