"""Evaluation only: ``treejax-eval [--model M] [--checkpoint RUN_DIR] [--task T] [--k 8] [--json OUT]``.

Greedy accuracy and, with ``--k > 0``, pass@1 / pass@k / maj@k over ``k`` samples per problem
(:mod:`treejax.rl.evaluation`) on a task's held-out split, with the training loop's prompt formatting.

``--model``: an embedded model name, a ``.gguf`` file or an HF checkpoint folder
(:func:`treejax.models.registry.load_model`). ``--checkpoint``: an orbax checkpoint written by the training loop (a
run's ``log_dir``, its ``checkpoints`` folder or one ``checkpoints/<step>`` folder; ``--step`` picks a step, default
the latest): only its params are read, onto the model named by ``--model`` (the run's base model by default).

Defaults of model, task, task options, system prompt, instruction, the evaluation settings (``RunConfig.eval``) and
the precision policy (``RunConfig.precision``: master dtype, the sampler's weight copy and KV-cache dtype, matmul
precision, as the training loop evaluates) come from a run config: ``--gin_file`` if given, else the
checkpoint run's ``operative_config.gin``, else ``configs/quickstart.gin`` (as ``treejax-train`` with no
arguments). Flags override them. Prints a table and, with ``--json``, writes the results there; writes nothing
else (no training state, no logs).

Examples:
  treejax-eval --k 8 --temperature 1.0                                   # the quickstart's model and task
  treejax-eval --checkpoint runs/quickstart --k 8 --json eval.json       # a run's latest checkpoint
  treejax-eval --model Qwen2.5-Math-1.5B/ --task math_file --task_option path=/data/math_train.jsonl \\
      --task_option eval_path=/data/math500.jsonl --num_problems 500 --max_new_tokens 1024 --k 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from treejax.errors import ConfigError, DataError, UserError, UserFileError
from treejax.log import configure_logging

__all__ = ["console_main", "eval_defaults", "main", "resolve_checkpoint"]


def resolve_checkpoint(path: str, step: int | None = None) -> tuple[str, int | None]:
    """``(checkpoint root, step)`` from a run's ``log_dir``, its ``checkpoints`` root or one step folder."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserFileError(f"--checkpoint: no such directory: {path}")
    if os.path.isdir(os.path.join(path, "state")) and os.path.basename(path).isdigit():  # one step folder
        folder_step = int(os.path.basename(path))
        if step is not None and step != folder_step:
            raise ConfigError(f"--step {step} contradicts the step folder {path}")
        return os.path.dirname(path), folder_step
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    steps = saved_steps(root)
    if not steps:
        raise UserFileError(f"--checkpoint: no checkpoints in {root} (expected step folders such as {root}/3/state, "
                            "as a training run writes them)")
    if step is not None and step not in steps:
        raise UserFileError(f"--step {step}: no checkpoint of that step in {root}; saved steps: "
                          f"{', '.join(map(str, steps))}")
    return root, step


def saved_steps(root: str) -> list[int]:
    """The steps with a complete checkpoint folder (``<root>/<step>/state``) under ``root``; read from the file
    system, so a wrong ``--checkpoint`` or ``--step`` is reported before any model loads."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(root, n, "state")))


def _task_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--task_option expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def build_parser() -> argparse.ArgumentParser:
    from treejax.rl.evaluation import EvalConfig

    d = EvalConfig()
    ap = argparse.ArgumentParser(prog="treejax-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="embedded model name, .gguf file or HF folder (with --checkpoint: "
                    "the model the run started from); default: the run config's RunConfig.model")
    ap.add_argument("--checkpoint", default=None, help="orbax checkpoint of a training run (params only): the run's "
                    "log_dir, its checkpoints folder or one step folder")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--gin_file", action="append", default=None,
                    help="run config(s) giving the defaults of model, task, task options, prompts and eval sizes "
                         "(default: the checkpoint run's operative_config.gin, else configs/quickstart.gin)")
    ap.add_argument("--gin_param", action="append", default=[], help="gin binding on top of --gin_file (repeatable)")
    ap.add_argument("--param_dtype", default=None, help="dtype the model and checkpoint params are loaded in "
                    "(default: the run config's master-weight dtype)")
    ap.add_argument("--task", default=None, help="default: RunConfig.task (with its task_options)")
    ap.add_argument("--task_option", action="append", default=[], type=_task_option,
                    help="task option key=value on top of the run config's (value parsed as JSON when it can be); "
                         "repeatable")
    ap.add_argument("--split", default="eval", help="task split to evaluate (default: the held-out 'eval')")
    ap.add_argument("--system_prompt", default=None, help="default: RunConfig.system_prompt (None: the task's)")
    ap.add_argument("--instruction", default=None, help="default: RunConfig.instruction (None: the task's)")
    ap.add_argument("--num_problems", type=int, default=None, help="default: the run config's evaluation size")
    ap.add_argument("--k", type=int, default=None, help="samples per problem for pass@k / maj@k, 0: greedy only "
                    f"(default: the run config's, else {d.k})")
    ap.add_argument("--temperature", type=float, default=None,
                    help=f"temperature of the k samples (default: the run config's, else {d.temperature})")
    ap.add_argument("--max_new_tokens", type=int, default=None, help="default: the run config's evaluation budget")
    ap.add_argument("--batch_size", type=int, default=None, help=f"default: the run config's, else {d.batch_size}")
    ap.add_argument("--seed", type=int, default=None, help=f"default: the run config's, else {d.seed}")
    ap.add_argument("--json", default=None, help="write the results (and settings) to this JSON file")
    ap.add_argument("--details", action="store_true", help="include per-problem responses in the JSON")
    ap.add_argument("--quiet", action="store_true")
    return ap


def format_table(metrics: dict) -> str:
    """``metric  value`` lines (the ``pass@k``/``maj@k`` aliases are shown under their numbered names only)."""
    rows = [(k, v) for k, v in metrics.items()
            if k != "problems" and not (k in ("pass@k", "maj@k") and "k" in metrics)]
    width = max(len(k) for k, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    for k, v in rows:
        lines.append(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return "\n".join(lines)


def eval_defaults(run_cfg) -> dict:
    """EvalConfig fields of a RunConfig's ``eval``, without ``vote_probe``: this evaluator restores the policy's
    parameters only, not the shapers' state (``TrainState.aux``) that a probe-weighted vote reads."""
    return dict(dataclasses.asdict(run_cfg.eval), vote_probe=None)


def _run_config(args, checkpoint_root):
    """The RunConfig whose settings are the defaults (and the gin file it came from)."""
    from treejax.gin_surface import parse
    from treejax.listing import default_config_dir

    gin_files = args.gin_file
    if gin_files is None:
        gin_files = []
        candidates = []
        if checkpoint_root is not None:
            candidates.append(os.path.join(os.path.dirname(checkpoint_root), "operative_config.gin"))
        d = default_config_dir()
        if d:
            candidates.append(os.path.join(d, "quickstart.gin"))
        gin_files = [c for c in candidates if os.path.exists(c)][:1]
    return parse(gin_files, args.gin_param, check_mesh=False), gin_files  # eval does not use the run's mesh


def _restored_params(root: str, step, params, run_cfg):
    """``(params, step)`` of a training checkpoint: its params, or for a LoRA run (``RunConfig.lora``) its adapters
    restored onto the frozen base and merged (``W + s A B``)."""
    import jax

    from treejax.checkpoint import restore_params

    if not run_cfg.lora.enabled:
        return restore_params(root, params, step)
    from treejax.models import lora

    adapters, frozen = lora.split(lora.prepare(params, run_cfg.lora))
    adapters, step = restore_params(root, adapters, step)
    return jax.jit(lora.merge)(lora.combine(adapters, frozen)), step


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    log = configure_logging(args.quiet).getChild("evaluate")

    import jax

    from treejax.data import get_task
    from treejax.data.splits import check_split
    from treejax.models.registry import load_model
    from treejax.rl.evaluation import EvalConfig, evaluate, prompt_width_for
    from treejax.sampling.decode import make_model_fns

    root = step = None
    if args.checkpoint:
        root, step = resolve_checkpoint(args.checkpoint, args.step)
    run_cfg, gin_files = _run_config(args, root)
    model = args.model or run_cfg.model
    task_name = args.task or run_cfg.task
    task_options = dict(run_cfg.task_options) if task_name == run_cfg.task else {}
    task_options.update(dict(args.task_option))
    system_prompt = args.system_prompt if args.system_prompt is not None else run_cfg.system_prompt
    instruction = args.instruction if args.instruction is not None else run_cfg.instruction
    defaults = eval_defaults(run_cfg)
    flags = {name: getattr(args, name) for name in defaults if getattr(args, name, None) is not None}
    try:
        config = EvalConfig(**{**defaults, **flags})
    except ValueError as e:  # the run config's values were checked when it was parsed: a flag is out of range
        given = [f"--{name} {value}" for name, value in flags.items() if f"EvalConfig.{name} " in str(e)]
        raise ConfigError(f"{', '.join(given)}: {e}" if given else str(e)) from None
    try:
        check_split(args.split)  # before the model loads
    except DataError as e:
        raise DataError(f"--split: {e}") from None

    task = get_task(task_name, **task_options)  # a task error too comes before the model loads
    t0 = time.perf_counter()
    prec = run_cfg.precision.resolve()
    model_config, params, tokenizer = load_model(model, param_dtype=args.param_dtype or prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype)
    if root is not None:
        params, step = _restored_params(root, step, params, run_cfg)
        log.info("restored the params of step %d from %s", step, root)
    params = prec.sampler_params(jax.device_put(params))
    examples = []
    for ex in task.examples(args.split):
        examples.append(ex)
        if len(examples) >= config.num_problems:
            break
    if not examples:
        raise DataError(f"task {task_name!r} has no {args.split!r} examples")
    width = prompt_width_for(tokenizer, examples, system_prompt, instruction)
    sampler_fns = make_model_fns(model_config, attention=run_cfg.decode_attention, cache_dtype=prec.cache_dtype)
    with prec.matmul_context():
        metrics = evaluate(params, sampler_fns, tokenizer, task, examples, width, config,
                           system_prompt=system_prompt, instruction=instruction, with_details=args.details)
    elapsed = time.perf_counter() - t0

    label = model + (f" + checkpoint step {step} ({root})" if root is not None else "")
    print(f"{label} on {task_name} [{args.split}]: {metrics['n']} problems, k={config.k}, T={config.temperature}, "
          f"max_new_tokens={config.max_new_tokens}, {elapsed:.1f} s")
    print(format_table(metrics))
    result = {"model": model, "checkpoint": root, "step": step, "run_config": gin_files[0] if gin_files else None,
              "task": task_name, "task_options": task_options, "split": args.split, "system_prompt": system_prompt,
              "instruction": instruction, "config": dataclasses.asdict(config),
              "metrics": {k: v for k, v in metrics.items() if k != "problems"}, "seconds": elapsed}
    if "problems" in metrics:
        result["problems"] = metrics["problems"]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=float)
    return result


def console_main(argv: list[str] | None = None) -> None:
    """The ``treejax-eval`` entry point: a :class:`~treejax.errors.UserError` is one line and exit status 2."""
    try:
        main(argv)
    except UserError as e:  # a user's mistake is one line; anything else keeps its traceback
        print(f"treejax-eval: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    console_main()
