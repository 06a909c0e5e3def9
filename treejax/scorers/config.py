"""The scorer model's settings: one frozen, gin-configurable dataclass (``@ScorerConfig()``)."""

from __future__ import annotations

import dataclasses
import re

from treejax.errors import ConfigError

#: the judge's default prompt (``{question}``, ``{response}``, ``{answer}``: the task's question, the policy's
#: response text, the ground-truth answer); the verdict is read right after the assistant turn opens, so it ends
#: with the question the verdict tokens answer
DEFAULT_TEMPLATE = ("Here is a math problem and a student's solution.\n\nProblem: {question}\n\nSolution:\n"
                    "{response}\n\nIs every step of the solution correct? Answer Yes or No.")
#: the PRM's default user turn (the response's steps follow in the assistant turn, each with the step tag)
DEFAULT_STEP_TEMPLATE = "Check this solution step by step.\n\nProblem: {question}"
MODES = ("logprob", "decode")
DTYPES = ("float32", "bfloat16", "float16")
#: ``ScorerConfig.sharding`` values.
SHARDINGS = ("device", "mesh")


@dataclasses.dataclass(frozen=True)
class ScorerConfig:
    """A second model that scores the policy's text (module :mod:`treejax.scorers`).

    * ``model``: what ``RunConfig.model`` takes (an embedded name such as ``"smollm2-135m-instruct"``, an HF folder,
      a ``.gguf`` file), or ``"policy"``: a frozen copy of the policy's initial weights (``RunConfig.model``
      loaded again; unchanged by training and by a resume);
    * ``compute_dtype``: the scorer's weights and compute (its own precision, apart from the policy's);
    * ``template``: the user turn, with ``{question}``, ``{response}`` and optionally ``{answer}``; rendered with
      the scorer's chat template, then ``answer_prefix`` is appended after the assistant turn opens;
    * ``yes_tokens`` / ``no_tokens``: verdict tokens (each must be one token of the scorer's vocabulary; the
      probabilities of a group's tokens are summed); the score is ``p(yes) / (p(yes) + p(no))``;
    * ``mode``: ``"logprob"`` (the verdict tokens' probabilities at the next position, one forward, no decoding)
      or ``"decode"`` (greedy decoding of ``max_new_tokens`` with the sampler, then ``verdict_pattern``'s first
      group parsed by :func:`treejax.scorers.verdicts.parse_verdict`: a yes/no word, or a number mapped by
      ``score_range`` to [0, 1]; unparsable: ``NaN``);
    * ``batch_size``: rows per forward (the last batch is padded: one compiled program per length bucket);
    * ``step_template`` / ``step_tag``: the PRM's user turn and the text inserted after each step
      (:mod:`treejax.scorers.prm`);
    * ``sharding``: where the scorer's weights live: ``"device"`` (whole, on the run's first device) or ``"mesh"``
      (laid out over the run's learner mesh by the policy's logical-axis rules, ``treejax.parallel.axis_rules``:
      FSDP shards every matrix, tensor parallelism splits the heads; the rows of each forward split over the
      mesh's batch axes where they divide). ``"mesh"`` serves the teacher-forced passes (``mode = "logprob"``, the
      PRM's step scores) of judge stages; ``mode = "decode"`` and a branching rule's PRM, which run inside the
      sampler, take ``"device"``.
    """

    model: str = "smollm2-135m-instruct"
    compute_dtype: str = "float32"
    template: str = DEFAULT_TEMPLATE
    answer_prefix: str = ""
    yes_tokens: tuple = ("Yes", "yes")
    no_tokens: tuple = ("No", "no")
    mode: str = "logprob"
    verdict_pattern: str = r"(?i)\b(yes|no)\b"
    score_range: tuple | None = None
    max_new_tokens: int = 16
    batch_size: int = 16
    max_length: int = 1024
    step_template: str = DEFAULT_STEP_TEMPLATE
    step_tag: str = "\nIs this step correct? Answer:"
    sharding: str = "device"

    def __post_init__(self):
        object.__setattr__(self, "yes_tokens", tuple(self.yes_tokens))
        object.__setattr__(self, "no_tokens", tuple(self.no_tokens))
        if self.score_range is not None:
            object.__setattr__(self, "score_range", tuple(float(x) for x in self.score_range))
        self._check()

    def _check(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ScorerConfig.mode must be one of {MODES}, got {self.mode!r}; fix: "
                              "ScorerConfig.mode = 'logprob'")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"ScorerConfig.sharding must be one of {SHARDINGS}, got {self.sharding!r}; fix: "
                              "ScorerConfig.sharding = 'mesh' (or 'device')")
        if self.sharding == "mesh" and self.mode == "decode":
            raise ConfigError("ScorerConfig.sharding = 'mesh' serves the teacher-forced passes; mode = 'decode' "
                              "decodes with the sampler on one device; fix: ScorerConfig.sharding = 'device', or "
                              "ScorerConfig.mode = 'logprob'")
        if self.compute_dtype not in DTYPES:
            raise ConfigError(f"ScorerConfig.compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}")
        if not self.yes_tokens or not self.no_tokens or set(self.yes_tokens) & set(self.no_tokens):
            raise ConfigError("ScorerConfig.yes_tokens and no_tokens must be non-empty and disjoint, got "
                              f"{self.yes_tokens} / {self.no_tokens}; fix: e.g. ('Yes', 'yes') / ('No', 'no')")
        if "{response}" not in self.template:
            raise ConfigError("ScorerConfig.template must contain {response} (the policy's text); fix: see "
                              "treejax.scorers.config.DEFAULT_TEMPLATE")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.max_length < 8:
            raise ConfigError(f"ScorerConfig: batch_size >= 1, max_new_tokens >= 1 and max_length >= 8 required, "
                              f"got {self.batch_size}, {self.max_new_tokens}, {self.max_length}")
        try:
            pattern = re.compile(self.verdict_pattern)
        except re.error as e:
            raise ConfigError(f"ScorerConfig.verdict_pattern is not a regular expression ({e})") from None
        if pattern.groups < 1:
            raise ConfigError(f"ScorerConfig.verdict_pattern needs one capturing group (the verdict), got "
                              f"{self.verdict_pattern!r}; fix: e.g. r'<verdict>(yes|no)</verdict>'")
        if self.score_range is not None and (len(self.score_range) != 2 or self.score_range[0] >= self.score_range[1]):
            raise ConfigError(f"ScorerConfig.score_range must be (low, high) with low < high, got {self.score_range}")

    def render(self, question: str, response: str, answer: str = "") -> str:
        """The judge's user turn for one response."""
        return self.template.format(question=question, response=response, answer=answer)
