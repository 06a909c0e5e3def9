"""Low-rank adapters (LoRA) and a quantized frozen base (QLoRA) as transforms of the parameter tree.

A LoRA target ``W`` (one of the layer projections ``wq wk wv wo w_gate w_up w_down``, stacked over layers) gets two
trainable factors, and the layer computes

    y = x W + s (x A) B,         A: [*in, r],  B: [r, *out],  s = alpha / r           (Hu et al. 2021, arXiv 2106.09685)

where ``*in`` are the weight's input axes (``E`` for ``wq``; ``Q, H`` for ``wo``) and ``*out`` its output axes. ``A``
starts uniform in ``+-1/sqrt(fan_in)`` (PEFT's Kaiming-uniform with ``a = sqrt(5)``) and ``B`` at zero, so a new
adapter is exactly the base model (:func:`add_adapters`). The adapters live in the ordinary params tree, under
``params["layers"]["lora"][target] = {"a": [L, *in, r], "b": [L, r, *out]}`` with the per-layer scale
``params["layers"]["lora_scale"]: [L]`` beside them, so ``lax.scan`` over layers slices them with the rest and every
function that takes params (forward, prefill, decode, the log-prob head, the tree-packed update) runs a LoRA model
unchanged: :func:`dense` is the one place a projection is computed.

What trains: :func:`split` cuts the tree into the trainable adapters ``{"layers": {"lora": ...}}`` and the frozen
rest; the update differentiates only the former (no gradient, no Adam moments, no master copy of the base), and a
checkpoint holds only the adapters and their optimizer state (:func:`checkpoint_state`).

The frozen base (``LoRAConfig.base_dtype``): ``"bfloat16"`` (or ``"float32"``) casts every base leaf; ``"int8"``
(one scale per output channel), ``"nf4"`` (QLoRA's NormalFloat-4, Dettmers et al. 2023, arXiv 2305.14314) and
``"int4"`` (one scale per ``block_size`` inputs and output channel) quantize the seven projection weights with qwix's
``QArray`` (a pytree of ``qvalue``, ``scale``; ``W ~ qvalue * scale``) and cast the rest (embeddings, head, norms,
biases) to bf16. A quantized weight is dequantized to the compute dtype where it is used (one layer at a time).

The reference policy of the KL term is the base with the adapters off (:func:`without_adapters`): the same arrays,
no second copy. The sampler reads either the merged weights ``W + s A B`` (:func:`merge`, one weight-sized copy per
step, decode as fast as the plain model) or the unmerged tree (two small extra matmuls per projection and step, no
copy), ``LoRAConfig.sampler_weights``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.config_types import check_types

try:  # qwix: the quantized-array pytree of the QLoRA base (a declared dependency; optional for plain runs)
    import qwix
    from qwix import QArray
except ImportError:  # pragma: no cover - exercised only where qwix is missing
    qwix = None

    class QArray:  # noqa: D101  a placeholder type nothing is an instance of
        pass

#: Projections an adapter can target, with the number of input axes of each (after the stacked layers axis).
TARGETS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
#: How the frozen base is stored.
BASE_DTYPES = ("float32", "bfloat16", "int8", "nf4", "int4")
#: Which weights the sampler decodes with.
SAMPLER_WEIGHTS = ("merged", "unmerged")
_QTYPES = {"int8": jnp.int8, "nf4": "nf4", "int4": jnp.int4}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (module docstring). ``rank = 0``: off (the full fine-tune).

    ``alpha``: the adapters' scale is ``alpha / rank``. ``targets``: projections that get adapters (subset of
    :data:`TARGETS`). ``base_dtype``: how the frozen base is stored (:data:`BASE_DTYPES`). ``block_size``: inputs per
    scale of the 4-bit formats (``nf4``, ``int4``; QLoRA's 64). ``sampler_weights``: ``"merged"`` or ``"unmerged"``
    (:data:`SAMPLER_WEIGHTS`). ``seed``: the adapters' initialisation (``A``'s draw)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    base_dtype: str = "bfloat16"
    block_size: int = 64
    sampler_weights: str = "merged"
    seed: int = 0

    def __post_init__(self):
        check_types(self)
        object.__setattr__(self, "targets", tuple(self.targets))
        check_choice("LoRAConfig.base_dtype", self.base_dtype, BASE_DTYPES)
        check_choice("LoRAConfig.sampler_weights", self.sampler_weights, SAMPLER_WEIGHTS)
        for t in self.targets:
            check_choice("LoRAConfig.targets", t, tuple(TARGETS))
        if self.rank < 0:
            raise ValueError(f"LoRAConfig.rank must be >= 0 (0: no adapters), got {self.rank}")
        if self.rank and not self.targets:
            raise ValueError("LoRAConfig.targets is empty: name at least one projection (e.g. ('wq', 'wv'))")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRAConfig.targets names a projection twice: {self.targets}")
        if self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha}")
        if self.block_size < 1:
            raise ValueError(f"LoRAConfig.block_size must be >= 1, got {self.block_size}")
        if self.rank and self.base_dtype in _QTYPES and qwix is None:
            raise ValueError(f"LoRAConfig.base_dtype={self.base_dtype!r} needs the qwix package (pip install qwix)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# ----------------------------------------------------------------------------------------------- the model's side
def weight(w: Any, dtype) -> jax.Array:
    """A projection weight in ``dtype``: a cast, or the dequantization of a quantized base weight."""
    if isinstance(w, QArray):
        return qwix.dequantize(dataclasses.replace(w, scale=w.scale.astype(dtype)))
    return w.astype(dtype)


def dense(lp: dict, name: str, x: jax.Array, spec: str) -> jax.Array:
    """``einsum(spec, x, W)`` of layer weight ``lp[name]`` plus its adapter's ``s (x A) B`` when it has one.

    ``spec`` is the base projection's einsum (``"ble,eqh->blqh"``); the adapter's two einsums are derived from it:
    the weight's letters that ``x`` also has are its inputs (contracted by ``A``), the others its outputs (made by
    ``B``). Both run in ``x``'s dtype, like the base."""
    dt = x.dtype
    y = jnp.einsum(spec, x, weight(lp[name], dt))
    adapters = lp.get("lora")
    if adapters is None or name not in adapters:
        return y
    x_spec, rest = spec.split(",")
    w_spec, out_spec = rest.split("->")
    ins = "".join(c for c in w_spec if c in x_spec)
    outs = "".join(c for c in w_spec if c not in x_spec)
    keep = "".join(c for c in x_spec if c not in ins)
    ab = adapters[name]
    z = jnp.einsum(f"{x_spec},{ins}r->{keep}r", x, ab["a"].astype(dt))
    delta = jnp.einsum(f"{keep}r,r{outs}->{out_spec}", z, ab["b"].astype(dt))
    return y + (lp["lora_scale"].astype(dt) * delta)


# ----------------------------------------------------------------------------------------------- building the tree
def has_adapters(params: Any) -> bool:
    layers = params.get("layers") if isinstance(params, dict) else None
    return isinstance(layers, dict) and "lora" in layers


def add_adapters(params: dict, config: LoRAConfig, key: jax.Array | None = None) -> dict:
    """``params`` with fresh adapters on ``config.targets`` (fp32; ``B = 0``, so the model is unchanged) and the
    per-layer scale ``alpha / rank``. The base leaves are returned as given (:func:`freeze_base` stores them)."""
    if not config.enabled:
        raise ValueError("LoRAConfig.rank is 0: no adapters to add")
    if has_adapters(params):
        raise ValueError("these params already carry LoRA adapters")
    layers = params["layers"]
    if not isinstance(layers, dict):
        raise ValueError("add_adapters takes the stacked layout (params['layers'] a dict of [L, ...] arrays)")
    key = jax.random.key(config.seed) if key is None else key
    r, adapters = config.rank, {}
    for i, t in enumerate(config.targets):
        if t not in layers:
            raise ValueError(f"LoRA target {t!r} is not a weight of this model (it has {sorted(layers)})")
        shape = layers[t].shape
        n_in = TARGETS[t]
        L, ins, outs = shape[0], tuple(shape[1:1 + n_in]), tuple(shape[1 + n_in:])
        bound = 1.0 / math.sqrt(math.prod(ins))
        a = jax.random.uniform(jax.random.fold_in(key, i), (L, *ins, r), jnp.float32, -bound, bound)
        adapters[t] = {"a": a, "b": jnp.zeros((L, r, *outs), jnp.float32)}
    L = next(iter(adapters.values()))["a"].shape[0]
    new_layers = dict(layers, lora=adapters, lora_scale=jnp.full((L,), config.scale, jnp.float32))
    return dict(params, layers=new_layers)


def _quantize(w: jax.Array, name: str, config: LoRAConfig) -> QArray:
    """One projection weight ``[L, *in, *out]`` quantized: one scale per layer and output channel (int8), or per
    layer, output channel and block of ``block_size`` entries of the last input axis (nf4, int4). Layer by layer
    (``lax.map``): qwix's NF4 rounding compares every entry with all 16 levels at once (64 bytes an entry), which
    for a whole 7B MLP weight would be 113 GiB."""
    n_in = TARGETS[name]
    per_layer = w.shape[1:]
    channel_axes = tuple(range(n_in, len(per_layer)))  # the output axes
    tiled = {}
    if config.base_dtype != "int8":
        reduce_axis = n_in - 1  # the last input axis; the other input axes (wo's heads) get their own scales
        channel_axes = tuple(sorted(set(channel_axes) | set(range(0, n_in - 1))))
        if per_layer[reduce_axis] % config.block_size:
            raise ValueError(f"LoRAConfig.block_size={config.block_size} does not divide {name}'s input axis of "
                             f"{per_layer[reduce_axis]}; pick a divisor (QLoRA uses 64)")
        tiled = {reduce_axis: config.block_size}
    qtype = _QTYPES[config.base_dtype]
    one = lambda x: qwix.quantize(x.astype(jnp.float32), qtype, channelwise_axes=channel_axes,  # noqa: E731
                                  tiled_axes=tiled, scale_dtype=jnp.bfloat16)
    return jax.jit(lambda x: jax.lax.map(one, x))(w)


def freeze_base(params: dict, config: LoRAConfig) -> dict:
    """The base leaves stored as ``config.base_dtype`` (module docstring); adapters and scale untouched (params
    without adapters: the base alone, stored the same way)."""
    trainable, base = split(params) if has_adapters(params) else (None, params)
    float_dtype = jnp.float32 if config.base_dtype == "float32" else jnp.bfloat16
    cast = lambda x: x.astype(float_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    layers = dict(base["layers"])
    scale = layers.pop("lora_scale", None)
    for name, w in layers.items():
        if name in TARGETS and config.base_dtype in _QTYPES and not isinstance(w, QArray):
            layers[name] = _quantize(w, name, config)
        elif not isinstance(w, QArray):
            layers[name] = cast(w)
    if scale is not None:
        layers["lora_scale"] = scale
    base = dict({k: cast(v) for k, v in base.items() if k != "layers"}, layers=layers)
    return base if trainable is None else combine(trainable, base)


def prepare(params: dict, config: LoRAConfig) -> dict:
    """Loaded full-precision params -> the LoRA run's tree: adapters added, base frozen as ``base_dtype``."""
    return freeze_base(add_adapters(params, config), config)


# ----------------------------------------------------------------------------------------------- views of the tree
def split(params: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)``: with adapters, ``({"layers": {"lora": adapters}}, the rest)``; without, ``(params,
    None)`` (everything trains). Works on any tree of the params' dict structure (shardings, axes, shapes)."""
    if not has_adapters(params):
        return params, None
    layers = dict(params["layers"])
    adapters = layers.pop("lora")
    return {"layers": {"lora": adapters}}, dict(params, layers=layers)


def combine(trainable: Any, frozen: Any) -> Any:
    """The inverse of :func:`split`."""
    if frozen is None:
        return trainable
    return dict(frozen, layers=dict(frozen["layers"], lora=trainable["layers"]["lora"]))


def with_trainable(params: Any, trainable: Any) -> Any:
    """``params`` with its trainable part replaced (e.g. by an EMA of the adapters)."""
    return combine(trainable, split(params)[1])


def without_adapters(params: Any) -> Any:
    """The base alone (the adapters off): the KL term's reference policy, sharing the base's arrays."""
    if not has_adapters(params):
        return params
    layers = {k: v for k, v in params["layers"].items() if k not in ("lora", "lora_scale")}
    return dict(params, layers=layers)


def merge(params: Any, dtype=None) -> Any:
    """The plain model ``W + s A B`` (adapters folded in, quantized weights dequantized), in ``dtype`` (default:
    the base's float dtype; bf16 for a quantized base). Computed in fp32."""
    if not has_adapters(params):
        return params
    layers = dict(params["layers"])
    adapters, scale = layers.pop("lora"), layers.pop("lora_scale")
    floats = [x.dtype for x in jax.tree.leaves(layers) if jnp.issubdtype(x.dtype, jnp.floating)]
    out_dtype = jnp.dtype(dtype) if dtype is not None else (floats[0] if floats else jnp.bfloat16)
    for name, w in list(layers.items()):
        if isinstance(w, QArray):
            layers[name] = weight(w, jnp.float32)
        if name in adapters:
            a, b = adapters[name]["a"], adapters[name]["b"]
            n_in = a.ndim - 2
            ins = "ijk"[:n_in]
            outs = "uvw"[: b.ndim - 2]
            delta = jnp.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a.astype(jnp.float32), b.astype(jnp.float32))
            delta = delta * scale.astype(jnp.float32).reshape((-1,) + (1,) * (delta.ndim - 1))
            layers[name] = (layers[name].astype(jnp.float32) + delta).astype(out_dtype)
        elif isinstance(w, QArray):
            layers[name] = layers[name].astype(out_dtype)
    return dict(params, layers=layers)


class _BaseReference:
    """The KL term's reference when adapters train: the current base with the adapters off
    (:func:`without_adapters` of the state's params at the time of use; nothing is copied)."""

    def __repr__(self) -> str:
        return "lora.BASE_REFERENCE"


BASE_REFERENCE = _BaseReference()


def resolve_reference(reference: Any, params: Any) -> Any:
    """``reference`` as params: :data:`BASE_REFERENCE` becomes ``without_adapters(params)``."""
    return without_adapters(params) if reference is BASE_REFERENCE else reference


def checkpoint_state(state: Any) -> Any:
    """What a checkpoint of a ``TrainState`` holds: with adapters, the state with only the trainable params (the
    frozen base comes back from the model's weights); without, the state itself."""
    trainable, frozen = split(state.params)
    return state if frozen is None else state.replace(params=trainable)


def restored_state(state: Any, restored: Any) -> Any:
    """The inverse of :func:`checkpoint_state`: ``restored`` (the checkpoint's state) with ``state``'s frozen base."""
    return restored.replace(params=with_trainable(state.params, restored.params)) if has_adapters(state.params) \
        else restored


# ----------------------------------------------------------------------------------------------- sharding
def logical_axes(axes: dict, params: dict) -> dict:
    """The logical axes of a LoRA params tree, from the plain model's ``axes`` (``transformer.param_logical_axes``):
    ``A`` keeps its weight's input axes, ``B`` its output axes (the rank axis replicated), the scale is per layer;
    a quantized weight's ``qvalue`` has its weight's axes and its ``scale`` the same where it has the full size
    (replicated along reduced or blocked axes)."""
    layer_axes = dict(axes["layers"])
    layers = params["layers"]
    for name, w in layers.items():
        if isinstance(w, QArray):
            full = layer_axes[name]
            sc = tuple(n if s == d else None for n, s, d in zip(full, w.scale.shape, w.shape))
            layer_axes[name] = QArray(qvalue=full, scale=sc, zero_point=None, qtype=w.qtype)
    if "lora" in layers:
        adapters = {}
        for name, ab in layers["lora"].items():
            full = axes["layers"][name]
            n_in = TARGETS[name]
            adapters[name] = {"a": full[: 1 + n_in] + (None,), "b": (full[0], None) + full[1 + n_in:]}
        layer_axes["lora"] = adapters
        layer_axes["lora_scale"] = ("layers",)
    return dict(axes, layers=layer_axes)


def param_bytes(params: Any) -> tuple[int, int]:
    """``(trainable bytes, frozen bytes)`` of a params tree (arrays or ``ShapeDtypeStruct``s; int4 counted at half
    a byte)."""
    def nbytes(tree):
        total = 0
        for x in jax.tree.leaves(tree):
            bits = jnp.dtype(x.dtype).itemsize * 8 if jnp.dtype(x.dtype).name not in ("int4", "uint4") else 4
            total += math.prod(x.shape) * bits // 8
        return total
    trainable, frozen = split(params)
    return nbytes(trainable), (0 if frozen is None else nbytes(frozen))


__all__ = ["LoRAConfig", "TARGETS", "BASE_DTYPES", "SAMPLER_WEIGHTS", "dense", "weight", "add_adapters",
           "freeze_base", "prepare", "split", "combine", "with_trainable", "without_adapters", "merge",
           "BASE_REFERENCE", "resolve_reference", "checkpoint_state", "restored_state", "logical_axes",
           "has_adapters", "param_bytes"]
