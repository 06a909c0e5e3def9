"""Device mesh from config, logical axes -> shardings, sharded init, the sharded jitted update (multi-process
start-up: :mod:`treejax.parallel.multihost`).

Axis types: ``jax.make_mesh`` defaults to *Explicit* axes in current JAX, where sharding is part of the array
type and a contraction over a sharded dimension is a type error unless every op states its output sharding.
treejax's model code is written for GSPMD-style propagation (shard the inputs/params via the rules table and
let XLA insert the collectives), so meshes are built with ``AxisType.Auto`` on every axis, deliberately.

Standard sharded init (big_vision / MaxText): ``jax.eval_shape(init)`` gives the abstract state without
allocating; shardings come from the logical axes; ``jax.jit(init, out_shardings=...)`` materialises each shard
directly on its device. The update is jitted with the same shardings in and out, and the state is donated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from treejax.errors import ConfigError
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules, rules_dict
from treejax.parallel.multihost import maybe_initialize_distributed  # noqa: F401 (re-exported)

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; one entry may be ``-1`` (takes all remaining devices). Default: everything on ``fsdp``."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        dims = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, d in dims.items():
            if isinstance(d, bool) or not isinstance(d, int) or d == 0 or d < -1:
                raise ConfigError(f"MeshConfig.{name}={d!r}: an axis size must be a positive int or -1 (all the "
                                  f"devices the other axes leave); fix: MeshConfig.{name} = 1")
        if sum(d == -1 for d in dims.values()) > 1:
            raise ConfigError(f"{self}: at most one axis may be -1; fix: MeshConfig."
                              f"{[n for n, d in dims.items() if d == -1][1]} = 1")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """``(data, fsdp, tensor)`` over ``num_devices`` devices; a :class:`~treejax.errors.ConfigError` of one
        line (with the fix) when the shape does not fit them."""
        dims = [self.data, self.fsdp, self.tensor]
        known = math.prod(d for d in dims if d != -1)
        if -1 in dims:
            if num_devices % known:
                raise ConfigError(f"{self} does not fit {num_devices} device(s): {num_devices} is not divisible "
                                  f"by {known} (the product of the fixed axes); fix: choose axis sizes whose "
                                  f"product divides {num_devices}, e.g. MeshConfig.data = 1, MeshConfig.tensor = 1")
            dims[dims.index(-1)] = num_devices // known
        if math.prod(dims) != num_devices:
            raise ConfigError(f"{self} needs {math.prod(dims)} devices (data x fsdp x tensor), {num_devices} "
                              f"available; fix: make the product {num_devices}, or set one axis to -1 (e.g. "
                              f"MeshConfig.fsdp = -1 with the others dividing {num_devices})")
        return tuple(dims)


def make_mesh(config: MeshConfig = MeshConfig(), devices: list | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types over ``devices`` (default: all devices)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = config.shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_context(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` on a multi-device mesh, a no-op context otherwise. The training loop traces its
    programs inside it, so model code that must name mesh axes (operands of kernels GSPMD cannot partition, or
    whose partitioner needs one layout) reads them from ``jax.sharding.get_abstract_mesh()``."""
    return jax.set_mesh(mesh) if mesh is not None and mesh.size > 1 else contextlib.nullcontext()


def rows_and_heads(mesh, batch: int, num_heads: int, num_kv_heads: int, rules: Rules = DEFAULT_RULES,
                   row_axis: str = "batch", head_axis: str = "heads") -> tuple:
    """Mesh axes ``(rows, heads)`` of an attention's operands (each ``None``, a name or a tuple of names): rows by
    the logical ``row_axis``, heads by ``head_axis`` where those mesh axes divide both the query and the KV head
    counts (GQA groups stay whole: contiguous blocks of ``Q = K G`` query heads line up with blocks of ``K``).
    ``mesh`` may be abstract (``jax.sharding.get_abstract_mesh()``)."""
    rows = logical_to_spec((row_axis,), mesh, rules, (batch,))[0]
    heads = logical_to_spec((head_axis,), mesh, rules, (math.gcd(num_heads, num_kv_heads),))[0]
    return rows, heads


def batch_placer(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Callable[[Any], Any]:
    """``place(batch)``: ``jax.device_put`` of a batch pytree with :func:`batch_sharding` (rows over the batch axes)."""
    return lambda batch: jax.device_put(batch, batch_sharding(mesh, batch, rules))


def logical_to_spec(logical_axes: tuple, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                    shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """Maps one array's logical axis names to a ``PartitionSpec`` (unknown names raise ``KeyError``).

    Mesh axes already used by an earlier dimension, of size 1, or (when ``shape`` is given) not dividing the
    dimension are dropped, so the result is always valid for the array.
    """
    table = rules_dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = []
        for ax in table[name]:
            if ax in used or ax not in mesh.shape or mesh.shape[ax] == 1:
                continue
            size = math.prod(mesh.shape[a] for a in axes) * mesh.shape[ax]
            if shape is not None and shape[i] % size:
                continue
            axes.append(ax)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def with_logical_constraint(x: jax.Array, logical_axes: tuple, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` of ``x`` to its logical axes (spec from :func:`logical_to_spec` with
    ``x``'s shape, so non-dividing mesh axes are dropped). For use inside ``jax.jit``."""
    spec = logical_to_spec(tuple(logical_axes), mesh, rules, tuple(x.shape))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def logical_to_sharding(logical_axes: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, shapes: Any = None) -> Any:
    """Pytree of logical-axis tuples (optionally with a matching pytree of arrays/ShapeDtypeStructs giving the
    shapes) -> pytree of ``NamedSharding``."""
    if shapes is None:
        return jax.tree.map(lambda ax: NamedSharding(mesh, logical_to_spec(ax, mesh, rules)), logical_axes,
                            is_leaf=_is_axes)
    return jax.tree.map(lambda ax, s: NamedSharding(mesh, logical_to_spec(ax, mesh, rules, tuple(s.shape))),
                        logical_axes, shapes, is_leaf=_is_axes)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, batch: Any, rules: Rules = DEFAULT_RULES) -> Any:
    """Shards every batch array along its leading ``batch`` axis (other axes replicated)."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (len(x.shape) - 1), mesh, rules,
                                                      tuple(x.shape))), batch)


def train_state_shardings(abstract_state: Any, param_shardings: Any, optimizer: optax.GradientTransformation,
                          mesh: Mesh) -> Any:
    """Shardings for a ``TrainState``: params as given, optimizer leaves that mirror params (Adam moments) like
    their param, every other leaf (counts, step, the shapers' ``aux`` state) replicated."""
    from treejax.models import lora  # the optimizer state mirrors the trainable params (LoRA: the adapters)

    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, abstract_state.opt_state, lora.split(param_shardings)[0],
        transform_non_params=lambda _: replicated(mesh),
    )
    out = abstract_state.replace(params=param_shardings, opt_state=opt_shardings, step=replicated(mesh))
    if hasattr(abstract_state, "aux"):  # the stateful shapers' state (TrainState.aux): small, replicated
        out = out.replace(aux=jax.tree.map(lambda _: replicated(mesh), abstract_state.aux))
    return out


def jit_update(update_fn: Callable, state_shardings: Any, batch_shardings: Any, mesh: Mesh) -> Callable:
    """``jax.jit(update_fn)`` with explicit in/out shardings (metrics replicated) and the state donated."""
    return jax.jit(update_fn, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnames=("state",))


def place_train_state(params: Any, param_logical_axes: Any, create_state: Callable[[Any], Any],
                      optimizer: optax.GradientTransformation, mesh: Mesh, rules: Rules = DEFAULT_RULES,
                      donate: bool = False) -> tuple[Any, Any]:
    """Loaded ``params`` -> a sharded ``TrainState``: params placed by their logical axes, then
    ``create_state(params)`` jitted with the state's shardings as outputs. Returns ``(state, state_shardings)``.
    ``donate``: the placed params are donated to the state (no second copy of the weights at set-up; the caller's
    ``params`` must not be used afterwards)."""
    param_sh = logical_to_sharding(param_logical_axes, mesh, rules, params)
    params = jax.device_put(params, param_sh)
    state_sh = train_state_shardings(jax.eval_shape(create_state, params), param_sh, optimizer, mesh)
    create = jax.jit(create_state, out_shardings=state_sh, donate_argnums=(0,) if donate else ())
    return create(params), state_sh


def sharded_update(update_fn: Callable, state_shardings: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Callable:
    """``update(state, mini_batch)`` jitted once per mini-batch layout (the tree-packed update's shapes bucket):
    each layout gets its batch shardings (:func:`batch_sharding`) and :func:`jit_update`; the mini-batch is placed
    with them before the call. ``update.precompile(abstract_state, abstract_mini)`` compiles a layout ahead of
    time (:mod:`treejax.rl.precompile`)."""
    jitted: dict = {}

    def key(mini):
        return jax.tree.structure(mini), tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(mini))

    def update(state, mini):
        sig = key(mini)
        if sig not in jitted:
            sh = batch_sharding(mesh, mini, rules)
            jitted[sig] = (sh, jit_update(update_fn, state_shardings, sh, mesh))
        sh, fn = jitted[sig]
        return fn(state, jax.device_put(mini, sh))

    def precompile(abstract_state, abstract_mini) -> None:
        """Compiles the update for a mini-batch layout ahead of time (``jax.ShapeDtypeStruct`` arguments; the
        state's with its shardings): :mod:`treejax.rl.precompile`. A later call with that layout runs it."""
        sig = key(abstract_mini)
        if sig in jitted:
            return
        sh = batch_sharding(mesh, abstract_mini, rules)
        placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_mini, sh)
        jitted[sig] = (sh, jit_update(update_fn, state_shardings, sh, mesh).lower(abstract_state, placed).compile())

    update.precompile = precompile
    return update
