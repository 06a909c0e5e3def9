"""experiments/config_report.py on hand-written job folders: one row per log, the held-out accuracy before -> after,
the "with tools" column only when some job evaluated with its world (and "-" for the jobs that did not), the last
log line of a job without a summary, and a clear error for a missing folder."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "experiments"))

import config_report  # noqa: E402


def _job(out, name, rc, summary=None, log="step 1/2 done\n"):
    (out / f"{name}.log").write_text(log)
    (out / f"{name}.rc").write_text(f"{rc}\n")
    if summary is not None:
        (out / name).mkdir()
        (out / name / "summary.json").write_text(json.dumps(summary))


def _summary(acc_before, acc_after, **tools):
    ev = lambda acc, t: dict(accuracy=acc, n=128, **({"tool_accuracy": t[0], "tool_calls_mean": t[1]} if t else {}))  # noqa: E731
    return dict(estimator="grpo", task="retrieval_multihop", device="NVIDIA H200", steps=40, decoded_tokens=1000,
                loop_s=12.5, total_s=20.0, eval_before=ev(acc_before, tools.get("before")),
                eval_after=ev(acc_after, tools.get("after")))


def test_tool_column_and_plain_rows(tmp_path):
    _job(tmp_path, "warm", 0, _summary(0.0, 0.0, before=(0.75, 2.3), after=(0.883, 2.54)))
    _job(tmp_path, "grpo", 0, _summary(0.281, 0.422))
    _job(tmp_path, "broken", 2, log="step 1\ntreejax-train: error: out of memory\n")
    text = config_report.table(config_report.rows(str(tmp_path)))
    lines = text.splitlines()
    assert "with tools before -> after (calls)" in lines[0]
    by_name = {ln.split(" | ")[0].strip("| "): ln for ln in lines[2:] if ln.startswith("|")}
    assert "| 75.0% -> 88.3% (2.54) |" in by_name["warm"]
    assert "| 28.1% -> 42.2% (128) | - |" in by_name["grpo"]
    assert "no summary: treejax-train: error: out of memory" in by_name["broken"]
    assert all(ln.count("|") == lines[0].count("|") for ln in lines[2:] if ln.startswith("|") and "no summary" not in ln)
    assert text.endswith("device: NVIDIA H200")


def test_no_tool_column_without_tool_jobs(tmp_path):
    _job(tmp_path, "grpo", 0, _summary(0.281, 0.422))
    text = config_report.table(config_report.rows(str(tmp_path)))
    assert "with tools" not in text
    assert "| grpo | 0 | grpo | retrieval_multihop | 40 | 28.1% -> 42.2% (128) | 1000 | 12.5 | 20.0 |" in text


def test_missing_folder(tmp_path, capsys):
    assert config_report.main([str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
