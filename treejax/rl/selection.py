"""Difficulty-targeted online prompt selection (DOTS, arXiv 2506.05316): train on the prompts the current policy
solves about half the time.

A prompt's *adaptive difficulty* is ``d_q = 1 - a_q``, ``a_q`` its success rate under the current policy (here the
leaf-weighted accuracy of its ``W`` rollouts). Measuring it needs rollouts, so DOTS measures only a small
*reference set* each step and predicts the rest by attention over prompt embeddings:

    d_hat_q = sum_i softmax_i(cos(e_q, e_{r_i}) / tau) d_{r_i}

and selects the candidates whose (predicted) difficulty is closest to ``target`` (0.5: the group-relative
advantage's signal ``a (1 - a)`` is largest there).

:class:`DOTSRollouts` wraps the loop's source. Each step it draws ``pool`` pipeline batches (``pool x P``
candidate prompts), rolls out the first ``reference`` of them (the pipeline is shuffled: a random reference set,
fresh every step), predicts the others' difficulty from them, rolls out the ``P - reference`` candidates closest
to ``target`` and trains on all ``P`` rows (the reference rows are real rollouts of the current policy too).
A candidate measured before uses its own last measured difficulty instead of the prediction (``history``).

Choices where the paper's setting cannot run here: the embeddings are hashed character 3-gram counts of the
question text (``dim`` buckets, L2-normalised; offline and model-free; the paper embeds with a pretrained encoder
and calibrates the attention), and the reference set is drawn from the step's own candidates instead of being a
fixed set. The candidates not selected are skipped (an epoch of the data passes ``pool`` times faster).

Metrics: ``dots/reference_difficulty`` (mean over the reference rows), ``dots/predicted_difficulty`` and
``dots/measured_difficulty`` (the selected rows, before and after their rollouts), ``dots/abs_error`` (mean
``|predicted - measured|`` of the selected rows), ``dots/from_history`` (selected rows whose difficulty came from
their history). The history is saved in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import ClassVar

import jax
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl.sources.requirements import TRAIN_SPLIT, VERIFIER


@dataclasses.dataclass(frozen=True)
class DOTSConfig(Stage):
    """DOTS's selection (module docstring): ``pool`` candidate batches per step, ``reference`` reference rows,
    the attention's ``temperature``, the ``target`` difficulty, the embedding's ``dim`` and whether measured
    difficulties are remembered (``history``)."""

    pool: int = 4
    reference: int = 2
    temperature: float = 0.1
    target: float = 0.5
    dim: int = 1024
    history: bool = True

    def __post_init__(self):
        if self.pool < 1 or self.reference < 1 or self.temperature <= 0 or not 0 <= self.target <= 1 or self.dim < 8:
            raise ConfigError(f"DOTSConfig: pool >= 1, reference >= 1, temperature > 0, 0 <= target <= 1 and "
                              f"dim >= 8 required, got {self}")

    role: ClassVar[str] = "planner"  # it draws a pool and rolls out the prompts it selects
    requires: ClassVar[tuple] = (VERIFIER, TRAIN_SPLIT)
    provides: ClassVar[frozenset[str]] = frozenset({"replayable_rows"})
    supplies: ClassVar[frozenset[str]] = frozenset({"answer_step_PxW", "cut_PxWxB", "cut_value_PxWxB"})

    def check(self, facts) -> None:
        if self.reference >= facts.prompts_per_step:
            raise ConfigError(f"DOTSConfig.reference = {self.reference} leaves no selected row of prompts_per_step = "
                              f"{facts.prompts_per_step}; fix: DOTSConfig.reference < RunConfig.prompts_per_step")

    def build(self, inner, ctx):
        base = ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i in self.supplies))
        return self.make_source(base, ctx.cfg.prompts_per_step, ctx.seed)

    def make_source(self, base, prompts_per_step: int, seed: int = 0):
        """This selection's source around the task's rollout service ``base``."""
        return DOTSRollouts(base, self, prompts_per_step)


def ngram_embeddings(texts: list[str], dim: int) -> np.ndarray:
    """float[n, dim]: hashed character 3-gram counts of each text, L2-normalised (zeros for an empty text)."""
    out = np.zeros((len(texts), dim), np.float64)
    for i, t in enumerate(texts):
        t = f"  {t}  "
        for j in range(len(t) - 2):
            out[i, zlib.crc32(t[j:j + 3].encode()) % dim] += 1.0
    norm = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norm, 1e-12)


def predict_difficulty(e_query: np.ndarray, e_ref: np.ndarray, d_ref: np.ndarray, temperature: float) -> np.ndarray:
    """``d_hat_q = sum_i softmax_i(cos(e_q, e_ri) / tau) d_ri`` (rows of ``e_*`` are unit vectors)."""
    logits = e_query @ e_ref.T / temperature
    logits -= logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(axis=1, keepdims=True)
    return w @ np.asarray(d_ref, np.float64)


def select(predicted: np.ndarray, count: int, target: float) -> np.ndarray:
    """The ``count`` indices whose difficulty is closest to ``target`` (ties: the earlier index), in index order."""
    order = np.lexsort((np.arange(len(predicted)), np.abs(np.asarray(predicted) - target)))
    return np.sort(order[:count])


class DOTSRollouts:
    """The loop's source with DOTS's prompt selection (module docstring). ``base``: :class:`TaskRollouts`."""

    def __init__(self, base, config: DOTSConfig, prompts_per_step: int):
        if config.reference >= prompts_per_step:
            raise ConfigError(f"DOTSConfig.reference = {config.reference} leaves no selected row of "
                              f"prompts_per_step = {prompts_per_step}; fix: DOTSConfig.reference < prompts_per_step")
        self.base, self.config, self.P = base, config, prompts_per_step
        self.pipeline = base.pipeline
        self.estimator_inputs = base.estimator_inputs
        self.difficulty: dict[str, float] = {}  # prompt key -> last measured difficulty

    def sample(self, params, key, step):
        from treejax.rl import allocation as alloc
        from treejax.rl.allocation.base import prompt_stats
        from treejax.rl.rollouts import assemble_rows, row_block

        cfg, b, R = self.config, self.base, self.config.reference
        drawn = [b.draw() for _ in range(cfg.pool)]
        examples = [e for d in drawn for e in d[0]]
        prompts = np.concatenate([d[1] for d in drawn])
        lens = np.concatenate([d[2] for d in drawn])
        keys = [alloc.prompt_key(e) for e in examples]

        def roll(idx, k):
            out = b.roll_and_score(params, [examples[i] for i in idx], prompts[idx], lens[idx], k, step)
            return out, 1.0 - prompt_stats(out, step).accuracy_P

        ref_idx = np.arange(R)
        ref, d_ref = roll(ref_idx, jax.random.fold_in(key, 0))
        rest = np.arange(R, len(examples))
        emb = ngram_embeddings([alloc.example_text(e) for e in examples], cfg.dim)
        pred = predict_difficulty(emb[rest], emb[ref_idx], d_ref, cfg.temperature)
        known = np.array([cfg.history and keys[i] in self.difficulty for i in rest])
        pred = np.where(known, [self.difficulty.get(keys[i], 0.0) for i in rest], pred)
        pick = select(pred, self.P - R, cfg.target)
        sel, d_sel = roll(rest[pick], jax.random.fold_in(key, 1))
        for i, d in zip(np.concatenate([ref_idx, rest[pick]]), np.concatenate([d_ref, d_sel])):
            self.difficulty[keys[i]] = float(d)
        blocks = [row_block(ref, np.arange(R)), row_block(sel, np.arange(self.P - R))]
        return assemble_rows(blocks, dataclasses.replace(ref.counters + sel.counters, rollout_calls=2), extra_metrics={
            "dots/reference_difficulty": float(np.mean(d_ref)),
            "dots/predicted_difficulty": float(np.mean(pred[pick])),
            "dots/measured_difficulty": float(np.mean(d_sel)),
            "dots/abs_error": float(np.mean(np.abs(pred[pick] - d_sel))),
            "dots/from_history": int(known[pick].sum())})

    def checkpoint_state(self) -> dict:
        return {**self.base.checkpoint_state(), "dots": dict(self.difficulty)}

    def restore_state(self, data_state: dict) -> None:
        self.base.restore_state(data_state)
        self.difficulty = dict(data_state.get("dots", {}))


__all__ = ["DOTSConfig", "DOTSRollouts", "ngram_embeddings", "predict_difficulty", "select"]
