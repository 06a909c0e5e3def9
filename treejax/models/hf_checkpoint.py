"""Load a local Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``) into treejax params.

Name / layout mapping (HF ``nn.Linear`` weights are stored ``[out, in]``; treejax keeps ``[in, ...out]``):

    model.embed_tokens.weight                  [V, E]      -> embed       [V, E]          (as is)
    model.layers.{l}.input_layernorm.weight    [E]         -> attn_norm   [Ly, E]
    model.layers.{l}.self_attn.q_proj.weight   [Q*H, E]    -> wq          [Ly, E, Q, H]   (W.T.reshape)
    model.layers.{l}.self_attn.k_proj.weight   [K*H, E]    -> wk          [Ly, E, K, H]
    model.layers.{l}.self_attn.v_proj.weight   [K*H, E]    -> wv          [Ly, E, K, H]
    model.layers.{l}.self_attn.o_proj.weight   [E, Q*H]    -> wo          [Ly, Q, H, E]   (W.T.reshape)
    model.layers.{l}.self_attn.{q,k,v}_proj.bias            -> bq/bk/bv    [Ly, Q|K, H]    (Qwen2)
    model.layers.{l}.self_attn.{q,k}_norm.weight [H]        -> q_norm/k_norm [Ly, H]       (Qwen3)
    model.layers.{l}.post_attention_layernorm.weight [E]    -> mlp_norm    [Ly, E]
    model.layers.{l}.mlp.gate_proj.weight      [F, E]      -> w_gate      [Ly, E, F]      (W.T)
    model.layers.{l}.mlp.up_proj.weight        [F, E]      -> w_up        [Ly, E, F]      (W.T)
    model.layers.{l}.mlp.down_proj.weight      [E, F]      -> w_down      [Ly, F, E]      (W.T)
    model.norm.weight                          [E]         -> final_norm  [E]
    lm_head.weight                             [V, E]      -> lm_head     [E, V]          (W.T; untied only)

Memory: tensors are read one at a time with ``safetensors.safe_open`` (memory-mapped) and written into a
single host buffer for one parameter kind (e.g. all layers' ``wq``); that buffer is handed to
``jax.device_put`` with its target sharding and released before the next kind is read. Peak host memory is
therefore the largest single stacked parameter (plus whatever the devices themselves hold), never two
copies of the model.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from treejax.errors import ModelFileError, UserError
from treejax.models.config import ARCHITECTURES, ModelConfig
from treejax.models.transformer import param_shapes

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(UserError, ValueError):
    """A checkpoint folder or file cannot be loaded; the message names the file and the problem (a user error:
    ``treejax-train`` prints it as one line)."""


# ----------------------------------------------------------------------------------------------- config.json
def _rope_theta(hf: dict, source: str) -> float:
    """RoPE base from ``rope_theta`` (transformers v4) or ``rope_parameters`` (v5); only plain RoPE."""
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise CheckpointError(f"{source}: unsupported field rope_scaling={scaling!r} (only plain RoPE is "
                                  "implemented; rope_scaling must be null)")
    params = hf.get("rope_parameters")
    if params:
        if isinstance(params, dict) and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
            raise CheckpointError(f"{source}: unsupported per-layer-type rope_parameters={params!r}")
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise CheckpointError(f"{source}: unsupported rope_parameters.rope_type={kind!r} (only 'default' RoPE)")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def config_from_hf(hf: dict, param_dtype: str = "float32", compute_dtype: str | None = None,
                   source: str = "config.json") -> ModelConfig:
    """Translate an HF ``config.json`` dict into a :class:`ModelConfig`.

    Raises :class:`CheckpointError` naming the field for anything the treejax forward would compute
    differently from transformers: unknown ``model_type``, RoPE scaling, sliding-window attention, a
    non-SiLU activation, an o_proj / MLP bias, or quantized weights.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{source}: unsupported architecture model_type={model_type!r} "
                              f"(architectures={hf.get('architectures')}); supported: {ARCHITECTURES}")
    if hf.get("quantization_config"):
        raise CheckpointError(f"{source}: quantized checkpoints are not supported "
                              f"(quantization_config={hf['quantization_config']!r})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: unsupported field hidden_act={act!r} (the MLP is SwiGLU with silu)")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{source}: unsupported field use_sliding_window=True (sliding_window="
                              f"{hf.get('sliding_window')}); only full causal attention is implemented")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"{source}: unsupported field layer_types={sorted(set(layer_types))} "
                              "(only 'full_attention' layers are implemented)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: unsupported field mlp_bias=True")
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias.
    elif attention_bias:
        # Llama/Qwen3 ``attention_bias`` also adds an o_proj bias, which the treejax block does not have.
        raise CheckpointError(f"{source}: unsupported field attention_bias=True for model_type={model_type!r} "
                              "(it adds an o_proj bias)")
    else:
        qkv_bias = False
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    try:
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=_rope_theta(hf, source),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            param_dtype=param_dtype,
            compute_dtype=compute_dtype or param_dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing") from None
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def load_hf_config(folder: str, param_dtype: str = "float32", compute_dtype: str | None = None) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ModelFileError(f"checkpoint folder not found: {folder}")
    if not os.path.isfile(path):
        raise ModelFileError(f"missing file {path} (an HF checkpoint folder needs config.json)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return config_from_hf(hf, param_dtype, compute_dtype, source=path)


# ----------------------------------------------------------------------------------------------- tensor mapping
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One treejax parameter and its HF tensor(s).

    ``hf_name(l)`` gives the HF tensor name of layer ``l`` (``l`` is ignored for un-stacked params);
    ``to_treejax`` maps an HF array ``[hf_shape]`` to the per-layer treejax slice; ``to_hf`` is its inverse.
    """

    key: tuple[str, ...]
    hf_name: Callable[[int], str]
    hf_shape: tuple[int, ...]
    stacked: bool
    to_treejax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """The HF <-> treejax mapping for ``config`` (same leaves as :func:`transformer.param_shapes`)."""
    c = config
    E, F, V, Q, K, H = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim
    ident = lambda w: w  # noqa: E731
    T = lambda w: w.T  # noqa: E731

    def layer(name):
        return lambda l: f"model.layers.{l}.{name}"

    def proj_in(n):  # [n*H, E] -> [E, n, H]
        return (lambda w: w.T.reshape(E, n, H)), (lambda w: w.reshape(E, n * H).T)

    specs = [TensorSpec(("embed",), lambda l: "model.embed_tokens.weight", (V, E), False, ident, ident),
             TensorSpec(("final_norm",), lambda l: "model.norm.weight", (E,), False, ident, ident)]
    if not c.tie_word_embeddings:
        specs.append(TensorSpec(("lm_head",), lambda l: "lm_head.weight", (V, E), False, T, T))
    lay = [("attn_norm", "input_layernorm.weight", (E,), ident, ident),
           ("mlp_norm", "post_attention_layernorm.weight", (E,), ident, ident),
           ("wq", "self_attn.q_proj.weight", (Q * H, E), *proj_in(Q)),
           ("wk", "self_attn.k_proj.weight", (K * H, E), *proj_in(K)),
           ("wv", "self_attn.v_proj.weight", (K * H, E), *proj_in(K)),
           ("wo", "self_attn.o_proj.weight", (E, Q * H), lambda w: w.T.reshape(Q, H, E),
            lambda w: w.reshape(Q * H, E).T),
           ("w_gate", "mlp.gate_proj.weight", (F, E), T, T),
           ("w_up", "mlp.up_proj.weight", (F, E), T, T),
           ("w_down", "mlp.down_proj.weight", (E, F), T, T)]
    if c.qkv_bias:
        for key, name, n in (("bq", "q_proj", Q), ("bk", "k_proj", K), ("bv", "v_proj", K)):
            lay.append((key, f"self_attn.{name}.bias", (n * H,), (lambda n: lambda w: w.reshape(n, H))(n),
                        lambda w: w.reshape(-1)))
    if c.qk_norm:
        lay += [("q_norm", "self_attn.q_norm.weight", (H,), ident, ident),
                ("k_norm", "self_attn.k_norm.weight", (H,), ident, ident)]
    for key, name, shape, fwd, inv in lay:
        specs.append(TensorSpec(("layers", key), layer(name), shape, True, fwd, inv))
    return specs


# Tensors that may sit in a checkpoint without being parameters of the treejax model.
def _ignorable(name: str, config: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


# ----------------------------------------------------------------------------------------------- safetensors index
def _weight_map(folder: str) -> dict[str, str]:
    """``{tensor name: file path}`` from ``model.safetensors.index.json`` or by listing every ``*.safetensors``."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wm = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        out = {}
        for name, fname in wm.items():
            path = os.path.join(folder, fname)
            if not os.path.isfile(path):
                raise ModelFileError(f"missing file {path} (listed in {index} for tensor {name!r})")
            out[name] = path
        return out
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (found {others}; only safetensors is supported)" if others else ""
        raise ModelFileError(f"missing file {os.path.join(folder, 'model.safetensors')}: no *.safetensors "
                             f"files in {folder}{hint}")
    out = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                out[name] = path
    return out


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file, it is truncated or corrupt ({e})") from None
    except FileNotFoundError:
        raise ModelFileError(f"missing file {path}") from None


class _Reader:
    """Keeps one ``safe_open`` handle per file (memory-mapped; tensors are read one at a time)."""

    def __init__(self, weight_map: dict[str, str]):
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weight_map:
            files = sorted({os.path.basename(p) for p in self.weight_map.values()})
            raise CheckpointError(f"missing tensor {name!r}: not found in {files}")
        path = self.weight_map[name]
        if path not in self._handles:
            self._handles[path] = _open(path).__enter__()
        f = self._handles[path]
        try:
            shape = tuple(f.get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None
        if shape != tuple(expected_shape):
            raise CheckpointError(f"tensor {name!r} in {path} has shape {shape}, expected {tuple(expected_shape)} "
                                  "from config.json")
        try:
            return f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}, file truncated or corrupt ({e})") from None

    def close(self):
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()


def _get_path(tree, key):
    for k in key:
        if tree is None:
            return None
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def _set_path(tree: dict, key: tuple[str, ...], value):
    for k in key[:-1]:
        tree = tree.setdefault(k, {})
    tree[key[-1]] = value


def place(array: np.ndarray, sharding=None) -> jax.Array:
    """Host array -> device array, directly into ``sharding`` when given (no intermediate replicated copy)."""
    return jax.device_put(array, sharding) if sharding is not None else jnp.asarray(array)


def load_stacked_params(config: ModelConfig, fetch: Callable[[TensorSpec, int], np.ndarray],
                        specs: list[TensorSpec], shardings: dict | None = None) -> dict:
    """Builds the params pytree one parameter kind at a time.

    ``fetch(spec, layer)`` returns the HF-layout array for one tensor. Each kind's ``[Ly, ...]`` host buffer
    (in ``config.param_dtype``) is filled layer by layer, placed on device, then dropped.
    """
    shapes = param_shapes(config)
    dtype = _NP_DTYPES[config.param_dtype]
    params: dict = {}
    for spec in specs:
        shape = _get_path(shapes, spec.key)
        buf = np.empty(shape, dtype)
        for l in range(config.num_layers if spec.stacked else 1):
            value = spec.to_treejax(fetch(spec, l)).astype(dtype, copy=False)
            if spec.stacked:
                buf[l] = value
            else:
                buf[...] = value
        _set_path(params, spec.key, place(buf, _get_path(shardings, spec.key)))
        del buf
    return params


def load_hf_checkpoint(folder: str, param_dtype: str = "float32", compute_dtype: str | None = None,
                       shardings: dict | None = None) -> tuple[ModelConfig, dict]:
    """Reads ``folder/config.json`` and its safetensors into ``(ModelConfig, params)``.

    ``shardings``: optional pytree like the params whose leaves are ``jax.sharding.Sharding`` (or None);
    every stacked parameter is ``jax.device_put`` straight into it. Errors name the file and the problem:
    missing files, truncated safetensors, a tensor whose shape disagrees with ``config.json``, a missing
    tensor, or a tensor the model has no place for.
    """
    config = load_hf_config(folder, param_dtype, compute_dtype)
    weight_map = _weight_map(folder)
    specs = tensor_specs(config)
    expected = {spec.hf_name(l) for spec in specs for l in range(config.num_layers if spec.stacked else 1)}
    unexpected = sorted(n for n in weight_map if n not in expected and not _ignorable(n, config))
    if unexpected:
        raise CheckpointError(f"{folder}: tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                              f"(in {os.path.basename(weight_map[unexpected[0]])}) have no place in a "
                              f"{config.architecture} model with this config.json")
    reader = _Reader(weight_map)
    try:
        params = load_stacked_params(config, lambda spec, l: reader.get(spec.hf_name(l), spec.hf_shape), specs,
                                     shardings)
    finally:
        reader.close()
    return config, params
