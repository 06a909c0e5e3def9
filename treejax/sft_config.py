"""The gin-facing configuration of ``treejax-sft`` (:class:`SFTConfig`, :class:`OTRConfig`), apart from the CLI and the
training code in :mod:`treejax.sft` so that the gin surface (:mod:`treejax.gin_surface`) can register it without
importing the program that imports the gin surface. :mod:`treejax.sft` re-exports every name here."""

from __future__ import annotations

import dataclasses

from treejax.choices import check_choice
from treejax.config_types import check_types
from treejax.data.defaults import DEFAULT_TASK_OPTIONS
from treejax.errors import ConfigError
from treejax.precision import Precision
from treejax.rl.evaluation import EvalConfig
from treejax.rl.optimizer import OptimizerConfig

__all__ = ["OBJECTIVES", "OTRConfig", "SFTConfig"]

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
    """The gin-facing surface of ``treejax-sft`` (module docstring for the objectives and the data)."""

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


class _Probe(dict):
    def __missing__(self, key):
        return ""
