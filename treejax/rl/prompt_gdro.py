"""Prompt-GDRO (arXiv 2601.19280, §3.2; code ``kishanpb/verl-gdro`` ``group_dro_grpo.py``): sample prompts by
pass-rate bucket with EMA-debiased multiplicative weights, so persistently hard buckets get more of the batch.

Buckets. A prompt's bucket is its online pass rate: the mean of its recent pass@k indicators (``c = 1`` when any
of its ``W`` rollouts in a step was correct; a sliding window of the last ``history`` times it was drawn), binned
by ``edges`` (the code's pass@k bins; the same edges as :class:`~treejax.rl.allocation.RolloutGDRO`). A prompt
never drawn before is in its own bucket, ``unseen`` (the code puts it at pass rate 0, the hardest bin; here the
unseen prompts' loss is learned separately, so early in a run the hardest bin is not just "new prompts").

Weights (Group-DRO's exponentiated gradient over groups, EXP3-style): each bucket ``b`` has a score ``s_b``, the
exponential moving average (``ema``, the code's ``ema_beta = 0.1``; initialised with the first value, so it is
not biased towards 0 — the code's "debiased" EMA) of its mean loss over the steps it was sampled in. The loss of a
prompt is ``1 - a``, ``a`` its rollouts' accuracy (the worst-group objective reads the groups' failure rates).
Over the buckets present among the step's candidates,

    q_b = (1 - gamma) exp(eta s_b) / sum_j exp(eta s_j) + gamma / B

(``gamma``: uniform exploration, the code's 0.15). :class:`PromptGDRORollouts` draws ``pool`` pipeline batches as
candidates and picks ``P`` of them without replacement, candidate ``i`` with probability proportional to
``q_{b(i)} / n_{b(i)}`` (``n_b``: candidates in bucket ``b``; a bucket is drawn with probability ``q_b``, a
prompt uniformly inside it; Gumbel top-``P`` sampling). The code multiplies each sample's loss by ``q_b``
instead; the paper describes a sampler, which is what this is (reweighting as well would count ``q`` twice).
``eta`` default 1.0 (the code's 0.1 with z-scored scores; here the scores are failure rates in [0, 1]).

Metrics: ``prompt_gdro/q_<bucket>`` (the step's weights), ``prompt_gdro/picked_<bucket>`` (prompts picked per
bucket), ``prompt_gdro/loss_<bucket>`` (the score after the step). The histories and scores are saved in the
checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import TRAIN_SPLIT, VERIFIER

PROMPT_GDRO_STREAM = 0x6D40  # the sampler's random stream (with the run's seed and the step)


@dataclasses.dataclass(frozen=True)
class PromptGDROConfig(Stage):
    """Prompt-GDRO's bucket sampler (module docstring): ``pool`` candidate batches per step, the pass-rate
    ``edges``, the pass@k window ``history``, the score EMA ``ema``, the weights' ``eta`` and exploration
    ``gamma``."""

    pool: int = 4
    edges: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 0.9)
    history: int = 50
    ema: float = 0.1
    eta: float = 1.0
    gamma: float = 0.15

    def __post_init__(self):
        e = tuple(self.edges)
        object.__setattr__(self, "edges", e)
        if any(not 0.0 < x < 1.0 for x in e) or list(e) != sorted(set(e)):
            raise ConfigError(f"PromptGDROConfig.edges must rise strictly inside (0, 1), got {e}")
        if self.pool < 1 or self.history < 1 or not 0.0 < self.ema <= 1.0 or not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"PromptGDROConfig: pool >= 1, history >= 1, 0 < ema <= 1 and 0 <= gamma <= 1 "
                              f"required, got {self}")

    @property
    def bucket_names(self) -> list[str]:
        """The bins' names (``"0.1-0.2"``...) and ``"unseen"``."""
        lo = (0.0,) + self.edges
        hi = self.edges + (1.0,)
        return [f"{a:g}-{b:g}" for a, b in zip(lo, hi)] + ["unseen"]

    role: ClassVar[str] = "planner"  # it draws a pool and rolls out the prompts it picks
    requires: ClassVar[tuple] = (VERIFIER, TRAIN_SPLIT)
    provides: ClassVar[frozenset[str]] = frozenset({"replayable_rows"})
    supplies: ClassVar[frozenset[str]] = frozenset({"answer_step_PxW", "cut_PxWxB", "cut_value_PxWxB"})

    def build(self, inner, ctx):
        base = ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i in self.supplies))
        return self.make_source(base, ctx.cfg.prompts_per_step, ctx.seed)

    def make_source(self, base, prompts_per_step: int, seed: int):
        return PromptGDRORollouts(base, self, prompts_per_step, seed)


def bucket_of(passes: list[float] | None, edges: tuple[float, ...]) -> int:
    """The bucket of a prompt with pass@k history ``passes`` (``None`` or empty: the unseen bucket, ``len(edges)
    + 1``)."""
    if not passes:
        return len(edges) + 1
    return int(np.searchsorted(np.asarray(edges), float(np.mean(passes)), side="right"))


def bucket_weights(scores: dict, present: list[int], eta: float, gamma: float) -> dict[int, float]:
    """``q_b`` over the ``present`` buckets (module docstring); a bucket without a score yet scores 0."""
    s = np.array([float(scores.get(str(b), 0.0)) for b in present])
    e = np.exp(eta * (s - s.max()))
    soft = e / e.sum()
    return {b: float((1.0 - gamma) * w + gamma / len(present)) for b, w in zip(present, soft)}


def pick(buckets: np.ndarray, q: dict[int, float], count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` candidate indices without replacement, candidate ``i`` weighted ``q_{b_i} / n_{b_i}`` (Gumbel
    top-k: the same law as drawing one at a time with the weights renormalised), in index order."""
    counts = {b: int(np.sum(buckets == b)) for b in set(buckets.tolist())}
    w = np.array([q[b] / counts[b] for b in buckets.tolist()])
    keys = np.log(w) + rng.gumbel(size=len(w))
    return np.sort(np.argsort(-keys, kind="stable")[:count])


class PromptGDRORollouts:
    """The loop's source with Prompt-GDRO's bucket sampler (module docstring). ``base``: :class:`TaskRollouts`."""

    def __init__(self, base, config: PromptGDROConfig, prompts_per_step: int, seed: int = 0):
        self.base, self.config, self.P, self.seed = base, config, prompts_per_step, seed
        self.pipeline = base.pipeline
        self.estimator_inputs = base.estimator_inputs
        self.passes: dict[str, list[float]] = {}  # prompt key -> recent pass@k indicators
        self.scores: dict[str, float] = {}  # bucket -> EMA of its mean loss (JSON keys)

    def sample(self, params, key, step):
        from treejax.rl import allocation as alloc
        from treejax.rl.allocation.base import prompt_stats
        from treejax.rl.rollouts import assemble_rows, row_block

        cfg, b = self.config, self.base
        drawn = [b.draw() for _ in range(cfg.pool)]
        examples = [e for d in drawn for e in d[0]]
        prompts = np.concatenate([d[1] for d in drawn])
        lens = np.concatenate([d[2] for d in drawn])
        keys = [alloc.prompt_key(e) for e in examples]
        buckets = np.array([bucket_of(self.passes.get(k), cfg.edges) for k in keys])
        present = sorted(set(buckets.tolist()))
        q = bucket_weights(self.scores, present, cfg.eta, cfg.gamma)
        rng = np.random.default_rng([self.seed, step, PROMPT_GDRO_STREAM])
        idx = pick(buckets, q, self.P, rng)
        out = b.roll_and_score(params, [examples[i] for i in idx], prompts[idx], lens[idx], key, step)
        acc = prompt_stats(out, step).accuracy_P
        for j, i in enumerate(idx):
            self.passes[keys[i]] = (self.passes.get(keys[i], []) + [1.0 if acc[j] > 0 else 0.0])[-cfg.history:]
        names = cfg.bucket_names
        metrics = {f"prompt_gdro/q_{names[bk]}": w for bk, w in q.items()}
        for bk in sorted(set(buckets[idx].tolist())):
            loss = float(np.mean(1.0 - acc[buckets[idx] == bk]))
            old = self.scores.get(str(bk))
            self.scores[str(bk)] = loss if old is None else (1.0 - cfg.ema) * old + cfg.ema * loss
            metrics[f"prompt_gdro/picked_{names[bk]}"] = int(np.sum(buckets[idx] == bk))
        metrics.update({f"prompt_gdro/loss_{names[int(k)]}": v for k, v in self.scores.items()})
        return assemble_rows([row_block(out, np.arange(self.P))], out.counters, extra_metrics=metrics)

    def checkpoint_state(self) -> dict:
        return {**self.base.checkpoint_state(),
                "prompt_gdro": {"passes": {k: list(v) for k, v in self.passes.items()}, "scores": dict(self.scores)}}

    def restore_state(self, data_state: dict) -> None:
        self.base.restore_state(data_state)
        state = data_state.get("prompt_gdro", {})
        self.passes = {k: list(v) for k, v in state.get("passes", {}).items()}
        self.scores = dict(state.get("scores", {}))


__all__ = ["PromptGDROConfig", "PromptGDRORollouts", "bucket_of", "bucket_weights", "pick"]
