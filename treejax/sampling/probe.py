"""How a stateful shaper's probe reaches the tree sampler: inside the sampler's weights, under one reserved key.

The loop hands the rollout source the sampler's copy of the weights each step (``source.sample(params, key,
step)``, also across the asynchronous sampler thread). A probe (:meth:`treejax.rl.shaping.Shaper.probe`, e.g. the
quality head ARRoL's pruning rule reads) travels with that copy, so it is always the one trained up to the
version that samples: :func:`attach` adds ``{shaper name: probe}`` under :data:`PROBE_KEY`, and the tree rollout
takes it off again (:func:`detach`) before the model sees its parameters.
"""

from __future__ import annotations

from typing import Any

PROBE_KEY = "__probes__"


def attach(params: Any, probes: dict | None) -> Any:
    """``params`` with ``probes`` (``{name: pytree}``) under :data:`PROBE_KEY` (unchanged when there are none)."""
    if not probes:
        return params
    if not isinstance(params, dict):
        raise TypeError(f"probes travel inside a params dict, got {type(params).__name__}")
    return {**params, PROBE_KEY: dict(probes)}


def detach(params: Any) -> tuple[Any, dict]:
    """``(params without probes, {name: probe})``."""
    if isinstance(params, dict) and PROBE_KEY in params:
        rest = dict(params)
        return rest, rest.pop(PROBE_KEY)
    return params, {}
