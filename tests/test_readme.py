"""README's quickstart output: the same lines ``treejax-train`` prints, and a statement of what varies."""

import os
import re

from treejax.rl.report import format_summary

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _shape(line: str) -> str:
    """A summary line with its numbers and paths replaced, so README's sample and a fresh run compare."""
    line = re.sub(r"(\.\.\.|/)\S*", "<path>", line)
    return re.sub(r"[-+]?\d+(\.\d+)?", "#", line).rstrip()


def _readme_summary() -> list[str]:
    text = open(README, encoding="utf-8").read()
    block = re.search(r"```\n(treejax run: .*?)```", text, re.S)
    assert block, "README has no sample summary block"
    return block.group(1).rstrip("\n").splitlines()


def test_readme_sample_summary_has_the_printed_lines():
    ev = {"accuracy": 0.344, "n": 32}
    last = {"reward/mean": -1.0, "reward/accuracy": 0.0, "time/rollout_s": 8.5, "time/scoring_s": 0.0,
            "time/logp_s": 6.2, "time/update_s": 31.6}
    summary = {"model": "smollm2-135m-instruct", "task": "chain_sum_2x1", "estimator": "treepo", "steps": 3,
               "total_s": 231.0, "eval_before": ev, "eval_after": ev, "history": [last], "decoded_tokens": 834,
               "precision": {"param_dtype": "float32", "compute_dtype": "float32"}, "log_dir": "/r/q",
               "checkpoint_dir": "/r/q/checkpoints", "hf_export": "/r/q/hf_export",
               "tree_picture": "/r/q/tree_step3.png", "divergence": [], "compile_s": 100.8, "compile_programs": 56,
               "compile_after_first_step_s": 0.3}
    printed = format_summary(summary).strip("\n").splitlines()
    assert [_shape(line) for line in _readme_summary()] == [_shape(line) for line in printed]


def test_readme_states_what_varies_across_machines():
    text = " ".join(open(README, encoding="utf-8").read().split())
    assert "What varies across machines: runs on one machine are bit-identical" in text
    assert "Times depend on the machine" in text
