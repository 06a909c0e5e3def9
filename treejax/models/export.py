"""Export treejax params to a Hugging Face checkpoint folder that ``transformers`` loads offline.

Writes ``config.json`` (``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``),
``model.safetensors`` (HF ``[out, in]`` layouts: the inverse of the mapping in
:mod:`treejax.models.hf_checkpoint`), ``generation_config.json`` and, given a tokenizer, its files.

The safetensors file is written in a streaming way: the header (names, dtypes, shapes, byte offsets) is
computed from the config first, then every tensor is fetched from device, converted and appended one at a
time, so host memory never holds more than one layer's tensor.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import ml_dtypes
import numpy as np

from treejax.models.config import HF_MODEL_CLASSES, ModelConfig
from treejax.models.hf_checkpoint import tensor_specs

_ST_DTYPE = {"float32": ("F32", np.float32), "bfloat16": ("BF16", ml_dtypes.bfloat16),
             "float16": ("F16", np.float16)}


def hf_config_dict(config: ModelConfig, dtype: str | None = None) -> dict:
    """The ``config.json`` transformers needs to rebuild ``config`` (plain RoPE, full attention)."""
    c = config
    eos = list(c.eos_token_ids)
    out = {
        "architectures": [HF_MODEL_CLASSES[c.architecture]], "model_type": c.architecture,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": c.bos_token_id, "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "pad_token_id": c.pad_token_id, "torch_dtype": dtype or c.param_dtype,
    }
    if c.architecture == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif c.architecture == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    else:
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=c.num_layers)
    return out


def _get(tree, key):
    for k in key:
        tree = tree[k]
    return tree


def save_safetensors_streaming(path: str, entries, metadata: dict | None = None) -> None:
    """``entries``: list of ``(name, st_dtype, shape, np_dtype, produce)`` with ``produce() -> np.ndarray``.

    Safetensors layout: ``u64 little-endian header length N``, ``N`` bytes of JSON header (space padded
    to 8-byte alignment), then the raw little-endian tensor bytes at the header's ``data_offsets``.
    """
    header, offset = {}, 0
    for name, st_dtype, shape, np_dtype, _ in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, _, shape, np_dtype, produce in entries:
            arr = np.ascontiguousarray(produce(), dtype=np_dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"tensor {name!r}: produced shape {arr.shape}, header says {tuple(shape)}")
            f.write(arr.tobytes())


def export_hf(params: dict, config: ModelConfig, folder: str, tokenizer=None, dtype: str | None = None) -> str:
    """Writes ``params`` as an HF checkpoint folder; returns ``folder``.

    ``dtype`` (default ``config.param_dtype``): storage dtype of the safetensors weights.
    """
    dtype = dtype or config.param_dtype
    st_dtype, np_dtype = _ST_DTYPE[dtype]
    os.makedirs(folder, exist_ok=True)
    entries = []
    for spec in tensor_specs(config):
        leaf = _get(params, spec.key)
        for l in range(config.num_layers if spec.stacked else 1):
            def produce(leaf=leaf, l=l, spec=spec):
                x = jax.device_get(leaf[l] if spec.stacked else leaf)
                return spec.to_hf(np.asarray(x).astype(np.float32)).astype(np_dtype)
            entries.append((spec.hf_name(l), st_dtype, spec.hf_shape, np_dtype, produce))
    save_safetensors_streaming(os.path.join(folder, "model.safetensors"), entries)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config_dict(config, dtype), f, indent=2)
    eos = list(config.eos_token_ids) or (list(tokenizer.eos_ids) if tokenizer is not None else [])
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
           "pad_token_id": config.pad_token_id, "do_sample": False}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v not in (None, [])}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
