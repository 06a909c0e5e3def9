"""Scores of the live paths at a segment boundary, computed inside the tree rollout (a PRM in the loop).

A branching rule that reads ``PathStats.path_scores_PxW`` (``needs_path_scores``, e.g. ETS) names a
:class:`PathScorer` (``rule.path_scorer``); at every boundary, right after the paths are classified and before
pruning and child counts, the rollout calls ``scorer.score(params, ...)`` on every row (dead rows are masked out)
with the weights that travel with the rollout's params under :data:`SCORER_KEY` (:func:`attach`; the rollout takes
them off again, :func:`detach`, before the policy sees its parameters). Scores depend only on the tokens decoded so
far, so a rule driven by them keeps the tree's path masses exact.

:class:`PRMPathScorer` is the process reward model of :mod:`treejax.scorers.prm` read on the policy's own tokens:
for the row of prompt ``p`` with ``d`` segments of ``S`` tokens decoded, its input is

    prompt_p  seg_1 TAG  seg_2 TAG ... seg_d TAG        (TAG: ``ScorerConfig.step_tag``'s ids)

and its score is ``p(yes) / (p(yes) + p(no))`` of the verdict tokens at the last token of the ``d``-th tag
(:func:`treejax.scorers.judge.verdict_logprobs_at`, one teacher-forced forward of the scorer). Differences from the
host-side PRM (:func:`treejax.scorers.prm.step_scores`): the prompt is the policy's own prompt tokens (its chat
template and question) instead of the scorer's ``step_template``, and the steps are the policy's token ids, not
re-tokenized text, so the scorer must share the policy's tokenizer (:func:`prm_path_scorer` checks it). The pass
re-reads the whole sequence at every boundary (no scorer KV cache): ``D`` forwards of ``R`` rows per rollout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from treejax.errors import ConfigError

SCORER_KEY = "__path_scorer__"


def attach(params: Any, scorer_params: Any) -> Any:
    """``params`` with the path scorer's weights under :data:`SCORER_KEY`."""
    if not isinstance(params, dict):
        raise TypeError(f"path-scorer weights travel inside a params dict, got {type(params).__name__}")
    return {**params, SCORER_KEY: scorer_params}


def detach(params: Any) -> tuple[Any, Any]:
    """``(params without the scorer's weights, the scorer's weights or None)``."""
    if isinstance(params, dict) and SCORER_KEY in params:
        rest = dict(params)
        return rest, rest.pop(SCORER_KEY)
    return params, None


class PathScorer:
    """Scores each row's path after a segment: ``score(params, prompts_PxL, prompt_len_P, tokens_RxT, length_R,
    depth_R, segment_length) -> float32[R]`` (row ``r`` belongs to prompt ``r // W``; live rows hold ``depth``
    full segments). Subclasses are frozen (hashable) dataclasses: static under ``jit``."""

    def score(self, params, prompts_PxL, prompt_len_P, tokens_RxT, length_R, depth_R, segment_length: int):
        raise NotImplementedError


def tagged_rows(prompts_PxL, prompt_len_P, tokens_RxT, depth_R, segment_length: int, tag: tuple[int, ...],
                pad_id: int = 0):
    """``(tokens [R, Lp + D (S + G)], lengths [R], tag_end [R])``: each row's prompt, then its segments each
    followed by the ``G`` tag ids (right-padded), and the position of its last tag's last token."""
    R, T = tokens_RxT.shape
    P, Lp = prompts_PxL.shape
    S, G = segment_length, len(tag)
    D = T // S
    segs = tokens_RxT[:, : D * S].reshape(R, D, S)
    tagged = jnp.concatenate([segs, jnp.broadcast_to(jnp.asarray(tag, jnp.int32), (R, D, G))], -1).reshape(R, -1)
    plen = prompt_len_P[jnp.arange(R) // (R // P)]
    L = Lp + D * (S + G)
    j = jnp.arange(L)[None, :]
    prompt = jnp.take_along_axis(prompts_PxL[jnp.arange(R) // (R // P)], jnp.minimum(j, Lp - 1), axis=1)
    resp = jnp.take_along_axis(tagged, jnp.clip(j - plen[:, None], 0, D * (S + G) - 1), axis=1)
    length = plen + depth_R * (S + G)
    seq = jnp.where(j < plen[:, None], prompt, jnp.where(j < length[:, None], resp, pad_id))
    return seq.astype(jnp.int32), length.astype(jnp.int32), jnp.maximum(length - 1, 0).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PRMPathScorer(PathScorer):
    """The PRM in the loop (module docstring): the scorer's ``model_config``, the step ``tag`` ids and the
    verdict ``yes_ids`` / ``no_ids``."""

    model_config: Any
    tag: tuple[int, ...]
    yes_ids: tuple[int, ...]
    no_ids: tuple[int, ...]
    pad_id: int = 0

    def score(self, params, prompts_PxL, prompt_len_P, tokens_RxT, length_R, depth_R, segment_length: int):
        from treejax.scorers.judge import verdict_logprobs_at

        seq, length, end = tagged_rows(prompts_PxL, prompt_len_P, tokens_RxT, depth_R, segment_length, self.tag,
                                       self.pad_id)
        ly, ln = verdict_logprobs_at(params, seq, length, end[:, None], model_config=self.model_config,
                                     yes_ids=self.yes_ids, no_ids=self.no_ids)
        return jax.nn.sigmoid(ly - ln)[:, 0]


def prm_path_scorer(scorer, policy_tokenizer) -> PRMPathScorer:
    """The :class:`PRMPathScorer` of a loaded :class:`~treejax.scorers.model.Scorer`, which must share the
    policy's tokenizer (it reads the policy's token ids)."""
    probe = "Step 1: 12 + 30 = 42.\nThe answer is 42."
    if (getattr(scorer.tokenizer, "vocab_size", None) != getattr(policy_tokenizer, "vocab_size", None)
            or list(scorer.tokenizer.encode(probe)) != list(policy_tokenizer.encode(probe))):
        raise ConfigError(f"the in-loop PRM reads the policy's token ids, but scorer {scorer.config.model!r} has "
                          "another tokenizer; fix: ScorerConfig.model = 'policy' (or a scorer of the policy's family)")
    tag = tuple(int(t) for t in scorer.tokenizer.encode(scorer.config.step_tag))
    if not tag:
        raise ConfigError("ScorerConfig.step_tag encodes to no tokens; fix: e.g. '\\nIs this step correct? Answer:'")
    return PRMPathScorer(scorer.model_config, tag, scorer.yes_ids, scorer.no_ids, scorer.pad_id)


def bind_rule(tc, scorer, policy_tokenizer):
    """``(tree config, scorer weights)``: ``tc`` with its rule's ``prm`` built from the loaded ``scorer`` (for a
    rule that reads path scores; ``tc`` unchanged and ``None`` otherwise)."""
    rule = tc.rule
    if not rule.needs_path_scores:
        return tc, None
    rule = dataclasses.replace(rule, prm=prm_path_scorer(scorer, policy_tokenizer))
    return dataclasses.replace(tc, branching=rule), scorer.params


def with_scorer(rollout, scorer_params):
    """``rollout`` with the scorer's weights attached to every call's params (same attributes)."""
    if scorer_params is None:
        return rollout

    def scored(params, *args, **kwargs):
        return rollout(attach(params, scorer_params), *args, **kwargs)

    for name in ("core", "tree_config", "model_fns", "continuations"):
        setattr(scored, name, getattr(rollout, name))
    return scored
