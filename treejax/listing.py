"""What ``treejax-train --list KIND`` prints: one line per registered name, with the gin binding that selects it.

Kinds: ``tasks``, ``estimators``, ``branching``, ``shapers``, ``allocators``, ``strategies``, ``configs`` (the gin files of
:func:`default_config_dir`, the shipped configs folder). Everything listed comes from the
registries the trainer itself reads (tasks, estimators, branching rules, shapers, sampling strategies) and from the
shipped gin files, so a name registered in a notebook or an imported module shows up too.
"""

from __future__ import annotations

import importlib.resources
import os

__all__ = ["LIST_KINDS", "default_config_dir", "list_lines"]

LIST_KINDS = ("tasks", "estimators", "branching", "shapers", "allocators", "strategies", "configs")


def _first_line(doc: str | None) -> str:
    for line in (doc or "").strip().splitlines():
        line = line.strip()
        if line:
            return line
    return ""


def _table(rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(a) for a, _ in rows), default=0)
    return [f"{a.ljust(width)}  {b}".rstrip() for a, b in rows]


def _tasks() -> list[str]:
    from treejax.data import task_names
    from treejax.data.reasoning_gym_tasks import EASY_PRESETS

    rows = []
    for name in task_names():
        if name in EASY_PRESETS:
            opts = ", ".join(f"{k}={v!r}" for k, v in EASY_PRESETS[name].items() if k != "dataset")
            what = f"preset: reasoning-gym {EASY_PRESETS[name]['dataset']} ({opts})"
        elif name in ("gsm8k_file", "math_file"):
            what = (f"local {name.split('_')[0].upper()} file: task_options={{'path': ..., 'eval_path': ... or "
                    "'eval_fraction': ...}")
        elif name == "retrieval_multihop":
            what = ("the retrieval world's multi-hop questions (MultiTurnConfig.environment='retrieval'): "
                    "task_options={'size': ..., 'eval_size': ..., 'seed': ..., 'extraction': 'answer_line'}")
        elif name == "shell_files":
            what = ("the shell world's file-system questions (MultiTurnConfig.environment='shell'): "
                    "task_options={'size': ..., 'eval_size': ..., 'seed': ..., 'num_files': ..., "
                    "'max_output_chars': ..., "
                    "'extraction': 'answer_line'}")
        elif name == "travel_plans":
            what = ("the travel world's planning requests (MultiTurnConfig.environment='travel'): "
                    "task_options={'size': ..., 'eval_size': ..., 'seed': ..., 'inconsistent_credit': ..., "
                    "'extraction': 'answer_line'}")
        elif name == "reasoning_gym":
            what = "any reasoning-gym dataset: task_options={'dataset': ..., ...}"
        else:
            what = "reasoning-gym dataset (its config fields go in RunConfig.task_options)"
        rows.append((f"RunConfig.task='{name}'", what))
    return _table(rows)


def _estimators() -> list[str]:
    from treejax.rl.advantages import registry

    rows = []
    for name in registry.list_estimators():
        spec = registry.estimator_spec(name)
        doc = _first_line(spec.fn.__doc__)
        rows.append((f"RunConfig.estimator='{name}'", f"{doc} [options: @{spec.options_cls.__name__}()]"))
    return _table(rows)


def _branching() -> list[str]:
    from treejax.sampling import branching

    return _table([(f"TreeConfig.branching=@{cls.__name__}()", f"'{name}': {_first_line(cls.__doc__)}")
                   for name, cls in branching.rule_classes().items()])


def _shapers() -> list[str]:
    from treejax.rl.shaping import shaper_classes

    return _table([(f"RunConfig.shapers=[@{cls.__name__}()]", f"'{name}': {_first_line(cls.__doc__)}")
                   for name, cls in shaper_classes().items()])


def _allocators() -> list[str]:
    from treejax.rl.allocation import allocator_classes

    return _table([(f"AllocationConfig.allocator=@{cls.__name__}()", f"'{name}': {_first_line(cls.__doc__)}")
                   for name, cls in allocator_classes().items()])


def _strategies() -> list[str]:
    from treejax.sampling import strategies

    return _table([(f"TreeConfig.strategy=@{cls.__name__}()", f"'{name}': {_first_line(cls.__doc__)}")
                   for name, cls in strategies.STRATEGIES.classes().items()])


def _packaged_config_dir() -> str | None:
    try:
        quickstart = importlib.resources.files("treejax.configs").joinpath("quickstart.gin")
    except ModuleNotFoundError:
        return None
    return os.path.dirname(os.fspath(quickstart)) if isinstance(quickstart, os.PathLike) else None


def default_config_dir() -> str | None:
    """The folder of the shipped gin configs: the installed package data ``treejax/configs`` (a wheel), else the
    repository's ``configs/`` next to the package (a source checkout); None if neither holds ``quickstart.gin``."""
    repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    for folder in (_packaged_config_dir(), repo):
        if folder and os.path.isfile(os.path.join(folder, "quickstart.gin")):
            return folder
    return None


def _configs() -> list[str]:
    folder = default_config_dir()
    if folder is None:
        return []
    rows = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".gin"):
            continue
        with open(os.path.join(folder, name)) as f:
            comment = next((ln.lstrip("# ").strip() for ln in f if ln.startswith("#") and ln.strip("# \n")), "")
        rows.append((f"--gin_file={os.path.join(folder, name)}", comment))
    return _table(rows)


def list_lines(kind: str) -> list[str]:
    """The lines of ``--list kind`` (``kind`` one of :data:`LIST_KINDS`)."""
    from treejax.choices import check_choice

    check_choice("--list", kind, LIST_KINDS)
    return {"tasks": _tasks, "estimators": _estimators, "branching": _branching, "shapers": _shapers,
            "allocators": _allocators, "strategies": _strategies, "configs": _configs}[kind]()
