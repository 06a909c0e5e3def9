"""The one logical-axis rules table: logical array-axis names -> mesh axes (MaxText's idea at nanodo's size).

Mesh axes (``treejax.parallel.mesh``): ``data`` (pure data parallel: params replicated), ``fsdp`` (data parallel
with params, grads and optimizer state sharded along ``embed``: ZeRO-3 style, gathered per layer by XLA) and
``tensor`` (Megatron tensor parallel: heads, MLP columns and vocabulary split).

Logical names used by the model (``transformer.param_logical_axes``, ``transformer.ACTIVATION_AXES``) and the
sampler's KV cache. A rule maps one logical name to a mesh axis, a tuple of mesh axes, or ``None``
(replicated). When an array would use a mesh axis twice, or a dimension is not divisible by the mesh axes' total
size, :func:`logical_to_spec` drops the offending mesh axes for that dimension (replicates it) instead of failing.
"""

from __future__ import annotations

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # activations / batches
    ("batch", ("data", "fsdp")),
    ("length", None),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    # sampler KV cache [layers, cache_batch, cache_length, cache_kv_heads, cache_head_dim]
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    ("cache_heads", "tensor"),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
)


#: The sampler's weight copy: like :data:`DEFAULT_RULES` but not split over ``fsdp``. A decode step is a few small
#: matmuls per layer; ZeRO-3 weights would be all-gathered at every one of the rollout's thousands of steps, so the
#: sampler's (16-bit) copy is gathered once per RL step instead, when it is cast (``treejax.rl.step``), and stays
#: split over ``tensor`` only.
SAMPLER_RULES: Rules = tuple((name, None) if name == "embed" else (name, axes) for name, axes in DEFAULT_RULES)


def rules_dict(rules: Rules = DEFAULT_RULES) -> dict[str, tuple[str, ...]]:
    """``{logical: (mesh axes...)}``; raises ``ValueError`` on a duplicated logical name."""
    out: dict[str, tuple[str, ...]] = {}
    for logical, mesh_axes in rules:
        if logical in out:
            raise ValueError(f"logical axis {logical!r} appears twice in the rules table")
        if mesh_axes is None:
            out[logical] = ()
        elif isinstance(mesh_axes, str):
            out[logical] = (mesh_axes,)
        else:
            out[logical] = tuple(mesh_axes)
    return out
