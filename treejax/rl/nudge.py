"""NudgeRL: rollouts conditioned on strategy hints, an inter/intra-context advantage, and a distillation term that
teaches the plain prompt what the hints found.

Source: code ``tally0818/NudgeRL`` (``src/train/NudgeRLTrainer.py``, ``configs/train_config.yaml``, read at cf247f7;
the paper, arXiv 2605.15726, only as its abstract). Per problem ``x0`` with hints ``h_1..h_M`` (``M = 2``, the
first ``M`` of the problem's hints; ``K = 4`` rollouts per hint, ``M K`` per problem):

* **contexts**: each of hint ``j``'s ``K`` rollouts drops its hint with probability ``p_drop = 0.5`` (``d_j ~
  Binomial(K, p_drop)``); the dropped rollouts of all hints form one plain-prompt context ``c = 0``, the others
  the hinted contexts ``c = j`` (a context left empty is skipped). A hinted prompt is the problem, then the hint
  block (:data:`HINT_TEMPLATE`, the code's text), then the task's instruction, in the user message
  (:func:`hinted_example`).
* **advantage** (estimator ``nudge``): with ``mu_c`` the mean reward of the rollout's context and ``mu`` the
  problem's mean over its ``M K`` rollouts,
  ``A = (r - mu_c) + lambda (mu_c - mu)`` for hinted rollouts (``lambda = 1.1``), ``A = r - mu`` for plain ones,
  then ``A <- (A - mean A) / (std A + 1e-5)`` over the problem's rollouts (population std).
* **PPO**: each rollout is trained under the prompt it was sampled from (the hinted one), as usual.
* **distillation**: every rollout's completion ``y`` is also scored under the plain prompt ``x0`` and trained with
  ``-lambda_d A tokmean_t log pi(y_t | x0, y_<t)`` (``lambda_d = 0.1``, advantage-weighted, no ratio in the code).
  Here each rollout gets a second row, ``x0 + y``, whose advantage is ``lambda_d A``; its sampler log-probs are
  ``y``'s under ``x0`` by teacher forcing (:func:`treejax.sampling.decode.score_tokens`), so the row is an
  ordinary on-policy row of the PPO loss: at ratio 1 (the first mini-batch of the first epoch) its gradient is the
  code's, later mini-batches clip it like any row. With ``aggregation = "seq-mean-token-mean"`` (the code's
  ``loss_type = "grpo"``) the loss is the code's ``grpo + lambda_d distill`` up to a factor 1/2 (twice the rows).

What differs: the code's hints are written per problem by an LLM offline (5 per problem, ``gpt-4o-mini``); treejax
reads a record's ``hints`` metadata (a list, e.g. a jsonl column) and otherwise the task-level
``NudgeConfig.hints``, the same for every problem (no model is called at run time).
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from treejax.errors import ConfigError, DataError
from treejax.rl.advantages.nudge import NUDGE_INPUTS
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import ESTIMATOR, EXPANDED, SINGLE_CHAIN, TRAIN_SPLIT, VERIFIER

#: The hint block NudgeRL's code inserts between the problem and the instruction.
HINT_TEMPLATE = ("Context (exploration condition):\n- Use this hint/approach: {hint}\n\nImportant:\n"
                 "- Follow this approach as your primary strategy.")


@dataclasses.dataclass(frozen=True)
class NudgeConfig(Stage):
    """The sampling side of NudgeRL (``RunConfig.rollouts = [@NudgeConfig()]``): ``num_hints`` M, ``rollouts_per_hint`` K,
    ``p_drop``, the task-level ``hints`` used for records without a ``hints`` metadata list, the hint block
    ``template`` (``{hint}``), ``distill``: add the plain-prompt rows (the distillation term)."""

    num_hints: int = 2
    rollouts_per_hint: int = 4
    p_drop: float = 0.5
    hints: tuple[str, ...] | list[str] = ()
    template: str = HINT_TEMPLATE
    distill: bool = True

    role: ClassVar[str] = "planner"  # each problem's hinted and plain rows, and the distillation rows
    requires: ClassVar[tuple] = (VERIFIER, TRAIN_SPLIT, SINGLE_CHAIN, EXPANDED, ESTIMATOR("nudge"))
    supplies: ClassVar[frozenset[str]] = frozenset(NUDGE_INPUTS)

    def build(self, inner, ctx):
        return NudgeRollouts(ctx.task_rollouts(), self, ctx.seed, ctx.estimator_inputs)

    def __post_init__(self):
        object.__setattr__(self, "hints", tuple(self.hints))
        if self.num_hints < 1 or self.rollouts_per_hint < 1:
            raise ConfigError("NudgeConfig.num_hints and rollouts_per_hint must be >= 1")
        if not 0.0 <= self.p_drop <= 1.0:
            raise ConfigError(f"NudgeConfig.p_drop must be in [0, 1], got {self.p_drop}")
        if "{hint}" not in self.template:
            raise ConfigError(f"NudgeConfig.template must contain {{hint}}, got {self.template!r}")

    @property
    def rollouts_per_problem(self) -> int:
        return self.num_hints * self.rollouts_per_hint

    def rows_per_problem(self) -> int:
        """Forest prompt rows per problem: its rollouts, and as many distillation rows."""
        return self.rollouts_per_problem * (2 if self.distill else 1)


def problem_hints(record: dict, cfg: NudgeConfig) -> list[str]:
    """The first ``M`` hints of a record: its metadata's ``hints`` list, else ``cfg.hints``."""
    meta = json.loads(record.get("metadata") or "{}")
    hints = meta.get("hints", list(cfg.hints))
    if not isinstance(hints, list) or not all(isinstance(h, str) for h in hints):
        raise DataError(f"record {record.get('uid')!r}: metadata 'hints' must be a list of strings, got {hints!r}")
    if len(hints) < cfg.num_hints:
        raise DataError(f"record {record.get('uid')!r} has {len(hints)} hints, NudgeConfig.num_hints = "
                        f"{cfg.num_hints}: give records a 'hints' metadata list or set NudgeConfig.hints")
    return hints[: cfg.num_hints]


def rollout_contexts(rng: np.random.Generator, cfg: NudgeConfig) -> np.ndarray:
    """int ``[M K]``: one problem's rollouts' contexts (1..M hinted, 0 plain): hint ``j``'s ``K`` rollouts keep
    it except ``d_j ~ Binomial(K, p_drop)`` of them; hinted rollouts first (by hint), then the plain ones."""
    K = cfg.rollouts_per_hint
    drops = rng.binomial(K, cfg.p_drop, size=cfg.num_hints)
    ctx = [j + 1 for j in range(cfg.num_hints) for _ in range(K - drops[j])]
    return np.array(ctx + [0] * int(drops.sum()), np.int32)


def hinted_example(example, hint: str | None, cfg: NudgeConfig):
    """The :class:`~treejax.data.task_base.Example` whose last user message carries the hint block right after
    the question (before the task's instruction); ``hint=None``: the example itself. Its ground truth and metadata
    are the problem's, so the verifier scores it as the plain problem."""
    if hint is None:
        return example
    msgs = [dict(m) for m in example.prompt_messages]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    content, question, block = msgs[last]["content"], example.metadata.get("question", ""), cfg.template.format(hint=hint)
    if question and content.startswith(question):
        content = f"{question}\n\n{block}{content[len(question):]}"
    else:
        content = f"{content}\n\n{block}"
    msgs[last]["content"] = content
    return dataclasses.replace(example, prompt_messages=msgs)


class NudgeRollouts:
    """The :class:`~treejax.rl.rollouts.RolloutSource` of NudgeRL: ``P`` problems per step, each rolled out ``M K``
    times under its hinted / plain prompts (one chain per prompt row, the rollout's ``num_leaves = 1``), scored by
    the verifier; then (``distill``) every completion re-scored under the plain prompt as a second row. Rows:
    ``[problem 0's rollouts, problem 1's, ..., problem 0's distillation rows, ...]``."""

    def __init__(self, base, nudge: NudgeConfig, seed: int, estimator_inputs: tuple[str, ...] = NUDGE_INPUTS):
        from treejax.rl.rollouts import check_inputs

        check_inputs(tuple(estimator_inputs), NUDGE_INPUTS, "NudgeRollouts")
        self.base, self.nudge, self.seed = base, nudge, seed
        self.pipeline = base.pipeline  # the prompt pipeline a checkpoint saves and a resume restores

    def sample(self, params, key, step):
        from treejax.data.prompts import encode_examples, pad_token_lists
        from treejax.rl.rollouts import Rollouts, concat_forests
        from treejax.sampling import probe as probe_lib
        from treejax.sampling.decode import bucket_length, score_tokens

        b, cfg = self.base, self.nudge
        records = next(b.pipeline)
        records = [dict(zip(records, vals)) for vals in zip(*records.values())]
        rng = np.random.default_rng([self.seed, int(step), 0x4E55])
        plain_examples = [b.task.make_example(rec) for rec in records]
        examples, problem, context = [], [], []
        for i, rec in enumerate(records):
            hints = problem_hints(rec, cfg)
            for c in rollout_contexts(rng, cfg):
                examples.append(hinted_example(plain_examples[i], hints[c - 1] if c > 0 else None, cfg))
                problem.append(i)
                context.append(int(c))
        toks = encode_examples(b.tokenizer, examples, b.cfg.system_prompt, b.cfg.instruction)
        width = max(b.prompt_width, bucket_length(max(len(t) for t in toks)))
        prompts, lens = pad_token_lists(toks, width, b.pad_id)
        out = b.roll_and_score(params, examples, prompts, lens, key, step)
        forest, rewards, scores, counters = out.forest, out.rewards, out.scores, out.counters
        R = len(examples)
        problem_PxW, context_PxW = np.array(problem)[:, None], np.array(context)[:, None]
        source_PxW = np.full((R, 1), -1, np.int32)
        forests, all_prompts, all_lens, all_examples = [forest], [prompts], [lens], list(examples)
        if cfg.distill:  # every completion again, under its problem's plain prompt
            plain_ex = [plain_examples[p] for p in problem]
            plain_toks = encode_examples(b.tokenizer, plain_ex, b.cfg.system_prompt, b.cfg.instruction)
            plain, plain_lens = pad_token_lists(plain_toks, width, b.pad_id)
            weights, _ = probe_lib.detach(params)
            logp = score_tokens(weights, b.sampler_fns, plain, plain_lens, forest.tokens[:, 0], forest.leaf_length[:, 0])
            forests.append(forest.replace(logprobs=logp[:, None, :]))
            all_prompts.append(plain)
            all_lens.append(plain_lens)
            all_examples += plain_ex
            problem_PxW = np.concatenate([problem_PxW, problem_PxW])
            context_PxW = np.concatenate([context_PxW, np.full((R, 1), -1, np.int32)])
            source_PxW = np.concatenate([source_PxW, np.arange(R, dtype=np.int32)[:, None]])
            scores, rewards = np.concatenate([scores, scores]), np.concatenate([rewards, rewards])
        return Rollouts(forest=concat_forests(forests), rewards_PxW=jnp.asarray(rewards), scores_PxW=scores,
                        prompts_PxLp=np.concatenate(all_prompts), lengths_P=np.concatenate(all_lens),
                        counters=counters, examples=all_examples,
                        estimator_inputs={"nudge_problem_PxW": jnp.asarray(problem_PxW, jnp.int32),
                                          "nudge_context_PxW": jnp.asarray(context_PxW, jnp.int32),
                                          "nudge_source_PxW": jnp.asarray(source_PxW, jnp.int32)})


__all__ = ["HINT_TEMPLATE", "NudgeConfig", "NudgeRollouts", "hinted_example", "problem_hints", "rollout_contexts"]
