"""Loading a scorer model through the policy's own loader (:func:`treejax.models.registry.load_model`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from treejax.scorers.config import ScorerConfig
from treejax.scorers.verdicts import verdict_ids


@dataclasses.dataclass(frozen=True, eq=False)
class Scorer:
    """A loaded scorer: its settings, model config, weights (never trained: a frozen pytree), tokenizer, the ids
    of its verdict tokens, and the mesh its weights are laid out on (``None``: one device)."""

    config: ScorerConfig
    model_config: Any
    params: Any
    tokenizer: Any
    yes_ids: tuple[int, ...]
    no_ids: tuple[int, ...]
    mesh: Any = None

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0

    def place_rows(self, *arrays):
        """The arrays of one forward (leading axis: rows) on the scorer's mesh, rows over its batch axes where they
        divide (:func:`treejax.parallel.mesh.batch_sharding`); as they are without a mesh."""
        if self.mesh is None:
            return arrays
        from treejax.parallel.mesh import batch_placer
        return tuple(batch_placer(self.mesh)(list(arrays)))


def resolve_model(config: ScorerConfig, policy_model: str | None) -> str:
    """The model name or path to load: ``config.model``, or the policy's (``RunConfig.model``) for ``"policy"``."""
    if config.model != "policy":
        return config.model
    if not policy_model:
        raise ValueError("ScorerConfig.model = 'policy' needs the policy's model (RunConfig.model); pass "
                         "policy_model=")
    return policy_model


def from_params(config: ScorerConfig, model_config, params, tokenizer, mesh=None) -> Scorer:
    """A :class:`Scorer` of weights already in memory (tests; a caller's own model), laid out on ``mesh`` when
    ``config.sharding`` is ``"mesh"`` (:func:`place_params`)."""
    if config.sharding == "mesh":
        params = place_params(params, model_config, mesh)
    return Scorer(config, model_config, params, tokenizer, verdict_ids(tokenizer, config.yes_tokens),
                  verdict_ids(tokenizer, config.no_tokens), mesh if config.sharding == "mesh" else None)


def place_params(params, model_config, mesh):
    """``params`` laid out over ``mesh`` like the policy's weights: each leaf's logical axes
    (:func:`treejax.models.transformer.param_logical_axes`) through the default rules
    (:data:`treejax.parallel.axis_rules.DEFAULT_RULES`), mesh axes that do not divide a dimension dropped."""
    import jax

    from treejax.models.transformer import param_logical_axes
    from treejax.parallel.mesh import logical_to_sharding

    if mesh is None:
        raise ValueError("ScorerConfig.sharding = 'mesh' needs the run's mesh (load_scorer(..., mesh=)); a judge "
                         "stage passes its run's learner mesh")
    return jax.device_put(params, logical_to_sharding(param_logical_axes(model_config), mesh, shapes=params))


def load_scorer(config: ScorerConfig, policy_model: str | None = None, mesh=None) -> Scorer:
    """Loads ``config.model`` (``"policy"``: ``policy_model`` again, i.e. the policy's initial weights) with
    ``config.compute_dtype`` weights and compute, and checks its verdict tokens against its tokenizer; with
    ``config.sharding = "mesh"`` its weights are laid out over ``mesh`` (:func:`place_params`)."""
    from treejax.models.registry import load_model

    name = resolve_model(config, policy_model)
    model_config, params, tokenizer = load_model(name, param_dtype=config.compute_dtype,
                                                 compute_dtype=config.compute_dtype)
    return from_params(config, model_config, params, tokenizer, mesh)
