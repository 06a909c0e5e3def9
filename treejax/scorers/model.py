"""Loading a scorer model through the policy's own loader (:func:`treejax.models.registry.load_model`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from treejax.scorers.config import ScorerConfig
from treejax.scorers.verdicts import verdict_ids


@dataclasses.dataclass(frozen=True, eq=False)
class Scorer:
    """A loaded scorer: its settings, model config, weights (never trained: a frozen pytree), tokenizer and the ids
    of its verdict tokens."""

    config: ScorerConfig
    model_config: Any
    params: Any
    tokenizer: Any
    yes_ids: tuple[int, ...]
    no_ids: tuple[int, ...]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0


def resolve_model(config: ScorerConfig, policy_model: str | None) -> str:
    """The model name or path to load: ``config.model``, or the policy's (``RunConfig.model``) for ``"policy"``."""
    if config.model != "policy":
        return config.model
    if not policy_model:
        raise ValueError("ScorerConfig.model = 'policy' needs the policy's model (RunConfig.model); pass "
                         "policy_model=")
    return policy_model


def from_params(config: ScorerConfig, model_config, params, tokenizer) -> Scorer:
    """A :class:`Scorer` of weights already in memory (tests; a caller's own model)."""
    return Scorer(config, model_config, params, tokenizer, verdict_ids(tokenizer, config.yes_tokens),
                  verdict_ids(tokenizer, config.no_tokens))


def load_scorer(config: ScorerConfig, policy_model: str | None = None) -> Scorer:
    """Loads ``config.model`` (``"policy"``: ``policy_model`` again, i.e. the policy's initial weights) with
    ``config.compute_dtype`` weights and compute, and checks its verdict tokens against its tokenizer."""
    from treejax.models.registry import load_model

    name = resolve_model(config, policy_model)
    model_config, params, tokenizer = load_model(name, param_dtype=config.compute_dtype,
                                                 compute_dtype=config.compute_dtype)
    return from_params(config, model_config, params, tokenizer)
