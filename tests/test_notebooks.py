"""Executes every notebook in notebooks/ with the venv's python3 kernel (nbclient)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _kernel_name() -> str:
    """A kernel spec running this interpreter: the venv's own python3 spec, registered (user-level, through
    ipykernel) only if no spec with that name exists yet."""
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    if "python3" not in specs:
        from ipykernel.kernelspec import install

        install(user=True, kernel_name="python3", display_name="Python 3")
    return "python3"


SLOW = ("branching_rules.ipynb",)  # ~100 s on 2 cores; its rules are tested in tests/sampling/test_branching.py


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p
                                  for p in NOTEBOOKS], ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", str(path.parents[1]))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name=_kernel_name(), resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    if path.name == "new_estimator.ipynb":
        _check_new_estimator(nb)
    if path.name == "turn_tree.ipynb":
        _check_turn_tree(nb)


def _check_new_estimator(nb):
    """The library's picture (not a home-made drawing), and estimators whose printed advantages differ (the
    notebook asserts the gaps itself; here: its table is there and the rows are not equal)."""
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "viz.draw_tree(" in source and "pyplot" not in source
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in ("grpo", "treepo", "std_subgroup")}
    assert len(rows) == 3 and rows["grpo"] != rows["treepo"] != rows["std_subgroup"], text


def _check_turn_tree(nb):
    """The library's turn-tree picture and outline (not home-made ones), and a per-turn advantage table."""
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "viz.draw_turn_tree(" in source and "viz.turn_tree_text(" in source and "pyplot" not in source
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join(o.get("text", "") for o in outputs)
    assert "prompt: " in text and "  [1] " in text and "fork x2" in text, text
    assert "per turn (node: advantage)" in text and "mask:" in text, text
