"""The rollout-source fields of ``RunConfig`` before the chain (``RunConfig.replay = @ReplayConfig()``, ...), kept
for one release as deprecated aliases: :func:`legacy_chain` translates them into ``RunConfig.rollouts`` in the order
the old set-up composed them, with a :class:`DeprecatedFieldWarning` that names the new spelling."""

from __future__ import annotations

import dataclasses
import warnings

from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage

#: Old field -> the stage classes it took, in the order the old set-up wrapped them (planners, then wrappers).
LEGACY_FIELDS = {"nudge": ("NudgeConfig",), "allocation": ("AllocationConfig",),
                 "selection": ("DOTSConfig", "PromptGDROConfig"), "exemplars": ("ExemplarConfig",),
                 "multiturn": ("MultiTurnConfig",), "partial": ("PartialConfig",),
                 "shape_search": ("ShapeSearchConfig",), "replay": ("ReplayConfig",), "spear": ("SpearConfig",)}


class DeprecatedFieldWarning(FutureWarning):
    """An old ``RunConfig`` rollout-source field was set (shown by default, unlike ``DeprecationWarning``)."""


@dataclasses.dataclass(frozen=True)
class LegacySourceFields:
    """The old fields (``None``: unset). Deprecated: use ``RunConfig.rollouts``."""

    nudge: Stage | None = None
    allocation: Stage | None = None
    selection: Stage | None = None
    exemplars: Stage | None = None
    multiturn: Stage | None = None
    partial: Stage | None = None
    shape_search: Stage | None = None
    replay: Stage | None = None
    spear: Stage | None = None


def legacy_chain(cfg) -> tuple[Stage, ...]:
    """The stages the old fields of ``cfg`` set, in the old order; warns once per field set."""
    chain = []
    for name, classes in LEGACY_FIELDS.items():
        stage = getattr(cfg, name)
        if stage is None:
            continue
        if type(stage).__name__ not in classes:
            raise ConfigError(f"RunConfig.{name} = {stage!r}: takes {' or '.join(classes)}; better: "
                              f"RunConfig.rollouts = [@{classes[0]}()]")
        chain.append(stage)
    if chain:
        new = ", ".join(f"@{type(s).__name__}()" for s in chain)
        old = ", ".join(f"RunConfig.{n}" for n in LEGACY_FIELDS if getattr(cfg, n) is not None)
        warnings.warn(f"{old}: deprecated, removed in the next release; write RunConfig.rollouts = [{new}]",
                      DeprecatedFieldWarning, stacklevel=5)
    return tuple(chain)


def apply_legacy_fields(cfg) -> None:
    """Moves the old fields of a ``RunConfig`` being built into ``cfg.rollouts`` (and unsets them), so that
    ``dataclasses.replace`` of the result sees only the chain."""
    legacy = legacy_chain(cfg)
    if not legacy:
        return
    if cfg.rollouts:
        raise ConfigError("RunConfig.rollouts and deprecated per-method fields ("
                          + ", ".join(f"RunConfig.{n}" for n in LEGACY_FIELDS if getattr(cfg, n) is not None)
                          + ") are both set; fix: only RunConfig.rollouts")
    for name in LEGACY_FIELDS:
        object.__setattr__(cfg, name, None)
    object.__setattr__(cfg, "rollouts", legacy)
