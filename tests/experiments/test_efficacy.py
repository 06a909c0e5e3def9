"""experiments/efficacy.py: the report's curves, targets and ratios on hand-made run summaries (no model)."""

import importlib.util
import json
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "efficacy.py")


@pytest.fixture(scope="module")
def efficacy():
    spec = importlib.util.spec_from_file_location("efficacy", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(acc, step_s, tokens_per_step, eval_s=2.0, setup_s=5.0, steps_per_eval=5):
    """A summary.json as the loop writes it: evals every ``steps_per_eval`` steps, constant step time."""
    evals, history, wall = [], [], setup_s
    evals.append({"step": 0, "accuracy": acc[0], "wall_s": wall + eval_s, "eval_s": eval_s})
    wall += eval_s
    for i, a in enumerate(acc[1:], 1):
        for s in range((i - 1) * steps_per_eval + 1, i * steps_per_eval + 1):
            history.append({"step": s, "rollout/decoded_tokens": tokens_per_step, "time/rollout_s": 0.6 * step_s,
                            "time/scoring_s": 0.0, "time/logp_s": 0.1 * step_s, "time/update_s": 0.3 * step_s})
        wall += steps_per_eval * step_s + eval_s
        evals.append({"step": i * steps_per_eval, "accuracy": a, "wall_s": wall, "eval_s": eval_s})
    return {"evals": evals, "history": history, "device": "Test Card"}


def _write(root, method, seed, summary):
    d = os.path.join(root, method, f"seed{seed}")
    os.makedirs(d)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(summary, f)


def test_curve_excludes_setup_evaluations_and_compilation(efficacy):
    c = efficacy.curve_of(_summary([0.2, 0.3, 0.4], step_s=1.0, tokens_per_step=100))
    assert c["step"] == [0, 5, 10]
    np.testing.assert_allclose(c["seconds"], [0.0, 5.0, 10.0])  # 5 steps of 1 s each, evaluations not counted
    assert c["compile_s"] == 0.0
    s = _summary([0.2, 0.3, 0.4], step_s=1.0, tokens_per_step=100)
    s["history"][0]["time/rollout_s"] += 30.0  # the first step compiles for 30 s
    for e in s["evals"][1:]:
        e["wall_s"] += 30.0
    c = efficacy.curve_of(s)
    assert c["compile_s"] == pytest.approx(30.0)
    np.testing.assert_allclose(c["seconds"], [0.0, 5.0, 10.0])
    assert c["tokens"] == [0, 500, 1000]
    assert c["median_step_times"]["rollout_s"] == pytest.approx(0.6)


def test_report_targets_ratios_and_files(efficacy, tmp_path):
    runs = tmp_path / "runs"
    # GRPO ends at 0.40 (mean over seeds); TreePO reaches 0.40 at step 5 with half the step time.
    for seed, acc in enumerate(([0.2, 0.3, 0.38], [0.2, 0.3, 0.42])):
        _write(runs, "grpo", seed, _summary(acc, step_s=1.0, tokens_per_step=100))
    for seed, acc in enumerate(([0.2, 0.39, 0.5], [0.2, 0.41, 0.5])):
        _write(runs, "treepo", seed, _summary(acc, step_s=0.5, tokens_per_step=300))
    _write(runs, "never", 0, _summary([0.2, 0.2, 0.2], step_s=1.0, tokens_per_step=100))
    out = tmp_path / "report"
    summary = efficacy.report(str(runs), str(out), [], None)
    assert summary["target"] == pytest.approx(0.40)
    g, t, n = (summary["methods"][m] for m in ("grpo", "treepo", "never"))
    assert g["step_to_target"] == 10 and g["seconds_to_target"] == pytest.approx(10.0) and g["seconds_ratio"] == 1.0
    assert t["step_to_target"] == 5 and t["seconds_to_target"] == pytest.approx(2.5)
    assert t["seconds_ratio"] == pytest.approx(0.25) and t["tokens_ratio"] == pytest.approx(1500 / 1000)
    assert n["step_to_target"] is None and n["seconds_ratio"] is None
    assert t["final_accuracy"] == [0.5, 0.5] and t["accuracy_min"][1] == pytest.approx(0.39)
    md = (out / "efficacy.md").read_text()
    assert "Test Card" in md and "| treepo | 2 | 20.0% | 50.0% (50.0-50.0)" in md and "| never |" in md
    assert (out / "efficacy.png").stat().st_size > 10_000
    data = json.loads((out / "efficacy.json").read_text())
    assert data["device"] == "Test Card" and set(data["methods"]) == {"grpo", "treepo", "never"}


def test_flat_layout(efficacy, tmp_path):
    (tmp_path / "grpo_seed3.json").write_text(json.dumps(_summary([0.1, 0.2], 1.0, 10)))
    (tmp_path / "treepo_segment_seed0.json").write_text(json.dumps(_summary([0.1, 0.3], 1.0, 10)))
    runs = efficacy.load_runs(str(tmp_path))
    assert {m: sorted(r) for m, r in runs.items()} == {"grpo": [3], "treepo_segment": [0]}


def test_report_needs_the_baseline(efficacy, tmp_path):
    _write(tmp_path, "treepo", 0, _summary([0.2, 0.3], step_s=1.0, tokens_per_step=1))
    with pytest.raises(SystemExit, match="grpo"):
        efficacy.report(str(tmp_path), str(tmp_path / "out"), [], None)


def test_run_skips_finished_runs_and_names_methods(efficacy, tmp_path, capsys):
    cfg = tmp_path / "efficacy_treepo.gin"
    cfg.write_text("")
    _write(tmp_path / "runs", "treepo", 0, {"evals": []})
    efficacy.run([str(cfg)], [0, 1], str(tmp_path / "runs"), ["RunConfig.num_steps=2"], dry_run=True)
    out = capsys.readouterr().out
    assert "treepo seed 0: done already" in out
    assert "treepo seed 1: " in out and "RunConfig.seed=1" in out and "RunConfig.num_steps=2" in out
    with pytest.raises(SystemExit, match="no such config"):
        efficacy.run([str(tmp_path / "missing.gin")], [0], str(tmp_path / "runs"), [], dry_run=True)


def test_run_spreads_runs_over_devices_and_stops_starting(efficacy, tmp_path, monkeypatch):
    """``devices``: each new run goes to the device with the fewest runs going; ``stop_after``: none starts late."""
    configs = []
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.gin").write_text("")
        configs.append(str(tmp_path / f"{name}.gin"))
    started = []

    class Proc:
        def __init__(self, cmd, stdout=None, stderr=None, env=None):
            started.append(env["CUDA_VISIBLE_DEVICES"])
            self.polls = 0

        def poll(self):  # each run is still going at its first look, done at the second
            self.polls += 1
            return None if self.polls < 2 else 0

        def wait(self):
            return 0

    monkeypatch.setattr(efficacy.subprocess, "Popen", Proc)
    efficacy.run(configs, [0, 1], str(tmp_path / "runs"), [], parallel=4, devices=["0", "1"])
    assert started[:4] == ["0", "1", "0", "1"] and len(started) == 6
    started.clear()
    clock = iter([0.0] + [100.0] * 50)
    monkeypatch.setattr(efficacy.time, "perf_counter", lambda: next(clock))
    efficacy.run(configs, [0], str(tmp_path / "runs2"), [], parallel=2, devices=["0"], stop_after=10.0)
    assert started == []
