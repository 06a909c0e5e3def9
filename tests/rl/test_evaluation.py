"""Held-out evaluation: pass@k / maj@k estimators on hand examples, evaluate() on a tiny model, and the
evaluation-only CLI end to end on a tiny HF folder plus an orbax checkpoint of a (fake) run."""

import dataclasses
import json
import math
import os
import types

import jax
import numpy as np
import pytest

from treejax.data.tasks import Example, Task
from treejax.rl import evaluation as E


# ----------------------------------------------------------------------------------------------- estimators
def test_pass_at_k_hand_example_and_edges():
    assert E.pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # = 0.7
    assert E.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert E.pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c / n
    assert E.pass_at_k(10, 0, 3) == 0.0  # no correct sample
    assert E.pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert E.pass_at_k(4, 1, 4) == 1.0 and E.pass_at_k(4, 0, 4) == 0.0  # k = n: 1[c > 0]
    # the binomial formula on a grid, vectorised over problems
    rows = [(n, c, k) for n in range(1, 13) for c in range(n + 1) for k in range(1, n + 1)]
    n, c, k = (np.array(x) for x in zip(*rows))
    for kk in np.unique(k):
        sel = k == kk
        got = E.pass_at_k(n[sel], c[sel], int(kk))
        want = [1 - math.comb(a - b, int(kk)) / math.comb(a, int(kk)) for a, b in zip(n[sel], c[sel])]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert E.pass_at_k(np.array([8, 8, 8]), np.array([0, 1, 8]), 8).tolist() == [0.0, 1.0, 1.0]
    # large n: the product form has no overflow
    assert E.pass_at_k(1000, 3, 10) == pytest.approx(1 - math.comb(997, 10) / math.comb(1000, 10), rel=1e-12)
    for bad in ((3, 1, 4), (3, 4, 2), (3, -1, 1), (3, 1, 0)):
        with pytest.raises(ValueError, match="pass_at_k"):
            E.pass_at_k(*bad)


def test_majority_vote_and_maj_at_k_hand_example():
    answers = [
        ["5", "5.0", "7", None],      # 5 and 5.0 vote together: "5" (sample 0) wins 2-1
        ["3", "4", "4", "3"],         # 2-2 tie: the answer seen first ("3", sample 0) wins
        [None, "", None, None],       # nothing parseable: no vote, counts as wrong
        ["x", "\\text{B}", "b", "a"],  # "\\text{B}" and "b" vote together (normalised strings): sample 1
        ["1,000", "999", "1000", "2"],  # "1,000" == "1000"
    ]
    assert [E.majority_vote(a) for a in answers] == [0, 0, None, 1, 0]
    scores = [
        [1.0, 1.0, 0.0, 0.0],
        [0.0, 1.0, 1.0, 0.0],  # the majority answer "3" is wrong although two samples are right
        [0.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 1.0, 0.0],
        [1.0, 0.0, 1.0, 0.0],
    ]
    np.testing.assert_array_equal(E.maj_at_k(answers, scores), [1, 0, 0, 1, 1])
    assert E.majority_vote(["a"]) == 0 and E.majority_vote([]) is None
    assert E.answer_key("  ") is None and E.answer_key("1/2") == E.answer_key("0.5")
    with pytest.raises(ValueError, match="scores"):
        E.maj_at_k([["1"]], [[1.0, 0.0]])


def test_eval_config_validation():
    E.EvalConfig(num_problems=1, max_new_tokens=1, batch_size=1, k=0, temperature=0.5, seed=3)
    for kwargs, match in [(dict(num_problems=0), "num_problems"), (dict(max_new_tokens=0), "max_new_tokens"),
                          (dict(batch_size=0), "batch_size"), (dict(k=-1), "k must"),
                          (dict(temperature=0.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
                          (dict(k=2.0), "k must be an int"), (dict(seed="0"), "seed"), (dict(batch_size=True), "int")]:
        with pytest.raises(ValueError, match=match):
            E.EvalConfig(**kwargs)


# ----------------------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny():
    """(config, params, tokenizer): a tiny random Llama with SmolLM2's real tokenizer (chat template)."""
    from treejax.models import presets, transformer
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
    cfg = presets.tiny_config("smollm2-135m", vocab_size=49152, eos_token_ids=tuple(tok.eos_ids), pad_token_id=2)
    return cfg, transformer.init_params(cfg, jax.random.key(0)), tok


class ParityTask(Task):
    """Scores a response 1 when its length in characters is even; its 'answer' is the length mod 3."""

    name = "parity"

    def records(self, split):
        return [{"uid": f"{i:016x}", "question": f"What is {i} + {i}?", "answer": str(2 * i), "metadata": "{}"}
                for i in range(5)]

    def score(self, response_text, example: Example) -> float:
        return float(len(response_text) % 2 == 0)

    def extract_answer(self, text):
        return str(len(text) % 3) if text else None


def test_evaluate_tiny_model_metrics_match_their_definitions(tiny):
    cfg, params, tok = tiny
    task = ParityTask()
    examples = list(task.examples("eval"))
    width = E.prompt_width_for(tok, examples)
    config = E.EvalConfig(num_problems=4, max_new_tokens=6, batch_size=3, k=3, temperature=1.5, seed=1)
    out = E.evaluate(params, cfg, tok, task, examples, width, config, with_details=True)
    assert out["n"] == 4 and out["k"] == 3
    for key in ("accuracy", "pass@1", "pass@3", "pass@k", "maj@3", "maj@k"):
        assert 0.0 <= out[key] <= 1.0, key
    assert 0 < out["mean_length"] <= 6 and 0 < out["sample_mean_length"] <= 6
    probs = out["problems"]
    assert len(probs) == 4 and all(len(p["sample_texts"]) == 3 for p in probs)
    # the metrics are what their definitions say about the decoded responses
    assert out["accuracy"] == np.mean([len(p["greedy_text"]) % 2 == 0 for p in probs])
    correct = np.array([[s >= 1.0 for s in p["sample_scores"]] for p in probs])
    assert out["pass@1"] == pytest.approx(correct.mean())
    assert out["pass@3"] == pytest.approx(correct.any(axis=1).mean())
    assert out["maj@3"] == pytest.approx(np.mean(E.maj_at_k([p["sample_answers"] for p in probs],
                                                            [p["sample_scores"] for p in probs])))
    assert [p["sample_answers"] for p in probs] == [[str(len(t) % 3) if t else None for t in p["sample_texts"]]
                                                     for p in probs]
    # deterministic given the seed; greedy does not depend on it
    again = E.evaluate(params, cfg, tok, task, examples, width, config)
    assert {k: v for k, v in out.items() if k != "problems"} == again
    other = E.evaluate(params, cfg, tok, task, examples, width, E.EvalConfig(
        num_problems=4, max_new_tokens=6, batch_size=3, k=0))
    assert set(other) == {"accuracy", "mean_length", "n"} and other["accuracy"] == out["accuracy"]
    with pytest.raises(ValueError, match="prompt width"):
        E.evaluate(params, cfg, tok, task, examples, 4, config)


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_eval_defaults_from_the_run_config():
    from treejax.evaluate import eval_defaults

    nested = types.SimpleNamespace(eval=E.EvalConfig(num_problems=7, max_new_tokens=9, k=4, temperature=0.7))
    assert eval_defaults(nested) == dataclasses.asdict(E.EvalConfig(num_problems=7, max_new_tokens=9, k=4,
                                                                     temperature=0.7))


def test_cli_end_to_end_on_a_checkpoint(tiny, tmp_path, capsys):
    """A tiny HF folder + a run folder holding an orbax checkpoint of changed params and an operative config:
    treejax-eval restores the params (the greedy responses change), reads the task settings from the run's config,
    prints the table, writes the JSON, and writes nothing into the run folder."""
    from treejax import evaluate as cli
    from treejax.checkpoint import Checkpointer
    from treejax.models.export import export_hf
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.train_state import TrainState

    cfg, params, tok = tiny
    folder = str(tmp_path / "tiny_hf")
    export_hf(params, cfg, folder, tok)
    run = tmp_path / "run"
    trained = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape, x.dtype), params)
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(2, TrainState.create(params, make_optimizer(OptimizerConfig())), force=True)
        ckpt.save(4, TrainState.create(trained, make_optimizer(OptimizerConfig())), force=True)
    from treejax.rl.loop import RunConfig

    if "eval" in {f.name for f in dataclasses.fields(RunConfig)}:  # RunConfig.eval: an EvalConfig
        eval_lines = "RunConfig.eval = @EvalConfig()\nEvalConfig.num_problems = 3\nEvalConfig.max_new_tokens = 5\n"
    else:  # older RunConfig: eval_size / eval_max_new_tokens
        eval_lines = "RunConfig.eval_size = 3\nRunConfig.eval_max_new_tokens = 5\n"
    (run / "operative_config.gin").write_text(
        f"RunConfig.model = '{folder}'\nRunConfig.task = 'chain_sum_2x1'\n"
        "RunConfig.task_options = {'size': 16, 'eval_size': 4, 'seed': 0, 'system_prompt': None, "
        "'instruction': 'Answer with just the number.', 'extraction': 'last_number'}\n" + eval_lines)
    before = sorted((p, os.path.getmtime(os.path.join(p, f))) for p, _, fs in os.walk(run) for f in fs)

    out_json = str(tmp_path / "eval.json")
    res = cli.main(["--checkpoint", str(run), "--k", "2", "--batch_size", "4", "--json", out_json, "--quiet",
                    "--details"])
    printed = capsys.readouterr().out
    assert "pass@2" in printed and "maj@2" in printed and "accuracy" in printed
    with open(out_json) as f:
        saved = json.load(f)
    assert saved["step"] == 4 and saved["model"] == folder and saved["task"] == "chain_sum_2x1"
    assert saved["config"]["num_problems"] == 3 and saved["config"]["max_new_tokens"] == 5
    assert saved["task_options"]["instruction"] == "Answer with just the number."
    assert saved["metrics"]["n"] == 3 and set(saved["metrics"]) >= {"accuracy", "pass@1", "pass@2", "maj@2"}
    assert all(0.0 <= saved["metrics"][k] <= 1.0 for k in ("accuracy", "pass@1", "pass@2", "maj@2"))
    assert len(saved["problems"]) == 3 and res["metrics"] == saved["metrics"]
    assert before == sorted((p, os.path.getmtime(os.path.join(p, f))) for p, _, fs in os.walk(run) for f in fs)

    # step 2 holds the untrained params: its greedy responses are the base model's, step 4's differ
    base = cli.main(["--model", folder, "--gin_file", str(run / "operative_config.gin"), "--quiet", "--details"])
    step2 = cli.main(["--checkpoint", str(run / "checkpoints" / "2"), "--quiet", "--details"])
    texts = lambda r: [p["greedy_text"] for p in r["problems"]]  # noqa: E731
    assert step2["step"] == 2 and texts(step2) == texts(base)
    assert texts(res) != texts(base)
    with pytest.raises(FileNotFoundError, match="step 3"):
        cli.main(["--checkpoint", str(run), "--step", "3", "--quiet"])


@pytest.mark.slow
def test_cli_embedded_smollm2_quickstart_task(tmp_path):
    """The real default: SmolLM2-135M-Instruct on the quickstart's task (settings from configs/quickstart.gin)."""
    from treejax import evaluate as cli

    res = cli.main(["--num_problems", "4", "--k", "2", "--max_new_tokens", "16", "--batch_size", "4", "--quiet",
                    "--json", str(tmp_path / "eval.json")])
    assert res["model"] == "smollm2-135m-instruct" and res["run_config"].endswith("quickstart.gin")
    assert res["metrics"]["n"] == 4 and all(0.0 <= res["metrics"][k] <= 1.0
                                            for k in ("accuracy", "pass@1", "pass@2", "maj@2"))
    assert json.loads((tmp_path / "eval.json").read_text())["metrics"] == res["metrics"]
