"""The shape of the code: no function (or method, or nested function) in treejax/ is over 80 lines, counted as
``end_lineno - lineno + 1`` of its ``def`` (decorators excluded, docstring included). A long function is split into
named sub-steps (see treejax/sampling/turns/ and treejax/sampling/tree_stages.py for the staged style)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 80


def long_functions(root: str, limit: int) -> list[tuple[int, str, int, str]]:
    """``(lines, path, line, name)`` of every function under ``root`` longer than ``limit`` lines, longest first."""
    out = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out.append((lines, os.path.relpath(path, os.path.dirname(root)), node.lineno, node.name))
    return sorted(out, key=lambda r: (-r[0], r[1], r[2]))


def test_no_function_over_80_lines():
    found = long_functions(os.path.join(ROOT, "treejax"), MAX_LINES)
    assert not found, (f"{len(found)} function(s) in treejax/ over {MAX_LINES} lines (split them into named "
                       "sub-steps):\n" + "\n".join(f"  {n:4d} {p}:{line} {name}" for n, p, line, name in found))


def test_the_walk_finds_long_functions(tmp_path):
    """The check itself: a 81-line function is reported with its path, line and length; an 80-line one is not."""
    pkg = tmp_path / "treejax"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    method = "\n".join("    " + line for line in body.split("\n"))
    (pkg / "m.py").write_text(f"def ok():\n{body}\n\n\nclass C:\n    @staticmethod\n    def long():\n{method}\n"
                              "        y = 0\n")
    assert long_functions(str(pkg), MAX_LINES) == [(81, os.path.join("treejax", "m.py"), 85, "long")]
