"""Model configuration: one frozen, hashable dataclass shared by the Llama, Qwen2 and Qwen3 families.

The config is static under ``jax.jit`` (it is hashable); everything that varies per call is an array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

#: The supported architectures, each with its transformers model class. A name is at once
#: ``ModelConfig.architecture``, the HF config's ``model_type`` and the GGUF ``general.architecture``.
HF_MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ARCHITECTURES = tuple(HF_MODEL_CLASSES)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters.

    Families differ only in two switches:
      * ``qkv_bias`` — Qwen2/Qwen2.5 add a bias to the q/k/v projections;
      * ``qk_norm`` — Qwen3 applies an RMSNorm over ``head_dim`` to each query and key head before RoPE.
    ``true_vocab_size`` is the tokenizer's real vocabulary (Qwen pads its embedding matrix to a multiple of
    128 rows); logits of ids at or above it are masked to -inf wherever a distribution is formed.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    true_vocab_size: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.true_vocab_size is not None and not 0 < self.true_vocab_size <= self.vocab_size:
            raise ValueError(f"true_vocab_size {self.true_vocab_size} must be in (0, vocab_size={self.vocab_size}]")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

    @property
    def sampling_vocab_size(self) -> int:
        """Number of ids that may be sampled / carry probability mass."""
        return self.vocab_size if self.true_vocab_size is None else self.true_vocab_size

    @property
    def params_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def activation_dtype(self) -> Any:
        return _DTYPES[self.compute_dtype]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        E, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
        Q, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        per_layer = E * Q * H + 2 * E * K * H + Q * H * E + 3 * E * F + 2 * E
        if self.qkv_bias:
            per_layer += Q * H + 2 * K * H
        if self.qk_norm:
            per_layer += 2 * H
        total = self.num_layers * per_layer + V * E + E
        if not self.tie_word_embeddings:
            total += V * E
        return total
