"""Presets copied from the public ``config.json`` of each checkpoint, plus tiny test configs derived from them."""

from __future__ import annotations

from treejax.models.config import ModelConfig

# Published total sizes (model cards), used by the tests to check the presets' parameter counts within 1%.
PUBLISHED_PARAMS = {
    "smollm2-135m": 134.5e6,
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-1.5b": 1.54e9,
    "qwen2.5-7b": 7.61e9,
    "qwen3-0.6b": 0.596e9,
    "qwen3-1.7b": 1.72e9,
    "qwen3-8b": 8.19e9,
}

_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
        pad_token_id=2,
    ),
    "qwen2.5-0.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qkv_bias=True, max_position_embeddings=32768, true_vocab_size=151665, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
    "qwen2.5-1.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qkv_bias=True, max_position_embeddings=32768, true_vocab_size=151665, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        qkv_bias=True, max_position_embeddings=32768, true_vocab_size=151665, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qk_norm=True, max_position_embeddings=40960, true_vocab_size=151669, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
    "qwen3-1.7b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        qk_norm=True, max_position_embeddings=40960, true_vocab_size=151669, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        qk_norm=True, max_position_embeddings=40960, true_vocab_size=151669, eos_token_ids=(151643, 151645),
        pad_token_id=151643,
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
    """Full-size preset by name, e.g. ``get_config("qwen2.5-0.5b", param_dtype="bfloat16")``."""
    if name not in _PRESETS:
        raise KeyError(f"unknown model preset {name!r}; valid presets: {preset_names()}")
    return _PRESETS[name].replace(**overrides)


def tiny_config(name: str, **overrides) -> ModelConfig:
    """A tiny config of the same family as preset ``name`` (same switches, GQA ratio kept when possible).

    Used by tests and notebooks: 2 layers, hidden 64, 4 query heads over 2 KV heads, head_dim 16, vocab 256.
    """
    base = get_config(name)
    tiny = base.replace(
        vocab_size=256, true_vocab_size=None, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
        pad_token_id=0,
    )
    return tiny.replace(**overrides)
