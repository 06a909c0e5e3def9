"""The gin-facing configuration of ``treejax-sft`` (:class:`SFTConfig`, :class:`OTRConfig`), apart from the CLI and the
training code in :mod:`treejax.sft` so that the gin surface (:mod:`treejax.gin_surface`) can register it without
importing the program that imports the gin surface. :mod:`treejax.sft` re-exports every name here."""

from __future__ import annotations

import dataclasses

from treejax.choices import check_choice
from treejax.config_types import check_types
from treejax.data.defaults import DEFAULT_TASK_OPTIONS
from treejax.errors import ConfigError, DataError
from treejax.precision import Precision
from treejax.rl.evaluation import EvalConfig
from treejax.rl.multiturn import MultiTurnConfig
from treejax.rl.optimizer import OptimizerConfig

__all__ = ["OBJECTIVES", "OTRConfig", "SFTConfig", "check_expert_world", "demonstration_text", "format_demonstration"]

#: ``SFTConfig.objective`` values.
OBJECTIVES = ("nll", "otr")


@dataclasses.dataclass(frozen=True)
class OTRConfig:
    """One-Token Rollout's constants: ``samples`` K candidates per position (0: the exact expectation over
    ``q``), drawn at ``temperature`` tau, each non-gold candidate rewarded ``beta``.

    Sources (the paper's text itself could not be read offline; its v1 abstract, its ICLR 2026 reviews and a summary
    of it were): K = 256 candidates per position from ``softmax(z / tau)`` with ``tau > 1`` (1.3 is the example
    given), reward 1 for the gold token and a slightly negative ``beta`` for any other (an ablation found it
    stabilises training), ``log pi`` at temperature 1 in the loss, no baseline, no importance weight for sampling at
    tau, OTR replacing the cross-entropy loss (not added to it). ``beta = -0.1`` is treejax's choice: the value was
    not found. A reviewer's closed form of the expectation is what ``samples = 0`` computes."""

    samples: int = 256
    temperature: float = 1.3
    beta: float = -0.1

    def __post_init__(self):
        if self.samples < 0:
            raise ValueError(f"OTRConfig.samples must be >= 0 (0: exact expectation), got {self.samples}")
        if self.temperature <= 0:
            raise ValueError(f"OTRConfig.temperature must be > 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The gin-facing surface of ``treejax-sft`` (module docstring for the objectives and the data).

    ``multiturn``: ``None`` (a demonstration per record, the answer alone) or a :class:`MultiTurnConfig` whose world
    replays expert steps: each record's demonstration is then its *expert episode*, the reference tool calls played
    in the world and the answer turn (:mod:`treejax.sft_episodes`), and held-out evaluation also runs greedy
    episodes with the tools (``tool_accuracy``). The same ``MultiTurnConfig`` as the RL run's, so the rows match."""

    model: str = "smollm2-135m-instruct"
    precision: Precision = Precision()
    task: str = "chain_sum_2x1"
    task_options: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_TASK_OPTIONS))
    system_prompt: str | None = None
    instruction: str | None = None
    demonstration: str = "{answer}"
    max_demo_tokens: int = 256
    batch_size: int = 16
    num_steps: int = 10
    objective: str = "nll"
    otr: OTRConfig = OTRConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5, warmup_steps=0, total_steps=10)
    eval: EvalConfig = EvalConfig(num_problems=32, max_new_tokens=32)
    eval_every: int = 0
    seed: int = 0
    log_dir: str = "runs/sft"
    export_hf: bool = False
    multiturn: MultiTurnConfig | None = None

    def __post_init__(self):
        check_types(self)
        check_choice("SFTConfig.objective", self.objective, OBJECTIVES)
        for name in ("batch_size", "max_demo_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_steps < 0 or self.eval_every < 0:
            raise ConfigError("SFTConfig.num_steps and eval_every must be >= 0")
        try:
            self.demonstration.format_map(_Probe())
        except (ValueError, IndexError) as e:
            raise ConfigError(f"SFTConfig.demonstration = {self.demonstration!r} is not a format string: {e}") from e
        if self.multiturn is not None:
            check_expert_world(self.multiturn)


def check_expert_world(multiturn) -> type:
    """The environment class of ``multiturn`` (a :class:`MultiTurnConfig`) when it can replay expert steps (its
    episodes are the demonstrations, :mod:`treejax.sft_episodes`); else one ConfigError line naming those that can."""
    from treejax.envs import env_names, get_env

    env = get_env(multiturn.environment)
    if not getattr(env, "expert_steps", False):
        able = [n for n in env_names() if getattr(get_env(n), "expert_steps", False)]
        raise ConfigError(f"SFTConfig.multiturn: environment {multiturn.environment!r} cannot replay expert steps "
                          f"(no render_call), so it has no expert episodes; fix: MultiTurnConfig.environment = "
                          f"{able[0]!r}" + (f" (worlds with expert steps: {able})" if len(able) > 1 else ""))
    return env


def format_demonstration(template: str, fields: dict, uid) -> str:
    """``template`` formatted with ``fields``; a field it names that the record lacks is a DataError naming it."""
    try:
        return template.format_map(fields)
    except KeyError as e:
        raise DataError(f"SFTConfig.demonstration = {template!r} names {e} which record {uid!r} does not have "
                        f"(fields: {sorted(fields)})") from None


def demonstration_text(template: str, record: dict) -> str:
    """The demonstration of a record: ``template`` formatted with its ``answer``, ``question`` and metadata keys."""
    import json

    fields = dict(json.loads(record.get("metadata") or "{}"), answer=record["answer"], question=record["question"])
    return format_demonstration(template, fields, record.get("uid"))


class _Probe(dict):
    def __missing__(self, key):
        return ""
